"""Layout helpers shared by the verify-attention kernels (Triton GPU and Mosaic TPU).

All of them run on the XLA side, on arrays that are small next to the cache: the query tile
of one (row, KV head) packs its G query heads × T new tokens into rows r = t·G + g, and the
tree mask is expanded to the same rows. No Pallas backend is imported here.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def prev_pow2(n: int) -> int:
    return 1 << max(0, int(n).bit_length() - 1)


def round_up(n: int, multiple: int) -> int:
    return -(-int(n) // multiple) * multiple


def pad_axis(x: jax.Array, axis: int, size: int) -> jax.Array:
    """Zero-pads `axis` of x up to `size`."""
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad)


def pack_queries(q: jax.Array, kv_heads: int, rows: int) -> jax.Array:
    """q `[B, T, KVH·G, Dh]` -> tiles `[B, KVH, Rp, Dh]`, row r = t·G + g, zero rows past G·T."""
    batch, seq, heads, dim = q.shape
    group = heads // kv_heads
    tiles = q.reshape(batch, seq, kv_heads, group, dim).transpose(0, 2, 1, 3, 4)
    return pad_axis(tiles.reshape(batch, kv_heads, seq * group, dim), 2, rows)


def unpack_rows(tiles: jax.Array, seq: int, group: int) -> jax.Array:
    """tiles `[B, KVH, Rp, Dh]` -> `[B, T, KVH·G, Dh]` (inverse of `pack_queries`)."""
    batch, kv_heads, _, dim = tiles.shape
    rows = tiles[:, :, : seq * group].reshape(batch, kv_heads, seq, group, dim)
    return rows.transpose(0, 2, 1, 3, 4).reshape(batch, seq, kv_heads * group, dim)


def expand_tree_mask(
    tree_mask: jax.Array, group: int, rows: int, new_block: int, dtype=jnp.int8
) -> jax.Array:
    """tree_mask `[B, T, T]` -> `[B, Rp, Tp]` of 0 / 1 in `dtype`: row r = t·G + g gets token
    t's mask row. Padded rows and padded key columns are 0 (masked)."""
    expanded = jnp.repeat(tree_mask.astype(dtype), group, axis=1)  # [B, T·G, T]
    return pad_axis(pad_axis(expanded, 1, rows), 2, new_block)


def mxu_dot(a: jax.Array, b: jax.Array, contract_b: int) -> jax.Array:
    """a `[M, K]` · b (`[N, K]` if contract_b == 1 else `[K, N]`) -> `[M, N]`, f32 accumulate.

    f32 inputs use HIGHEST precision (IEEE, never TF32 / a bf16 pass).
    """
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(
        a, b, (((1,), (contract_b,)), ((), ())),
        precision=precision, preferred_element_type=jnp.float32,
    )
