"""Flax building blocks shared by the learned draft heads (EAGLE-3, MTP, Medusa, DFlash, DSpark).

A draft head is a small Flax module that runs beside a frozen Llama-family target. It reads
the target's hidden states (`ForwardOutput.layer_hidden`) and reuses the target's embedding
table, final norm and LM head through `TargetView` (views of the target's params, never
trained, never saved with the head).

Layer dimensions of every head are a `ModelConfig` (`layer_config`), so the head layers reuse
the target's RoPE tables, RMSNorm, MLP and dense initialisers from `models/llama.py`.

`attention` (over `kernels.reference.attention_over_parts`, the one reference attention) is the
attention of all heads: queries against several key/value
*parts* (a KV cache, the block's own keys, draft-tree nodes, ...), each with its own boolean
mask, under ONE softmax in f32 (no concatenated K/V is materialised).

Also here: the output-side init from the target (`calibrated_norm`, `output_norm_from_target`)
and the Hugging Face names of a `HeadLayer`'s tensors (`hf_layer_names`, `layer_from_hf`,
`layer_to_hf`), which the kinds' upstream layouts are built from.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from specjax.kernels.reference import KVPart, attention_over_parts
from specjax.models.config import ModelConfig
from specjax.models.llama import MLP, LlamaModel, RMSNorm, _dense, apply_rope, rope_tables

Params = Any


def layer_config(target: ModelConfig, num_layers: int = 1, **overrides) -> ModelConfig:
    """Dimensions of a head's decoder layers: the target's, with `num_layers` layers."""
    return target.replace(num_layers=num_layers, name=f"{target.name}-head", **overrides)


# ---------------------------------------------------------------------------------------------
# Attention over several key/value parts
# ---------------------------------------------------------------------------------------------


def attention(q: jax.Array, parts: Sequence[tuple[jax.Array, jax.Array, jax.Array]],
              scale: float | None = None) -> jax.Array:
    """Softmax attention of q `[B, T, Hq, Dh]` over the union of (k, v, mask) parts: k, v
    `[B, S_i, KVH, Dh]`, mask `[B | 1, T, S_i]` bool. The one reference attention
    (`kernels.reference.attention_over_parts`); returns `[B, T, Hq, Dh]` in q's dtype."""
    return attention_over_parts(q, [KVPart(*part) for part in parts], scale=scale)


def prefix_mask(lengths: jax.Array, capacity: int) -> jax.Array:
    """`[B, 1, S]` (broadcast over queries): cache entry j is visible when j < lengths[b]."""
    return (jnp.arange(capacity)[None, :] < lengths[:, None])[:, None, :]


def causal(num: int) -> jax.Array:
    """`[1, T, T]` lower-triangular mask."""
    return jnp.tril(jnp.ones((num, num), bool))[None]


def diagonal(num: int) -> jax.Array:
    """`[1, T, T]` identity mask (query t sees key t only)."""
    return jnp.eye(num, dtype=bool)[None]


# ---------------------------------------------------------------------------------------------
# One decoder layer with pluggable attention inputs
# ---------------------------------------------------------------------------------------------


class HeadLayer(nn.Module):
    """A Llama decoder layer split at the attention so callers choose what it attends to.

    `qkv(a, positions)`: projections of the (already normalised) attention input a `[B, T, Din]`
    (Din may differ from the hidden size: EAGLE-3 feeds 2H), RoPE applied, optional q/k norm;
    `finish(attn, residual)`: o_proj + residual, then post-attention norm + SwiGLU MLP + residual.
    """

    cfg: ModelConfig

    def setup(self):
        c = self.cfg
        dtype = c.jnp_dtype
        self.q_proj = _dense(c.num_heads * c.head_dim, "q_proj", dtype, c.attention_bias)
        self.k_proj = _dense(c.num_kv_heads * c.head_dim, "k_proj", dtype, c.attention_bias)
        self.v_proj = _dense(c.num_kv_heads * c.head_dim, "v_proj", dtype, c.attention_bias)
        self.o_proj = _dense(c.hidden_size, "o_proj", dtype)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(c.rms_norm_eps, dtype)
        self.mlp = MLP(c)
        self.post_attention_layernorm = RMSNorm(c.rms_norm_eps, dtype)

    def kv(self, a: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """a `[B, T, Din]`, positions `[B, T]` -> k, v `[B, T, KVH, Dh]` (RoPE on k)."""
        c = self.cfg
        batch, seq = a.shape[:2]
        k = self.k_proj(a).reshape(batch, seq, c.num_kv_heads, c.head_dim)
        v = self.v_proj(a).reshape(batch, seq, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            k = self.k_norm(k)
        cos, sin = rope_tables(c, positions)
        return apply_rope(k, cos, sin), v

    def query(self, a: jax.Array, positions: jax.Array) -> jax.Array:
        """a `[B, T, Din]` -> q `[B, T, Hq, Dh]` (RoPE applied)."""
        c = self.cfg
        batch, seq = a.shape[:2]
        q = self.q_proj(a).reshape(batch, seq, c.num_heads, c.head_dim)
        if c.qk_norm:
            q = self.q_norm(q)
        cos, sin = rope_tables(c, positions)
        return apply_rope(q, cos, sin)

    def qkv(self, a: jax.Array, positions: jax.Array):
        k, v = self.kv(a, positions)
        return self.query(a, positions), k, v

    def finish(self, attn: jax.Array, residual: jax.Array) -> jax.Array:
        """attn `[B, T, Hq, Dh]`, residual `[B, T, H]` -> layer output `[B, T, H]`."""
        x = residual + self.o_proj(attn.reshape(attn.shape[:2] + (-1,)))
        return x + self.mlp(self.post_attention_layernorm(x))

    def __call__(self, a, residual, positions):
        """Self-attention over the T inputs (causal); used to create the params."""
        q, k, v = self.qkv(a, positions)
        return self.finish(attention(q, [(k, v, causal(a.shape[1]))]), residual)


# ---------------------------------------------------------------------------------------------
# The target's frozen parts a head reuses
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TargetView:
    """Static handle on the target pieces a head may reuse (embedding, final norm, LM head)."""

    cfg: ModelConfig

    def parts(self, target_params: Params) -> Params:
        """The subset of the target's params the heads read (`{"params": {...}}`)."""
        p = target_params["params"]
        return {"params": {k: p[k] for k in ("embed_tokens", "lm_head", "norm") if k in p}}

    # The target module is built unbound (parent=None), so these also work inside a head's
    # own Flax methods.

    def embed(self, parts: Params, tokens: jax.Array) -> jax.Array:
        """tokens `[...]` -> `[..., H]` target embeddings."""
        return LlamaModel(self.cfg, parent=None).apply(parts, tokens, method=LlamaModel.embed)

    def logits(self, parts: Params, hidden: jax.Array) -> jax.Array:
        """Target LM head on normalised hidden `[..., H]` -> f32 `[..., V]`."""
        return LlamaModel(self.cfg, parent=None).apply(parts, hidden, method=LlamaModel.logits)

    def logits_subset(self, parts: Params, hidden: jax.Array, ids: jax.Array) -> jax.Array:
        """The LM head restricted to target ids `[K]`: f32 `[..., K]` (= logits(...)[..., ids]
        without computing the other V - K columns)."""
        p = parts["params"]
        if self.cfg.tie_word_embeddings:
            weight = p["embed_tokens"]["embedding"][ids].T  # [H, K]
        else:
            weight = p["lm_head"]["kernel"][:, ids]
        return jnp.einsum("...h,hk->...k", hidden.astype(jnp.float32), weight.astype(jnp.float32))


def evenly_spaced_layers(num_target_layers: int, count: int) -> tuple[int, ...]:
    """`count` target layer indices spread evenly from layer 1 to layer L-3 (upstream DFlash's
    range; the whole [0, L-1] for targets too shallow for it); one layer = the middle one."""
    if count == 1:
        return (num_target_layers // 2,)
    start, end = (1, num_target_layers - 3) if num_target_layers > 4 else (0, num_target_layers - 1)
    return tuple(round(start + i * (end - start) / (count - 1)) for i in range(count))


def shift_left(x: jax.Array, k: int, fill=0) -> jax.Array:
    """`x[:, t + k]` along axis 1 (`[B, T, ...]`), `fill` past the end."""
    if k == 0:
        return x
    pad = jnp.full((x.shape[0], k) + x.shape[2:], fill, x.dtype)
    return jnp.concatenate([x[:, k:], pad], axis=1)


# ---------------------------------------------------------------------------------------------
# Output side from the target: heads that end in a norm start from the target's
# ---------------------------------------------------------------------------------------------


def target_lm_head(target: ModelConfig, target_params: Params) -> jax.Array:
    """The target's LM head as a kernel `[H, V]` (the embedding's transpose when tied)."""
    p = target_params["params"]
    return p["embed_tokens"]["embedding"].T if target.tie_word_embeddings else p["lm_head"]["kernel"]


def calibrated_norm(target_params: Params, head_weight: jax.Array) -> dict:
    """`{"scale": [H]}`: the target's final-norm profile, rescaled so a random unit-RMS hidden
    state gives logits of std ~1 through head_weight `[H, V']` (an untrained head then
    predicts a near-uniform distribution instead of a confidently wrong one)."""
    target_scale = target_params["params"]["norm"]["scale"]
    scale = jnp.asarray(target_scale, jnp.float32)
    spread = jnp.sqrt(jnp.sum(scale**2 * jnp.mean(jnp.asarray(head_weight, jnp.float32) ** 2, axis=1)))
    return {"scale": (scale / jnp.maximum(spread, 1e-6)).astype(target_scale.dtype)}


def output_norm_from_target(norm_name: str, head_cfg, variables: dict, target_params: Params) -> dict:
    """Variables with the norm `norm_name` in front of the target's LM head calibrated from the
    target (`calibrated_norm`); use as `functools.partial(output_norm_from_target, "norm")`."""
    norm = calibrated_norm(target_params, target_lm_head(head_cfg.target, target_params))
    return {**variables, "params": {**variables["params"], norm_name: norm}}


# ---------------------------------------------------------------------------------------------
# Hugging Face names of a HeadLayer (upstream layouts: `hf.py` and the kinds' `UpstreamLayout`)
# ---------------------------------------------------------------------------------------------

_MLP = ("gate_proj", "up_proj", "down_proj")
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


def hf_layer_names(prefix: str, path: tuple[str, ...], cfg: ModelConfig):
    """[(HF name, param path, transpose)] of a HeadLayer at `path` (attention, q/k norm, MLP,
    post-attention norm); prefix e.g. "midlayer." or "layers.0."."""
    out = [(f"{prefix}self_attn.{p}.weight", path + (p, "kernel"), True) for p in _ATTN]
    if cfg.attention_bias:
        out += [(f"{prefix}self_attn.{p}.bias", path + (p, "bias"), False) for p in _ATTN[:3]]
    if cfg.qk_norm:
        out += [(f"{prefix}self_attn.{n}.weight", path + (n, "scale"), False) for n in ("q_norm", "k_norm")]
    out += [(f"{prefix}mlp.{p}.weight", path + ("mlp", p, "kernel"), True) for p in _MLP]
    out.append((f"{prefix}post_attention_layernorm.weight", path + ("post_attention_layernorm", "scale"), False))
    return out


def layer_from_hf(config: dict, target: ModelConfig, num_layers: int, **overrides) -> ModelConfig:
    """A head's layer dims from an upstream config.json (missing fields: the target's); a
    hidden size other than the target's -> ValueError (trained for another target)."""
    hidden = int(config.get("hidden_size", target.hidden_size))
    if hidden != target.hidden_size:
        raise ValueError(f"the draft head's hidden_size {hidden} differs from the target's "
                         f"{target.hidden_size}: it was trained for another target")
    heads = int(config.get("num_attention_heads", target.num_heads))
    return layer_config(
        target, num_layers,
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads", heads)),
        head_dim=int(config.get("head_dim") or hidden // heads),
        intermediate_size=int(config.get("intermediate_size", target.intermediate_size)),
        rms_norm_eps=float(config.get("rms_norm_eps", target.rms_norm_eps)),
        rope_theta=float(config.get("rope_theta", target.rope_theta)),
        attention_bias=bool(config.get("attention_bias", False)),
        **overrides,
    )


def layer_to_hf(layer: ModelConfig, target: ModelConfig) -> dict:
    """The config.json fields of a head's layer dims (what `layer_from_hf` reads, plus the
    Llama fields transformers' LlamaConfig and upstream loaders expect)."""
    scaling = layer.rope_scaling and {**dataclasses.asdict(layer.rope_scaling), "rope_type": "llama3"}
    return {
        "model_type": "llama", "hidden_act": "silu", "torch_dtype": "float32",
        "hidden_size": layer.hidden_size, "intermediate_size": layer.intermediate_size,
        "num_attention_heads": layer.num_heads, "num_key_value_heads": layer.num_kv_heads,
        "head_dim": layer.head_dim, "num_hidden_layers": layer.num_layers,
        "rms_norm_eps": layer.rms_norm_eps, "rope_theta": layer.rope_theta,
        "rope_scaling": scaling or None, "attention_bias": layer.attention_bias,
        "max_position_embeddings": layer.max_position_embeddings,
        "vocab_size": target.vocab_size, "tie_word_embeddings": False,
        "bos_token_id": target.bos_token_id, "eos_token_id": list(target.eos_token_ids) or None,
        "pad_token_id": target.pad_token_id,
    }
