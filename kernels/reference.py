"""jnp reference attention: the XLA path of verify attention, the oracle the Pallas kernel is
tested against, and the attention of the learned draft heads (`attention_over_parts`)."""
from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from einops import rearrange

#: the score of a masked key: finite, so a fully masked row keeps (m - m) and exp() NaN-free
#: (its weight is then zeroed by the boolean mask itself); the one definition, used by the
#: Pallas kernel and the learned heads' attention
MASKED_SCORE = -1e30


def nonfinite_poison(x: jax.Array, axis: int = -1) -> jax.Array:
    """x reduced over `axis`, f32: 0 where every value is finite, NaN where one is NaN or ±Inf
    (x·0 is NaN exactly for those). Added to a key's scores, it makes that key's score NaN for
    every query, and the mask then decides which queries see it."""
    return jnp.sum(x.astype(jnp.float32) * 0.0, axis=axis)


def finite_or_zero(x: jax.Array) -> jax.Array:
    """x with NaN / ±Inf entries replaced by 0 (same dtype)."""
    return jnp.where(jnp.isfinite(x), x, jnp.zeros_like(x))


class KVPart(NamedTuple):
    """One source of keys for `attention_over_parts`.

    k, v: `[B, S, KVH, Dh]` each; or with `cached=True` one layer of `KVCache` as it is stored,
      keys `[B, KVH, Dh, S]` (transposed) and values `[B, KVH, S, Dh]`, read without a transpose.
    mask: `[B | 1, T | 1, S]` bool, True = query t may see key s.
    cached: cache layout, and values trusted to be finite (`models.cache.write` stores
      non-finite K/V as 0: checking them here would double the decode attention's cost on CPU).
    """

    k: jax.Array
    v: jax.Array
    mask: jax.Array
    cached: bool = False


def attention_over_parts(q: jax.Array, parts: Sequence[KVPart], *, scale: float | None = None) -> jax.Array:
    """Softmax attention of q `[B, T, Hq, Dh]` over the union of `parts` (GQA), in f32, under
    ONE softmax without materialising a concatenated K/V. A query that sees nothing returns
    zeros. Returns `[B, T, Hq, Dh]` in q's dtype.

    Non-finite inputs: a query that may see (mask) a NaN / Inf in its own q, a visible key or
    a visible value gets NaN; a query that may not see them stays finite, since masked scores
    are replaced and masked weights are zeroed by the boolean masks, never by a score's value
    (a threshold test `score > MASKED_SCORE / 2` is False for NaN and would silently drop it,
    quieting a damaged head instead of flagging it). An uncached part's K/V enter through
    `nonfinite_poison` (a bad key's score is NaN, then masked like any other) and its values
    are zeroed for the P·V product (0·NaN would leak to every query).
    """
    num_kv_heads = parts[0].v.shape[1 if parts[0].cached else 2]
    group = q.shape[2] // num_kv_heads
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    # The G query heads of a KV head times the T tokens form R = G*T rows (row r = g*T + t), so
    # every product is a plain batched matmul over (b, kv head), straight from the cache layout.
    rows = rearrange(q.astype(jnp.float32) * scale, "b t (kh g) d -> b kh (g t) d", kh=num_kv_heads)

    def dot(spec, x, y):  # inputs in y's dtype (the cache's), f32 accumulation
        return jnp.einsum(spec, x.astype(y.dtype), y, preferred_element_type=jnp.float32)

    def row_mask(mask):  # [B | 1, T | 1, S] -> [B | 1, 1, R | 1, S]
        return (mask if mask.shape[1] == 1 else jnp.tile(mask, (1, group, 1)))[:, None]

    scores = []
    for part in parts:
        if part.cached:
            s = dot("bhrd,bhds->bhrs", rows, part.k)
        else:
            poison = nonfinite_poison(part.k) + nonfinite_poison(part.v)  # [B, S, KVH]
            s = dot("bhrd,bshd->bhrs", rows, part.k) + rearrange(poison, "b s h -> b h 1 s")
        scores.append(jnp.where(row_mask(part.mask), s, MASKED_SCORE))
    row_max = functools.reduce(jnp.maximum, [jnp.max(s, axis=-1, keepdims=True) for s in scores])
    weights = [jnp.where(row_mask(p.mask), jnp.exp(s - row_max), 0.0) for s, p in zip(scores, parts)]
    denom = sum(jnp.sum(w, axis=-1, keepdims=True) for w in weights)
    out = sum(
        dot("bhrs,bhsd->bhrd", w, p.v) if p.cached else dot("bhrs,bshd->bhrd", w, finite_or_zero(p.v))
        for w, p in zip(weights, parts)
    )
    out = out / jnp.where(denom > 0, denom, 1.0)
    return rearrange(out, "b kh (g t) d -> b t (kh g) d", t=q.shape[1]).astype(q.dtype)


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
    in_prefix = jnp.arange(k_cache.shape[3])[None, None, :] < lengths[:, None, None]  # [B, 1, S]
    return attention_over_parts(
        q, [KVPart(k_cache, v_cache, in_prefix, cached=True), KVPart(k_new, v_new, tree_mask)],
        scale=scale,
    )
