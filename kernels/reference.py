"""jnp reference for verify attention: the XLA path and the oracle the Pallas kernel is tested against."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from einops import rearrange

NEG_INF = -1e30


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
    new_scores = dot("bhrd,bthd->bhrt", rows, k_new)  # [B, KVH, R, T]
    in_prefix = jnp.arange(k_cache.shape[3])[None, :] < lengths[:, None]  # [B, S]
    row_mask = jnp.tile(tree_mask, (1, q.shape[2] // num_kv_heads, 1))  # [B, R, T]
    prefix_scores = jnp.where(in_prefix[:, None, None, :], prefix_scores, NEG_INF)
    new_scores = jnp.where(row_mask[:, None, :, :], new_scores, NEG_INF)
    # One softmax over [prefix | new] without materialising a concatenated K/V.
    row_max = jnp.maximum(
        jnp.max(prefix_scores, axis=-1, keepdims=True), jnp.max(new_scores, axis=-1, keepdims=True)
    )
    prefix_w = jnp.where(prefix_scores > NEG_INF / 2, jnp.exp(prefix_scores - row_max), 0.0)
    new_w = jnp.where(new_scores > NEG_INF / 2, jnp.exp(new_scores - row_max), 0.0)
    denom = jnp.sum(prefix_w, axis=-1, keepdims=True) + jnp.sum(new_w, axis=-1, keepdims=True)
    out = dot("bhrs,bhsd->bhrd", prefix_w, v_cache) + dot("bhrt,bthd->bhrd", new_w, v_new)
    out = out / jnp.where(denom > 0, denom, 1.0)
    return rearrange(out, "b kh (g t) d -> b t (kh g) d", t=q.shape[1]).astype(q.dtype)
