"""The argmax of each row on XLA CPU: a C++ kernel behind the XLA FFI, and its jnp reference.

    i = argmax(x)              # x f32 [..., V] -> int32 [...]
    i = argmax_reference(x)    # jnp.argmax(x, axis=-1)

The first index of a row's largest value, or of its first NaN (what `jnp.argmax` gives).
Greedy decoding takes the argmax of every verified token's logits; XLA CPU runs it as a
variadic reduce at ~0.5 GB/s (SmolLM2's 49152 logits, a verify of 9 tokens at B = 8: ~5 ms of
a ~25 ms step), the kernel at the speed of reading the row twice (`kernels/argmax_cpu.cc`).
No gradient (an index: the input is held by `stop_gradient`); vmappable (more rows of one
call). `rows_argmax` is what the decoding loop calls: the kernel where it can run (the CPU
backend, one device, built), else the reference.
"""
from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp

from specjax.kernels import cpu_ffi

#: the FFI target's name
TARGET = "specjax_argmax_rows"
SOURCE = Path(__file__).with_name("argmax_cpu.cc")


def argmax_reference(x: jax.Array) -> jax.Array:
    """`[..., V]` -> int32 `[...]`: jnp.argmax over the last axis."""
    return jnp.argmax(x, axis=-1).astype(jnp.int32)


def argmax(x: jax.Array) -> jax.Array:
    """x `[..., V]` (cast to f32) -> int32 `[...]` by the CPU kernel (call `available()` first:
    this one assumes it)."""
    if x.ndim < 1 or x.shape[-1] == 0:
        raise ValueError(f"argmax: x {x.shape} needs a non-empty last axis")
    return _call(jax.lax.stop_gradient(jnp.asarray(x, jnp.float32)))


@jax.custom_batching.custom_vmap
def _call(x):
    return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(x.shape[:-1], jnp.int32))(x)


@_call.def_vmap
def _call_vmap(axis_size, in_batched, x):
    """The rows of a batch are more rows of one call."""
    return _call(x), True


def available(folder: Path) -> str | None:
    """None when the kernel is registered with XLA (built into `folder` if needed, once per
    process), else the reason it is not (switched off, no compiler, a failed build)."""
    return cpu_ffi.available(SOURCE, {TARGET: "SpecjaxArgmaxRows"}, folder)


def rows_argmax(x: jax.Array, folder: Path) -> jax.Array:
    """`[..., V]` -> int32 `[...]`: `argmax` where the kernel can run here (`cpu_ffi.one_cpu_reason`
    at trace time, built into `folder`), else `argmax_reference`; the same indices either way."""
    if cpu_ffi.one_cpu_reason() is None and available(folder) is None:
        return argmax(x)
    return argmax_reference(x)
