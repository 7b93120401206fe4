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
    One dynamic_update_slice per row in a loop: XLA updates the (donated) buffer in place,
    where a vmapped update becomes a scatter that copies the whole buffer (measured on CPU:
    53 ms vs 0.03 ms for SmolLM2's cache at B=8, S=512).
    """
    new = new.astype(buffer.dtype)

    def write_one(row, buf):
        row_new = jax.lax.dynamic_slice_in_dim(new, row, 1, axis=1)  # [L, 1, T, ...]
        start = (0, row, offsets[row]) + (0,) * (buf.ndim - 3)
        return jax.lax.dynamic_update_slice(buf, row_new, start)

    return jax.lax.fori_loop(0, buffer.shape[1], write_one, buffer)


def write(cache: KVCache, new_k: jax.Array, new_v: jax.Array) -> KVCache:
    """Writes new keys/values `[L, B, T, KVH, Dh]` at each row's current length."""
    return cache.replace(
        k=write_rows(cache.k, new_k, cache.lengths),
        v=write_rows(cache.v, new_v, cache.lengths),
    )
