"""KV cache: a pytree with per-row lengths.

Layout (per layer l, row b, KV head h):
- k `[L, B, KVH, Dh, S]`: the keys stored *transposed*, so a head's cached keys are the columns
  of one `[Dh, S]` matrix and the scores q·Kᵀ are a plain matmul;
- v `[L, B, KVH, S, Dh]`: values token-major, so softmax(·)·V is a plain matmul too;
- lengths `[B]` int32 = number of committed entries per row.

Why this layout: on XLA CPU a batched dot wants its batch dims (b, h) leading and its
operands in matmul order; the token-major `[B, S, KVH, Dh]` layout made XLA transpose every
layer's whole cache slice on every step (measured on 2 CPU cores, SmolLM2 shapes, 30 layers of
decode attention: 63.8 -> 26.5 ms at B=8, S=1024). A GPU kernel reads `[Dh, block]` key tiles
just as well.

A forward over T new tokens writes their keys/values at `[lengths[b], lengths[b] + T)` of row b
(provisional entries) and leaves `lengths` alone: the caller decides what to keep (`advance`
for plain decoding, `compact` for a speculative path).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from einops import rearrange
from flax import struct

from specjax.kernels.reference import finite_or_zero
from specjax.models.config import ModelConfig

K_SEQ_AXIS = 4  # S axis of KVCache.k
V_SEQ_AXIS = 3  # S axis of KVCache.v


@struct.dataclass
class KVCache:
    k: jax.Array  # [L, B, KVH, Dh, S]
    v: jax.Array  # [L, B, KVH, S, Dh]
    lengths: jax.Array  # [B] int32

    @property
    def capacity(self) -> int:
        """S: entries per row the buffer holds."""
        return self.v.shape[V_SEQ_AXIS]

    def advance(self, num_new: jax.Array) -> KVCache:
        """Commits the first num_new `[B]` provisional entries of each row."""
        return self.replace(lengths=self.lengths + num_new.astype(jnp.int32))

    def token_major(self) -> tuple[jax.Array, jax.Array]:
        """Token-major copies k, v `[L, B, S, KVH, Dh]` (for small drafter heads' attention)."""
        return (
            rearrange(self.k, "l b h d s -> l b s h d"),
            rearrange(self.v, "l b h s d -> l b s h d"),
        )

    def layer_kv(self, layer: int) -> tuple[jax.Array, jax.Array]:
        """Token-major copies k, v `[B, S, KVH, Dh]` of one layer."""
        return (
            rearrange(self.k[layer], "b h d s -> b s h d"),
            rearrange(self.v[layer], "b h s d -> b s h d"),
        )


def empty_cache(
    num_layers: int, batch_size: int, capacity: int, num_kv_heads: int, head_dim: int, dtype
) -> KVCache:
    """An all-zero cache (lengths 0) of the given sizes.

    Inside a jitted program the zeros pass through an optimization barrier: XLA would otherwise
    see a constant cache and constant-fold the attention over its (masked) entries, element by
    element at compile time (measured: 7.6 s of a 28 s refill program's compile on SmolLM2, B=8).
    """
    dtype = jnp.dtype(dtype)
    return jax.lax.optimization_barrier(KVCache(
        k=jnp.zeros((num_layers, batch_size, num_kv_heads, head_dim, capacity), dtype),
        v=jnp.zeros((num_layers, batch_size, num_kv_heads, capacity, head_dim), dtype),
        lengths=jnp.zeros((batch_size,), jnp.int32),
    ))


def init_cache(cfg: ModelConfig, batch_size: int, capacity: int, dtype=None) -> KVCache:
    """An empty cache of `capacity` entries per row for model `cfg` (all lengths 0)."""
    return empty_cache(
        cfg.num_layers, batch_size, capacity, cfg.num_kv_heads, cfg.head_dim, dtype or cfg.dtype
    )


def write_rows(buffer: jax.Array, new: jax.Array, offsets: jax.Array, axis: int) -> jax.Array:
    """Writes `new` into `buffer` (both `[L, B, ...]`, same layout) at per-row offsets `[B]`
    along the sequence `axis`.

    The caller guarantees offsets[b] + T <= S (dynamic_update_slice would clamp silently).
    One dynamic_update_slice per row in a loop: XLA updates the (donated) buffer in place,
    where a vmapped update becomes a scatter that copies the whole buffer (measured on CPU:
    53 ms vs 0.03 ms for SmolLM2's cache at B=8, S=512).
    """
    new = new.astype(buffer.dtype)

    def write_one(row, buf):
        row_new = jax.lax.dynamic_slice_in_dim(new, row, 1, axis=1)
        start = [0] * buf.ndim
        start[1], start[axis] = row, offsets[row]
        return jax.lax.dynamic_update_slice(buf, row_new, start)

    return jax.lax.fori_loop(0, buffer.shape[1], write_one, buffer)


def write(cache: KVCache, new_k: jax.Array, new_v: jax.Array) -> KVCache:
    """Writes new keys/values `[L, B, T, KVH, Dh]` (token-major) at each row's current length.

    NaN / Inf entries are stored as 0, so a rejected draft's or a padding token's bad K/V left
    past `lengths` cannot reach a later query through a zero attention weight (0·NaN). This
    hides nothing: a token attends to its own K/V in the forward that computed them, so its
    logits are already non-finite and its row ends with stop reason "error" (`specjax.loop`).
    """
    new_k, new_v = finite_or_zero(new_k), finite_or_zero(new_v)
    return cache.replace(
        k=write_rows(cache.k, rearrange(new_k, "l b t h d -> l b h d t"), cache.lengths, K_SEQ_AXIS),
        v=write_rows(cache.v, rearrange(new_v, "l b t h d -> l b h t d"), cache.lengths, V_SEQ_AXIS),
    )


def gather_rows(
    buffer: jax.Array, starts: jax.Array, path: jax.Array, width: int, axis: int
) -> jax.Array:
    """Moves entries `starts[b] + path[b, j]` to `starts[b] + j` along `axis` of `buffer`.

    path `[B, P]` indices into the `width` entries read per row from `starts[b]`.
    """

    def kept_row(buf, start, row_path):  # buf without the B axis
        region = jax.lax.dynamic_slice_in_dim(buf, start, width, axis=axis - 1)
        return jnp.take(region, row_path, axis=axis - 1)

    kept = jax.vmap(kept_row, in_axes=(1, 0, 0), out_axes=1)(buffer, starts, path)
    return write_rows(buffer, kept, starts, axis)


def compact(cache: KVCache, starts: jax.Array, path: jax.Array, width: int) -> KVCache:
    """Keeps entries `starts + path[b, j]` at `starts + j` (lengths unchanged).

    Used to keep a verified tree's accepted path contiguous: path `[B, P]` indexes the
    `width` provisional entries written from `starts` `[B]`.
    """
    return cache.replace(
        k=gather_rows(cache.k, starts, path, width, K_SEQ_AXIS),
        v=gather_rows(cache.v, starts, path, width, V_SEQ_AXIS),
    )
