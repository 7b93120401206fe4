"""Llama-family decoder in Flax linen: GQA, rotate-half RoPE, RMSNorm, SwiGLU, tied or separate head.

The layers' params are stacked on a leading layer axis (created by one `nn.scan`) and run as
one `lax.scan` over the layer index (`scan_layers`), so compile time does not grow with depth
and the CPU matmul kernel reads a quantized layer in place from the stack. The forward is pure:

    out = forward(cfg, params, tokens [B, T], positions [B, T], cache, tree_mask [B, T, T])

writes the T new keys/values at each row's own offset `cache.lengths[b]` and returns logits,
requested hidden states and the cache (lengths unchanged: commit is the caller's choice).
`Llama(cfg)` is the same forward as an object with the members the decoding loop calls
(`specjax.target.TargetModel`).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import qwix
from flax import struct

from specjax.kernels import attention_cpu, cpu_ffi, qmatmul_cpu
from specjax.kernels.dispatch import resolve_impl, verify_attention
from specjax.models.cache import KVCache, init_cache, write
from specjax.models.config import ModelConfig, RopeScaling
from specjax.models.paths import cache_dir
from specjax.models.quant import (
    HEAD,
    BlockedKernel,
    LayerKernel,
    PackedKernel,
    blocked_matmul,
    float_head_product,
    grouped_product,
    is_held,
    layer_kernel,
    packed_matmul,
)

Params = Any


@struct.dataclass
class ForwardOutput:
    logits: jax.Array | None  # [B, K, V] f32 (K = T, or the number of logit_indices)
    hidden: jax.Array  # [B, T, H] final hidden state after the last norm
    layer_hidden: tuple[jax.Array, ...]  # each [B, T, H]: output of the requested layers
    cache: KVCache


# ---------------------------------------------------------------------------------------------
# RoPE
# ---------------------------------------------------------------------------------------------


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> jax.Array:
    """`[Dh/2]` inverse frequencies, with Llama-3 frequency-dependent scaling when given."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if scaling is None:
        return inv_freq
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = jnp.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    is_medium = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return jnp.where(is_medium, smoothed, scaled)


def rope_tables(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin `[B, T, Dh]` (f32) for integer positions `[B, T]` (rotate-half layout)."""
    inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, Dh/2]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE on x `[B, T, H, Dh]` with cos/sin `[B, T, Dh]`; math in f32."""
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    out = x32 * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return out.astype(x.dtype)


# ---------------------------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    eps: float
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):  # [..., D]
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.dtype)
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * scale.astype(jnp.float32)).astype(self.dtype)


class Linear(nn.Module):
    """`nn.Dense`'s math and param names (`kernel [in, out]`, `bias [out]`); the kernel may be
    a weight-only quantized `qwix.QArray` (`models.quant`), multiplied by `qwix.dot_general`,
    or a `quant.PackedKernel` / `quant.BlockedKernel` / `quant.LayerKernel` (a stack read in
    place at the layer's index), multiplied by the CPU kernels."""

    features: int
    use_bias: bool = False
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, live=None):  # [..., in] -> [..., out]; live [...] bool | None: `live_rows`
        kernel = self.get_variable("params", "kernel")
        if not isinstance(kernel, (PackedKernel, BlockedKernel, LayerKernel)):  # (flax's shape check reads a pytree's first leaf)
            kernel = self.param("kernel", nn.initializers.normal(0.02),
                                (x.shape[-1], self.features), self.dtype)
        x = jnp.asarray(x, self.dtype)
        dims = (((x.ndim - 1,), (0,)), ((), ()))
        if isinstance(kernel, PackedKernel):
            y = packed_matmul(x, kernel, live).astype(self.dtype)
        elif isinstance(kernel, BlockedKernel):
            y = blocked_matmul(x, kernel, live).astype(self.dtype)
        elif isinstance(kernel, LayerKernel):
            y = qmatmul_cpu.matmul(x, kernel.stack, kernel.layer, live).astype(self.dtype)
        elif isinstance(kernel, qwix.QArray):
            y = qwix.dot_general(x, kernel, dims).astype(self.dtype)
        else:
            y = jax.lax.dot_general(x, jnp.asarray(kernel, self.dtype), dims)
        if self.use_bias:
            bias = self.param("bias", nn.initializers.zeros_init(), (self.features,), self.dtype)
            y = y + jnp.asarray(bias, self.dtype)
        return y


def _dense(features: int, name: str, dtype, use_bias: bool = False) -> Linear:
    return Linear(features, use_bias=use_bias, dtype=dtype, name=name)


def _dense_group(module: nn.Module, x, outputs: list[tuple[str, int]], dtype,
                 use_bias: bool = False, live=None) -> list[jax.Array]:
    """The `Linear`s (name, features) of `module` that share the input x: one CPU kernel call
    for the group where their kernels allow it (`quant.grouped_product`: what each `Linear`
    computes, in one hand-off to the thread pool), else one `Linear` each."""
    if not module.is_initializing():
        params = module.variables.get("params", {})
        kernels = [params.get(name, {}).get("kernel") for name, _ in outputs]
        products = grouped_product(jnp.asarray(x, dtype), kernels, live)
        if products is not None:
            return [y.astype(dtype) + (jnp.asarray(params[name]["bias"], dtype) if use_bias else 0)
                    for (name, _), y in zip(outputs, products)]
    return [_dense(features, name, dtype, use_bias)(x, live) for name, features in outputs]


class Attention(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, k_cache, v_cache, cos, sin, lengths, tree_mask, layer=None, live=None):
        """x `[B, T, H]`; one layer of the cache: k_cache `[B, KVH, Dh, S]`, v_cache `[B, KVH, S, Dh]`,
        or with `layer` (int32 `[]`) the whole stack `[L, ...]` and the layer's index; live
        `[B, T]` bool | None (`live_rows`) -> (out `[B, T, H]`, k_new, v_new `[B, T, KVH, Dh]`)."""
        cfg = self.cfg
        dtype = cfg.jnp_dtype
        batch, seq = x.shape[:2]
        q, k, v = _dense_group(self, x, [("q_proj", cfg.num_heads * cfg.head_dim),
                                         ("k_proj", cfg.num_kv_heads * cfg.head_dim),
                                         ("v_proj", cfg.num_kv_heads * cfg.head_dim)],
                               dtype, cfg.attention_bias, live)
        q = q.reshape(batch, seq, cfg.num_heads, cfg.head_dim)
        k = k.reshape(batch, seq, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(batch, seq, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q = RMSNorm(cfg.rms_norm_eps, dtype, name="q_norm")(q)
            k = RMSNorm(cfg.rms_norm_eps, dtype, name="k_norm")(k)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        attn = verify_attention(
            q, k, v, k_cache, v_cache, lengths, tree_mask, impl=attention_impl(cfg), layer=layer
        )
        out = _dense(cfg.hidden_size, "o_proj", dtype)(attn.reshape(batch, seq, -1), live)
        return out, k, v


class MLP(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, live=None):
        cfg = self.cfg
        dtype = cfg.jnp_dtype
        gate, up = _dense_group(self, x, [("gate_proj", cfg.intermediate_size),
                                          ("up_proj", cfg.intermediate_size)], dtype, live=live)
        return _dense(cfg.hidden_size, "down_proj", dtype)(nn.silu(gate) * up, live)


class DecoderLayer(nn.Module):
    cfg: ModelConfig
    collect_hidden: bool = False

    @nn.compact
    def __call__(self, x, k_cache, v_cache, cos, sin, lengths, tree_mask, layer=None, live=None):
        cfg = self.cfg
        dtype = cfg.jnp_dtype
        attn_out, k_new, v_new = Attention(cfg, name="self_attn")(
            RMSNorm(cfg.rms_norm_eps, dtype, name="input_layernorm")(x),
            k_cache, v_cache, cos, sin, lengths, tree_mask, layer, live,
        )
        x = x + attn_out
        x = x + MLP(cfg, name="mlp")(RMSNorm(cfg.rms_norm_eps, dtype, name="post_attention_layernorm")(x),
                                     live)
        return x, (k_new, v_new, x if self.collect_hidden else None)


class LlamaModel(nn.Module):
    """Decoder stack + final norm + LM head. See `forward` for the calling convention."""

    cfg: ModelConfig
    collect_hidden: bool = False

    def setup(self):
        cfg = self.cfg
        dtype = cfg.jnp_dtype
        self.embed_tokens = nn.Embed(
            cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=dtype,
            embedding_init=nn.initializers.normal(0.02),
        )
        scanned = nn.scan(
            DecoderLayer,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=(0, 0, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast),
            length=cfg.num_layers,
        )
        self.layers = scanned(cfg, self.collect_hidden)
        self.norm = RMSNorm(cfg.rms_norm_eps, dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = _dense(cfg.vocab_size, "lm_head", dtype)
        self.quantized_head = _dense(cfg.vocab_size, HEAD, dtype)  # used when params hold one

    def __call__(self, tokens, positions, k_cache, v_cache, lengths, tree_mask, live=None):
        """Returns (final hidden `[B, T, H]`, k_new/v_new `[L, B, T, KVH, Dh]`, hiddens `[L, B, T, H]` | None);
        live `[B, T]` bool | None: `live_rows`."""
        x = self.embed_tokens(tokens)
        cos, sin = rope_tables(self.cfg, positions)
        inputs = (x, k_cache, v_cache, cos, sin, lengths, tree_mask)
        if self.is_initializing():  # nn.scan creates the stacked params
            x, (k_new, v_new, hiddens) = self.layers(*inputs)
        else:
            x, (k_new, v_new, hiddens) = scan_layers(
                self.cfg, self.collect_hidden, self.variables["params"]["layers"], *inputs, live=live)
        return self.norm(x), k_new, v_new, hiddens

    def logits(self, hidden, live=None):
        """`[..., H]` -> f32 logits `[..., V]`; live `[...]` bool | None: `live_rows`."""
        params = self.variables.get("params", {})
        if HEAD in params:  # an int8 head (`models.quant`)
            return self.quantized_head(hidden, live).astype(jnp.float32)
        tied = self.cfg.tie_word_embeddings
        weights = params.get("embed_tokens" if tied else "lm_head", {})
        out = float_head_product(hidden, weights.get("embedding" if tied else "kernel"), rows=tied,
                                 live=live)
        if out is not None:  # the CPU kernel
            return out
        out = self.embed_tokens.attend(hidden) if tied else self.lm_head(hidden)
        return out.astype(jnp.float32)

    def embed(self, tokens):
        """Token embeddings `[..., H]` in the model dtype."""
        return self.embed_tokens(tokens)


def attention_impl(cfg: ModelConfig) -> str:
    """The attention that runs for `cfg` (`kernels.dispatch.resolve_impl`, and the CPU kernel):
    'auto' is the CPU kernel (`kernels.attention_cpu`) on the CPU backend with one device and an
    f32 model when it is available, else what `resolve_impl` picks; 'cpu' asks for it (an error
    where it cannot run)."""
    impl = resolve_impl(cfg.attention_impl, cfg.head_dim)
    if impl == "cpu" or (impl == "xla" and cfg.attention_impl == "auto"):
        reason = cpu_attention_reason(cfg)
        if reason is None:
            return "cpu"
        if impl == "cpu":
            raise ValueError(f"attention_impl='cpu' cannot run here: {reason}")
        return "xla"
    return impl


def cpu_attention_reason(cfg: ModelConfig) -> str | None:
    """None when the CPU attention kernel can run `cfg`'s attention, else why not."""
    reason = cpu_ffi.one_cpu_reason()  # read at each trace, as `quant.pack_params` reads the switch
    if reason is not None:
        return reason
    if cfg.jnp_dtype != jnp.float32:
        return f"a {cfg.dtype} model (the kernel reads an f32 cache)"
    return attention_cpu.available(cache_dir() / "kernels")


def layer_params(layers: Params, index: jax.Array) -> Params:
    """Layer `index` (int32 `[]`) of the stacked layer params: each array's slice; each
    `PackedKernel` / `BlockedKernel` the whole stack with its `layer` set, and each float kernel
    as stored that the CPU kernel
    multiplies a `LayerKernel` of the whole stack (`quant.layer_kernel`): those kernels read
    the stack in place, where XLA would copy each layer's slice out before its dot."""

    def sliced(leaf):
        return jax.lax.dynamic_index_in_dim(leaf, index, keepdims=False)

    def one(leaf):
        if isinstance(leaf, (PackedKernel, BlockedKernel)):
            return dataclasses.replace(leaf, layer=index)
        if isinstance(leaf, qwix.QArray):  # its values and scales sliced alike
            return jax.tree.map(sliced, leaf)
        in_place = layer_kernel(leaf, index)
        return sliced(leaf) if in_place is None else in_place

    return jax.tree.map(one, layers, is_leaf=is_held)


def scan_layers(cfg: ModelConfig, collect_hidden: bool, layers: Params, x, k_cache, v_cache,
                cos, sin, lengths, tree_mask, live=None):
    """The decoder stack as one `lax.scan` over the layer index (what `nn.scan` computes, with
    each layer's params taken by `layer_params`): x `[B, T, H]`, k_cache / v_cache `[L, ...]`
    -> (x, (k_new, v_new `[L, B, T, KVH, Dh]`, hiddens `[L, B, T, H]` | None)).

    Where the CPU attention kernel runs (`attention_impl`), each layer gets the whole cache
    stack and its index, read in place; elsewhere its slice (what a scanned input would be).
    live `[B, T]` bool | None: `live_rows`."""
    layer = DecoderLayer(cfg, collect_hidden, parent=None)  # unbound: applied per layer
    in_place = attention_impl(cfg) == "cpu"

    def body(x, index):
        if in_place:
            caches = (k_cache, v_cache, cos, sin, lengths, tree_mask, index)
        else:
            caches = (*(jax.lax.dynamic_index_in_dim(c, index, keepdims=False) for c in (k_cache, v_cache)),
                      cos, sin, lengths, tree_mask)
        if not in_place:
            caches = (*caches, None)
        return layer.apply({"params": layer_params(layers, index)}, x, *caches, live)

    return jax.lax.scan(body, x, jnp.arange(cfg.num_layers, dtype=jnp.int32))


# ---------------------------------------------------------------------------------------------
# Pure functional API
# ---------------------------------------------------------------------------------------------


def live_rows(tree_mask: jax.Array) -> jax.Array:
    """`[B, T]` bool: which new tokens of a forward are live, from its mask `[B, T, T]`: a
    token that may not see itself is dead (`specjax.verify`: a draft node deeper than the
    step's draft). The CPU matmul kernels skip a dead token's rows (zeros out); no live token
    sees a dead one, so the live tokens' outputs are the same either way."""
    return jnp.diagonal(tree_mask, axis1=1, axis2=2)


def causal_mask(batch: int, seq: int) -> jax.Array:
    """`[B, T, T]` lower-triangular (chain) mask."""
    return jnp.broadcast_to(jnp.tril(jnp.ones((seq, seq), bool)), (batch, seq, seq))


def forward(
    cfg: ModelConfig,
    params: Params,
    tokens: jax.Array,
    positions: jax.Array,
    cache: KVCache,
    tree_mask: jax.Array | None = None,
    *,
    hidden_layers: tuple[int, ...] = (),
    logit_indices: jax.Array | None = None,
    compute_logits: bool = True,
) -> ForwardOutput:
    """One target forward over T new tokens per row.

    Args:
      cfg: static model config.
      params: the model's params pytree (`{"params": ...}`).
      tokens: `[B, T]` int32 new token ids.
      positions: `[B, T]` int32 RoPE positions (`lengths + depth` for a draft tree).
      cache: KV cache; row b attends to its entries `[0, cache.lengths[b])`.
      tree_mask: `[B, T, T]` bool ancestor mask among the new tokens (None = causal chain); a
        token it does not let see itself is dead (`live_rows`): its outputs are not used.
      hidden_layers: static indices of layers whose output hidden state `[B, T, H]` to return
        (0-based; -1 style negative indices allowed).
      logit_indices: optional `[B, K]` indices into T: logits only at those tokens.
      compute_logits: skip the LM head entirely when False.

    Returns:
      ForwardOutput with logits `[B, K, V]` f32 and the cache holding the T new entries at
      `[lengths[b], lengths[b] + T)` (lengths not advanced).
    """
    batch, seq = tokens.shape
    live = None if tree_mask is None else live_rows(tree_mask)
    if tree_mask is None:
        tree_mask = causal_mask(batch, seq)
    model = LlamaModel(cfg, collect_hidden=bool(hidden_layers))
    hidden, k_new, v_new, hiddens = model.apply(
        params, tokens, positions, cache.k, cache.v, cache.lengths, tree_mask, live
    )
    layer_hidden = tuple(hiddens[i] for i in hidden_layers) if hidden_layers else ()
    logits = None
    if compute_logits:
        selected = hidden
        if logit_indices is not None:
            selected = jnp.take_along_axis(hidden, logit_indices[..., None], axis=1)
            live = None if live is None else jnp.take_along_axis(live, logit_indices, axis=1)
        logits = model.apply(params, selected, live, method=LlamaModel.logits)
    return ForwardOutput(
        logits=logits, hidden=hidden, layer_hidden=layer_hidden, cache=write(cache, k_new, v_new)
    )


@dataclasses.dataclass(frozen=True)
class Llama:
    """The built-in target model: `forward` and `init_cache` for one static `cfg`, with the
    config fields the decoding loop reads (frozen and hashable: a jit static argument)."""

    cfg: ModelConfig

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.cfg.eos_token_ids

    @property
    def max_position_embeddings(self) -> int:
        return self.cfg.max_position_embeddings

    def init_cache(self, batch_size: int, capacity: int) -> KVCache:
        """An empty cache of `capacity` entries per row (lengths 0)."""
        return init_cache(self.cfg, batch_size, capacity)

    def forward(self, params: Params, tokens: jax.Array, positions: jax.Array, cache: KVCache,
                tree_mask: jax.Array | None = None, *, hidden_layers: tuple[int, ...] = (),
                logit_indices: jax.Array | None = None) -> ForwardOutput:
        """`forward(self.cfg, ...)`: tokens, positions `[B, T]`, tree_mask `[B, T, T]` | None."""
        return forward(self.cfg, params, tokens, positions, cache, tree_mask,
                       hidden_layers=hidden_layers, logit_indices=logit_indices)


@functools.partial(jax.jit, static_argnums=(0,))
def init_params(cfg: ModelConfig, key: jax.Array) -> Params:
    """Random params (normal 0.02) with the exact tree the loaders produce."""
    tokens = jnp.zeros((1, 1), jnp.int32)
    cache = init_cache(cfg, 1, 1)
    params = LlamaModel(cfg).init(
        key, tokens, tokens, cache.k, cache.v, cache.lengths, causal_mask(1, 1)
    )
    # Touch the head so an untied lm_head is created.
    head = LlamaModel(cfg).init(key, jnp.zeros((1, cfg.hidden_size), cfg.jnp_dtype), method=LlamaModel.logits)
    return {"params": {**head["params"], **params["params"]}}
