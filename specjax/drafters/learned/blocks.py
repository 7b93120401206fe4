"""Building blocks shared by the learned draft heads (EAGLE-3, MTP, Medusa, DFlash, DSpark).

A draft head is a small Flax module that runs beside a frozen Llama-family target. It reads
the target's hidden states (`ForwardOutput.layer_hidden`) and reuses the target's embedding
table, final norm and LM head through `TargetParts` (views of the target's params, never
trained, never saved with the head).

Layer dimensions of every head are a `ModelConfig` (`layer_config`), so the head layers reuse
the target's RoPE tables, RMSNorm, MLP and dense initialisers from `models/llama.py`.

`attention` is the one attention routine of all heads: queries against several key/value
*parts* (a KV cache, the block's own keys, draft-tree nodes, ...), each with its own boolean
mask, under ONE softmax in f32 (no concatenated K/V is materialised).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from einops import rearrange

from specjax.models.config import ModelConfig
from specjax.models.llama import MLP, LlamaModel, RMSNorm, _dense, apply_rope, rope_tables

NEG_INF = -1e30
Params = Any

#: a key/value part: keys `[B, S, KVH, Dh]`, values `[B, S, KVH, Dh]`, mask `[B | 1, T, S]` bool
KVPart = tuple[jax.Array, jax.Array, jax.Array]


def layer_config(target: ModelConfig, num_layers: int = 1, **overrides) -> ModelConfig:
    """Dimensions of a head's decoder layers: the target's, with `num_layers` layers."""
    return target.replace(num_layers=num_layers, name=f"{target.name}-head", **overrides)


# ---------------------------------------------------------------------------------------------
# Attention over several key/value parts
# ---------------------------------------------------------------------------------------------


def attention(q: jax.Array, parts: Sequence[KVPart], scale: float | None = None) -> jax.Array:
    """Softmax attention of q `[B, T, Hq, Dh]` over the union of `parts` (GQA).

    Each part is (k, v, mask) with k, v `[B, S_i, KVH, Dh]` and mask `[B | 1, T, S_i]` bool
    (True = visible). One softmax over all visible keys, in f32; a query that sees nothing
    returns zeros. Returns `[B, T, Hq, Dh]` in q's dtype.
    """
    num_kv_heads = parts[0][0].shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qg = rearrange(q, "b t (h g) d -> b h g t d", h=num_kv_heads).astype(jnp.float32) * scale
    scores = []
    for k, _, mask in parts:
        s = jnp.einsum("bhgtd,bshd->bhgts", qg, k.astype(jnp.float32))
        scores.append(jnp.where(mask[:, None, None], s, NEG_INF))
    row_max = jnp.max(jnp.stack([jnp.max(s, axis=-1) for s in scores]), axis=0)[..., None]
    weights = [
        jnp.where(mask[:, None, None], jnp.exp(s - row_max), 0.0)
        for s, (_, _, mask) in zip(scores, parts)
    ]
    denom = sum(jnp.sum(w, axis=-1, keepdims=True) for w in weights)
    out = sum(
        jnp.einsum("bhgts,bshd->bthgd", w, v.astype(jnp.float32))
        for w, (_, v, _) in zip(weights, parts)
    )
    denom = rearrange(denom, "b h g t 1 -> b t h g 1")
    out = out / jnp.where(denom > 0, denom, 1.0)
    return rearrange(out, "b t h g d -> b t (h g) d").astype(q.dtype)


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


# ---------------------------------------------------------------------------------------------
# Sequential heads (EAGLE-3, MTP): the training-time-test unroll
# ---------------------------------------------------------------------------------------------


def sequential_model(head_cfg) -> nn.Module:
    """The Flax module of a sequential head config (EAGLE-3 or MTP)."""
    if head_cfg.kind == "eagle3":
        from specjax.models.eagle3 import Eagle3Model

        return Eagle3Model(head_cfg)
    if head_cfg.kind == "mtp":
        from specjax.models.mtp import MTPModel

        return MTPModel(head_cfg)
    raise ValueError(f"not a sequential head: {head_cfg.kind!r}")


def shift_left(x: jax.Array, k: int, fill=0) -> jax.Array:
    """`x[:, t + k]` along axis 1 (`[B, T, ...]`), `fill` past the end."""
    if k == 0:
        return x
    pad = jnp.full((x.shape[0], k) + x.shape[2:], fill, x.dtype)
    return jnp.concatenate([x[:, k:], pad], axis=1)


def ttt_unroll(model: nn.Module, variables: Params, features: jax.Array, embed, tokens: jax.Array,
               steps: int) -> list[jax.Array]:
    """Training-time test of a sequential head over whole sequences: `steps` draft steps.

    features `[B, T, H]`: fused target features f_t; tokens `[B, T]`; embed: tokens -> `[B, T, H]`.
    Step k at index t stands for the draft entry at position t + k of a drafting round that
    started after position t: its token input is x_{t+1+k}, its feature the step-(k-1) output
    at index t (f_t for k = 0), and it attends to the step-0 entries at indices <= t (the
    committed, target-featured prefix) plus its own earlier steps at index t -- exactly the
    keys the drafter sees at inference. Step k's output predicts x_{t+k+2}.
    Returns the output hidden states `[B, T, H]` of each step.
    """
    seq = tokens.shape[1]
    positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), tokens.shape)
    keys: list[tuple[jax.Array, jax.Array]] = []
    outs = []
    feature = features
    for k in range(steps):
        emb = embed(shift_left(tokens, k + 1))
        q, kk, vv, residual = model.apply(variables, feature, emb, positions + k, method="cell_qkv")
        keys.append((kk, vv))
        parts = [(keys[0][0], keys[0][1], causal(seq))]
        parts += [(kj, vj, diagonal(seq)) for kj, vj in keys[1:]]
        feature = model.apply(variables, attention(q, parts), residual, method="cell_finish")
        outs.append(feature)
    return outs


# ---------------------------------------------------------------------------------------------
# Head configs: construction by kind, JSON round trip, random init
# ---------------------------------------------------------------------------------------------

KINDS = ("eagle3", "mtp", "medusa", "dflash", "dspark")


def _config_class(kind: str):
    if kind == "eagle3":
        from specjax.models.eagle3 import Eagle3Config

        return Eagle3Config
    if kind in ("mtp", "medusa"):
        from specjax.models import mtp

        return mtp.MTPConfig if kind == "mtp" else mtp.MedusaConfig
    if kind in ("dflash", "dspark"):
        from specjax.models import dflash, dspark

        return dflash.DFlashConfig if kind == "dflash" else dspark.DSparkConfig
    raise ValueError(f"unknown drafter kind {kind!r}; choose from {KINDS}")


def make_head_config(kind: str, target: ModelConfig, **options):
    """A head config of `kind` for `target` (options: the config class's `for_target` args)."""
    return _config_class(kind).for_target(target, **options)


def _model_config_from_dict(d: dict) -> ModelConfig:
    from specjax.models.config import RopeScaling

    d = dict(d)
    if d.get("rope_scaling") is not None:
        d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
    d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
    return ModelConfig(**d)


def head_config_to_dict(head_cfg) -> dict:
    """JSON-able description of a head config (the target itself is not stored)."""
    out = {}
    for f in dataclasses.fields(head_cfg):
        value = getattr(head_cfg, f.name)
        if f.name == "target":
            out["target_name"] = value.name
            continue
        out[f.name] = dataclasses.asdict(value) if isinstance(value, ModelConfig) else value
    return out


def head_config_from_dict(d: dict, target: ModelConfig):
    """Inverse of head_config_to_dict for the given target config."""
    cls = _config_class(d["kind"])
    kwargs = {"target": target}
    for f in dataclasses.fields(cls):
        if f.name == "target" or f.name not in d:
            continue
        value = d[f.name]
        if isinstance(value, dict) and "hidden_size" in value:
            value = _model_config_from_dict(value).replace(dtype=target.dtype,
                                                           attention_impl=target.attention_impl)
        elif isinstance(value, list):
            value = tuple(value)
        kwargs[f.name] = value
    return cls(**kwargs)


def init_from_target(head_cfg, variables, target_params):
    """Variables whose output side starts from the target's: the output norm of heads that
    feed the target's LM head (MTP, DFlash, DSpark), and EAGLE-3's norm + draft LM head (the
    target head's rows of the draft vocabulary). The norm keeps the target's per-dimension
    profile, rescaled so a random unit-RMS hidden state gives logits of std ~1 (an untrained
    head then predicts a near-uniform distribution instead of a confidently wrong one)."""
    target = head_cfg.target
    p = target_params["params"]
    params = dict(variables["params"])
    head_weight = p["embed_tokens"]["embedding"].T if target.tie_word_embeddings else p["lm_head"]["kernel"]
    if head_cfg.kind == "eagle3":
        head_weight = head_weight[:, variables["consts"]["draft_to_target"]]
        params["lm_head"] = {"kernel": jnp.asarray(head_weight, params["lm_head"]["kernel"].dtype)}
    scale = jnp.asarray(p["norm"]["scale"], jnp.float32)
    spread = jnp.sqrt(jnp.sum(scale**2 * jnp.mean(jnp.asarray(head_weight, jnp.float32) ** 2, axis=1)))
    norm = {"scale": (scale / jnp.maximum(spread, 1e-6)).astype(p["norm"]["scale"].dtype)}
    if head_cfg.kind in ("dflash", "dspark", "eagle3"):
        params["norm"] = norm
    elif head_cfg.kind == "mtp":
        params["shared_norm"] = norm
    return {**variables, "params": params}


def init_head(head_cfg, key: jax.Array, consts: dict | None = None):
    """Random variables `{"params", "consts"}` of any head config (consts: overrides)."""
    if head_cfg.kind == "eagle3":
        from specjax.models.eagle3 import init_eagle3

        return init_eagle3(head_cfg, key, **(consts or {}))
    if head_cfg.kind in ("mtp", "medusa"):
        from specjax.models.mtp import init_mtp_family

        return init_mtp_family(head_cfg, key)
    from specjax.models.dflash import init_block_head

    return init_block_head(head_cfg, key, consts)
