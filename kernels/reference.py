"""jnp reference for verify attention: the XLA path and the oracle the Pallas kernel is tested against."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from einops import rearrange

NEG_INF = -1e30


def nonfinite_poison(x: jax.Array, axis: int = -1) -> jax.Array:
    """x reduced over `axis`, f32: 0 where every value is finite, NaN where one is NaN or ±Inf
    (x·0 is NaN exactly for those). Added to a key's scores, it makes that key's score NaN for
    every query, and the mask then decides which queries see it."""
    return jnp.sum(x.astype(jnp.float32) * 0.0, axis=axis)


def finite_or_zero(x: jax.Array) -> jax.Array:
    """x with NaN / ±Inf entries replaced by 0 (same dtype)."""
    return jnp.where(jnp.isfinite(x), x, jnp.zeros_like(x))


def verify_attention_reference(
    q: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    lengths: jax.Array,
    tree_mask: jax.Array,
    *,
    scale: float | None = None,
) -> jax.Array:
    """Attention of T new query tokens per row against the row's cached prefix and the new keys.

    Args:
      q: `[B, T, Hq, Dh]` queries of the T new tokens (RoPE applied).
      k_new, v_new: `[B, T, KVH, Dh]` keys/values of the same T tokens.
      k_cache: `[B, KVH, Dh, S]` (keys transposed), v_cache: `[B, KVH, S, Dh]` — one layer of
        `KVCache`; entries `[0, lengths[b])` of row b are its prefix, the rest is ignored.
      lengths: `[B]` int32 cached prefix length per row (0 allowed).
      tree_mask: `[B, T, T]` bool; tree_mask[b, i, j] = new token i may attend to new token j
        (its ancestors and itself; a chain is the causal mask).
      scale: softmax scale, default Dh ** -0.5.

    Returns:
      `[B, T, Hq, Dh]` in q's dtype. Softmax in f32. A query row with nothing to attend to
      (all masked) returns zeros.

    Non-finite inputs: a query that may see (mask) a NaN / Inf in its own q, a visible key or
    a visible new token's value gets NaN; a query that may not see them stays finite, since
    masked scores are replaced and masked weights are zeroed by the boolean masks, never by a
    score's value. A new token's K/V enter through `nonfinite_poison` (a bad token's score is
    NaN, then masked like any other) and its values are zeroed for the P·V product (0·NaN would
    leak to every query). Cached values are trusted to be finite (`models.cache.write` stores
    non-finite K/V as 0; the token they came from saw them itself, so its logits are NaN and
    its row is flagged): masking them here would double the decode attention's cost on CPU.
    """
    num_kv_heads = k_new.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    # The G query heads of a KV head times the T tokens form R = G*T rows (row r = g*T + t), so
    # both products are plain batched matmuls over (b, kv head) straight from the cache layout
    # (no transpose of the cache: see models/cache.py).
    rows = rearrange(q.astype(jnp.float32) * scale, "b t (kh g) d -> b kh (g t) d", kh=num_kv_heads)

    def dot(spec, x, y):  # inputs in the cache dtype, f32 accumulation
        return jnp.einsum(spec, x.astype(y.dtype), y, preferred_element_type=jnp.float32)

    prefix_scores = dot("bhrd,bhds->bhrs", rows, k_cache)  # [B, KVH, R, S]
    new_poison = nonfinite_poison(k_new) + nonfinite_poison(v_new)  # [B, T, KVH]
    new_scores = dot("bhrd,bthd->bhrt", rows, k_new) + rearrange(new_poison, "b t h -> b h 1 t")
    in_prefix = jnp.arange(k_cache.shape[3])[None, :] < lengths[:, None]  # [B, S]
    row_mask = jnp.tile(tree_mask, (1, q.shape[2] // num_kv_heads, 1))  # [B, R, T]
    prefix_scores = jnp.where(in_prefix[:, None, None, :], prefix_scores, NEG_INF)
    new_scores = jnp.where(row_mask[:, None, :, :], new_scores, NEG_INF)
    # One softmax over [prefix | new] without materialising a concatenated K/V.
    row_max = jnp.maximum(
        jnp.max(prefix_scores, axis=-1, keepdims=True), jnp.max(new_scores, axis=-1, keepdims=True)
    )
    # Weights zeroed by the boolean masks themselves, never by the score's value: a NaN score at a
    # visible key must stay NaN (a threshold test `score > NEG_INF / 2` is False for NaN and
    # would silently drop it, quieting a damaged head instead of flagging it).
    prefix_w = jnp.where(in_prefix[:, None, None, :], jnp.exp(prefix_scores - row_max), 0.0)
    new_w = jnp.where(row_mask[:, None, :, :], jnp.exp(new_scores - row_max), 0.0)
    denom = jnp.sum(prefix_w, axis=-1, keepdims=True) + jnp.sum(new_w, axis=-1, keepdims=True)
    out = dot("bhrs,bhsd->bhrd", prefix_w, v_cache) + dot(
        "bhrt,bthd->bhrd", new_w, finite_or_zero(v_new)
    )
    out = out / jnp.where(denom > 0, denom, 1.0)
    return rearrange(out, "b kh (g t) d -> b t (kh g) d", t=q.shape[1]).astype(q.dtype)
