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
      k_cache, v_cache: `[B, S, KVH, Dh]`; entries `[0, lengths[b])` of row b are its prefix,
        the rest is ignored.
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
    qg = rearrange(q, "b t (kh g) d -> b kh g t d", kh=num_kv_heads).astype(jnp.float32) * scale
    prefix_scores = jnp.einsum("bhgtd,bshd->bhgts", qg, k_cache.astype(jnp.float32))
    new_scores = jnp.einsum("bhgtd,bshd->bhgts", qg, k_new.astype(jnp.float32))
    in_prefix = jnp.arange(k_cache.shape[1])[None, :] < lengths[:, None]  # [B, S]
    prefix_scores = jnp.where(in_prefix[:, None, None, None, :], prefix_scores, NEG_INF)
    new_scores = jnp.where(tree_mask[:, None, None, :, :], new_scores, NEG_INF)
    # One softmax over [prefix | new] without materialising a concatenated K/V.
    row_max = jnp.maximum(
        jnp.max(prefix_scores, axis=-1, keepdims=True), jnp.max(new_scores, axis=-1, keepdims=True)
    )
    prefix_w = jnp.where(prefix_scores > NEG_INF / 2, jnp.exp(prefix_scores - row_max), 0.0)
    new_w = jnp.where(new_scores > NEG_INF / 2, jnp.exp(new_scores - row_max), 0.0)
    denom = jnp.sum(prefix_w, axis=-1, keepdims=True) + jnp.sum(new_w, axis=-1, keepdims=True)
    out = jnp.einsum("bhgts,bshd->bthgd", prefix_w, v_cache.astype(jnp.float32))
    out = out + jnp.einsum("bhgts,bshd->bthgd", new_w, v_new.astype(jnp.float32))
    denom = rearrange(denom, "b h g t 1 -> b t h g 1")
    out = out / jnp.where(denom > 0, denom, 1.0)
    return rearrange(out, "b t h g d -> b t (h g) d").astype(q.dtype)
