"""Verify / decode attention on XLA CPU over the KV cache read in place: a C++ kernel behind
the XLA FFI, and its jnp reference.

    out = cache_attention(q, k_new, v_new, k_stack, v_stack, layer, lengths, tree_mask)
    out = cache_attention_reference(...)      # the same inputs, jnp

What `kernels.reference.verify_attention_reference` computes for layer `layer` of the cache,
with the cache given as the whole stack (`KVCache.k [L, B, KVH, Dh, S]`, `.v [L, B, KVH, S,
Dh]`). Why a kernel: XLA CPU copies each layer's slice out of the stacked cache before its dots
read it (the cache runs through the layer loop as a scanned input), and the dots read the whole
buffer, masked, however much of it the rows hold: at decode both are the cache's bytes again
(docs/quantization.md). The kernel reads each row's prefix `[0, lengths[b])` only, in place,
chunk by chunk (`kernels/attention_cpu.cc`), f32, and a row's result does not depend on the
other rows. Differentiable (the backward pass is the reference's) and vmappable (a map).
A new token the mask does not let see itself (`tree_mask[b, t, t]` False) is dead: its
output is zeros and the kernel computes nothing for it (a verify's rows for draft nodes deeper
than the step's draft, `specjax.verify`); `cache_attention_reference` zeroes those rows too.

f32 queries and cache only; the caller (`models.llama`) keeps XLA's path for other dtypes, on
a device mesh, and when the kernel is not available (`available()`: `SPECJAX_CPU_KERNELS=0`,
no compiler, a failed build; `kernels.cpu_ffi`).
"""
from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specjax.kernels import cpu_ffi
from specjax.kernels.reference import verify_attention_reference

#: the FFI target's name
TARGET = "specjax_cache_attention"
SOURCE = Path(__file__).with_name("attention_cpu.cc")


def available(folder: Path) -> str | None:
    """None when the kernel is registered with XLA (built into `folder` if needed, once per
    process), else the reason it is not."""
    return cpu_ffi.available(SOURCE, {TARGET: "SpecjaxCacheAttention"}, folder)


def cache_attention_reference(q, k_new, v_new, k_stack, v_stack, layer, lengths, tree_mask, *,
                              scale: float | None = None) -> jax.Array:
    """`verify_attention_reference` over layer `layer` (int32 `[]`) of the stacked cache, a dead
    token's rows (`tree_mask[b, t, t]` False) zeros."""
    k_cache, v_cache = (jax.lax.dynamic_index_in_dim(a, layer, keepdims=False) for a in (k_stack, v_stack))
    out = verify_attention_reference(q, k_new, v_new, k_cache, v_cache, lengths, tree_mask, scale=scale)
    live = jnp.diagonal(tree_mask, axis1=1, axis2=2)[:, :, None, None]
    return jnp.where(live, out, jnp.zeros((), out.dtype))


def cache_attention(q, k_new, v_new, k_stack, v_stack, layer, lengths, tree_mask, *,
                    scale: float | None = None) -> jax.Array:
    """q `[B, T, Hq, Dh]`, k_new / v_new `[B, T, KVH, Dh]`, k_stack `[L, B, KVH, Dh, S]`,
    v_stack `[L, B, KVH, S, Dh]` (f32), layer int32 `[]`, lengths int32 `[B]`, tree_mask bool
    `[B, T, T]` -> `[B, T, Hq, Dh]` in q's dtype, by the CPU kernel (call `available()` first:
    this one assumes it)."""
    if k_stack.dtype != jnp.float32 or v_stack.dtype != jnp.float32:
        raise ValueError(f"cache_attention: the kernel reads an f32 cache, not {k_stack.dtype}")
    batch, _, num_heads, head_dim = q.shape
    if (k_stack.ndim != 5 or k_stack.shape[1:4] != (batch, k_new.shape[2], head_dim)
            or v_stack.shape != (*k_stack.shape[:3], k_stack.shape[4], head_dim)
            or num_heads % k_stack.shape[2]):
        raise ValueError(f"cache_attention: q {q.shape}, k {k_stack.shape} and v {v_stack.shape} "
                         "do not fit")
    scale = head_dim ** -0.5 if scale is None else float(scale)
    f32 = [jnp.asarray(a, jnp.float32) for a in (q, k_new, v_new)]
    out = _attention(scale)(*f32, k_stack, v_stack, jnp.asarray(layer, jnp.int32),
                            jnp.asarray(lengths, jnp.int32), jnp.asarray(tree_mask, bool))
    return out.astype(q.dtype)


@functools.cache
def _attention(scale: float):
    """The kernel's call at one softmax scale (an FFI attribute, static): custom_vjp (backward
    by the reference) over custom_vmap (a map of the call)."""

    @jax.custom_batching.custom_vmap
    def call(q, k_new, v_new, k_stack, v_stack, layer, lengths, tree_mask):
        out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
        return jax.ffi.ffi_call(TARGET, out)(q, k_new, v_new, k_stack, v_stack, layer, lengths,
                                             tree_mask.astype(jnp.int8), scale=np.float32(scale))

    @call.def_vmap
    def call_vmap(axis_size, in_batched, *args):
        mapped = [a if batched else jnp.broadcast_to(a, (axis_size, *jnp.shape(a)))
                  for a, batched in zip(args, in_batched)]
        return jax.lax.map(lambda one: call(*one), tuple(mapped)), True

    @jax.custom_vjp
    def attention(*args):
        return call(*args)

    def forward(*args):
        return call(*args), args

    def backward(residuals, grad):
        q, k_new, v_new, k_stack, v_stack, layer, lengths, tree_mask = residuals
        _, pullback = jax.vjp(
            lambda *a: cache_attention_reference(*a, layer, lengths, tree_mask, scale=scale),
            q, k_new, v_new, k_stack, v_stack)
        return (*pullback(grad), None, None, None)

    attention.defvjp(forward, backward)
    return attention
