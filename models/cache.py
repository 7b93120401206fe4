"""KV cache: a pytree with per-row lengths.

Layout: k, v `[L, B, S, KVH, Dh]`; lengths `[B]` int32 = number of committed entries per row.
A forward over T new tokens writes their keys/values at `[lengths[b], lengths[b] + T)` of row b
(provisional entries) and leaves `lengths` alone: the caller decides what to keep
(`advance` for plain decoding, a path compaction for speculative decoding).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from specjax.models.config import ModelConfig


@struct.dataclass
class KVCache:
    k: jax.Array  # [L, B, S, KVH, Dh]
    v: jax.Array  # [L, B, S, KVH, Dh]
    lengths: jax.Array  # [B] int32

    @property
    def capacity(self) -> int:
        """S: entries per row the buffer holds."""
        return self.k.shape[2]

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    def advance(self, num_new: jax.Array) -> KVCache:
        """Commits the first num_new `[B]` provisional entries of each row."""
        return self.replace(lengths=self.lengths + num_new.astype(jnp.int32))


def init_cache(cfg: ModelConfig, batch_size: int, capacity: int, dtype=None) -> KVCache:
    """An empty cache of `capacity` entries per row (all lengths 0)."""
    dtype = jnp.dtype(dtype or cfg.dtype)
    shape = (cfg.num_layers, batch_size, capacity, cfg.num_kv_heads, cfg.head_dim)
    return KVCache(
        k=jnp.zeros(shape, dtype),
        v=jnp.zeros(shape, dtype),
        lengths=jnp.zeros((batch_size,), jnp.int32),
    )


def write_rows(buffer: jax.Array, new: jax.Array, offsets: jax.Array) -> jax.Array:
    """Writes `new` `[L, B, T, ...]` into `buffer` `[L, B, S, ...]` at per-row offsets `[B]`.

    The caller guarantees offsets[b] + T <= S (dynamic_update_slice would clamp silently).
    """

    def write_one(buf_row, new_row, offset):  # [L, S, ...], [L, T, ...], []
        start = (0, offset) + (0,) * (buf_row.ndim - 2)
        return jax.lax.dynamic_update_slice(buf_row, new_row.astype(buf_row.dtype), start)

    return jax.vmap(write_one, in_axes=(1, 1, 0), out_axes=1)(buffer, new, offsets)


def write(cache: KVCache, new_k: jax.Array, new_v: jax.Array) -> KVCache:
    """Writes new keys/values `[L, B, T, KVH, Dh]` at each row's current length."""
    return cache.replace(
        k=write_rows(cache.k, new_k, cache.lengths),
        v=write_rows(cache.v, new_v, cache.lengths),
    )
