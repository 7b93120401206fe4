"""Pallas (Triton backend) verify attention: one tile holds all G·T query rows of a KV head.

Interface: exactly `verify_attention_reference` (kernels/reference.py):

    verify_attention(q [B, T, Hq, Dh], k_new [B, T, KVH, Dh], v_new, k_cache [B, KVH, Dh, S],
                     v_cache [B, KVH, S, Dh], lengths [B], tree_mask [B, T, T]) -> [B, T, Hq, Dh]

Tile layout. For row b and KV head h the G = Hq/KVH query heads sharing h, times the T new
tokens, are packed into rows r = t·G + g of one query tile (`pack_queries`), padded to a power
of two ≥ 16 (the Triton dot's minimum). Each program streams K/V blocks of `block_k` keys of
row b, head h ONCE for the whole tile (a key block is a `[Dh, block_k]` column block of the
transposed key cache, a value block `[block_k, Dh]` rows of the value cache), so verifying
T−1 extra tokens costs little until the tile is full. Tiles taller than `block_q` rows are
split over a grid axis (each re-reads K/V).

Grid: (B, KVH, k_splits, row blocks). Split s covers an equal share of the row's OWN cached
length (computed in the kernel from lengths[b], so short rows do not leave splits idle by
design); full blocks load unmasked (vectorised), the ragged tail block loads masked. Blocks
past the length are never touched; a row with 0 cached tokens does no prefix work.

New tokens: handled INSIDE the kernel, by the last split, after its prefix blocks, as one
more block of Tp keys (T padded to a power of two ≥ 16) under the row-expanded tree mask.
Why there and not as a separate tile merged in the combine: (1) with k_splits = 1 (large
batch, where the grid is already full) the kernel then finishes the whole softmax itself and
writes the final output, so there is no combine pass and no partial-result traffic at all;
(2) it reuses the same online-softmax block update (one code path); (3) T ≤ 64 keys next to
thousands of cached keys add negligible work to that one program, and no extra launch.

Numerics: scores, running max/sum and accumulator in f32; dots accumulate in f32 (IEEE for
f32 inputs, never TF32); P is cast to V's dtype for the P·V dot. Every program normalises its
own tile and stores it in the output dtype plus its running max m and sum l (f32). With
k_splits > 1 `combine_splits` merges the splits by log-sum-exp weights (w_s = l_s·e^{m_s−M}).
A query row with nothing to attend to returns zeros (as the reference does).

Non-finite inputs (as the reference): masked scores and weights are replaced by the boolean
mask, never by a score's value, so a NaN a query may see stays NaN and one it may not see
never reaches it. Cached keys/values past a row's length are never loaded (masked loads); new
tokens enter with `nonfinite_poison` on their scores and zeroed non-finite values.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from specjax.kernels.reference import MASKED_SCORE, finite_or_zero, nonfinite_poison
from specjax.kernels.tiling import (
    expand_tree_mask,
    mxu_dot,
    next_pow2,
    pack_queries,
    pad_axis,
    prev_pow2,
    unpack_rows,
)

MIN_DOT = 16  # Triton's dot needs every dimension ≥ 16
SM_TARGET_PROGRAMS = 528  # ~4 programs per SM of an H200 (132 SMs): the split heuristic's aim


# ---------------------------------------------------------------------------------------------
# Static tiling
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Static block sizes of one call (hashable: a jit static argument)."""

    block_q: int  # query rows per tile (power of two ≥ 16)
    row_blocks: int  # tiles per (row, KV head): ceil(G·T / block_q)
    block_k: int  # cached keys per K/V block (power of two ≥ 16)
    new_block: int  # Tp: new keys per row, padded (power of two ≥ 16)
    k_splits: int  # splits of the cached length; the last one also does the new tokens
    num_warps: int
    num_stages: int

    @property
    def rows(self) -> int:
        """Rp: padded query rows per (row, KV head)."""
        return self.block_q * self.row_blocks


def default_k_splits(num_programs: int, capacity: int, rows: int, block_k: int) -> int:
    """Splits of the KV length: enough programs to fill the GPU, within two caps.

    The split partials (normalised tile in the output dtype + m, l) are written and read back
    by the combine; keep them under ~10 % of the K/V stream (S·2 keys+values vs ~2·rows per
    split), and keep ≥ 4 K/V blocks per split.
    """
    want = -(-SM_TARGET_PROGRAMS // max(1, num_programs))
    traffic_cap = capacity // (10 * rows)
    blocks_cap = capacity // (4 * block_k)
    return max(1, min(want, traffic_cap, blocks_cap))


def plan_tiling(
    batch: int, seq: int, group: int, kv_heads: int, capacity: int, *,
    block_q: int | None = None, block_k: int = 64, k_splits: int | None = None,
    num_warps: int | None = None, num_stages: int = 2,
) -> Tiling:
    """Chooses static block sizes for B, T, G, KVH, S (None = heuristic default)."""
    rows = max(MIN_DOT, next_pow2(group * seq))
    block_q = min(rows, 128) if block_q is None else max(MIN_DOT, next_pow2(block_q))
    block_q = min(block_q, rows)
    row_blocks = -(-group * seq // block_q)
    if block_k < MIN_DOT or block_k != next_pow2(block_k):
        raise ValueError(f"block_k must be a power of two >= {MIN_DOT}, got {block_k}")
    block_k = min(block_k, max(MIN_DOT, prev_pow2(capacity)))  # a block never exceeds S ...
    if k_splits is None:
        k_splits = default_k_splits(batch * kv_heads * row_blocks, capacity, rows, block_k)
    if num_warps is None:
        num_warps = 4 if block_q <= 64 else 8
    return Tiling(
        block_q=block_q, row_blocks=row_blocks, block_k=block_k,
        new_block=max(MIN_DOT, next_pow2(seq)), k_splits=max(1, int(k_splits)),
        num_warps=num_warps, num_stages=num_stages,
    )


def triton_compiler_params(num_warps: int, num_stages: int):
    """Triton backend params; `CompilerParams` (jax ≥ 0.7) or the older `TritonCompilerParams`."""
    cls = getattr(plgpu, "CompilerParams", None) or plgpu.TritonCompilerParams
    return cls(num_warps=num_warps, num_stages=num_stages)


# ---------------------------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------------------------


def _attend_block(state, q, k, v, scale: float, mask, keys_by_column: bool, key_poison=None):
    """One online-softmax step of the tile over one key block.

    state: (acc `[Mq, Dh]` f32, m `[Mq]` f32, l `[Mq]` f32); q `[Mq, Dh]`; k `[Dh, Nk]` if
    keys_by_column (the cache's transposed keys) else `[Nk, Dh]`; v `[Nk, Dh]`;
    mask: None or bool broadcastable to `[Mq, Nk]` (True = attend);
    key_poison: None or `[Nk]` f32, 0 or NaN (`nonfinite_poison`), added to the keys' scores.
    """
    acc, m_prev, l_prev = state
    scores = mxu_dot(q, k, 0 if keys_by_column else 1) * scale  # [Mq, Nk] f32
    if key_poison is not None:
        scores = scores + key_poison[None, :]
    if mask is not None:
        scores = jnp.where(mask, scores, MASKED_SCORE)
    m_next = jnp.maximum(m_prev, scores.max(axis=1))
    probs = jnp.exp(scores - m_next[:, None])
    if mask is not None:  # a fully masked row has m_next == MASKED_SCORE: exp(0) must not count
        probs = jnp.where(mask, probs, 0.0)
    correction = jnp.exp(m_prev - m_next)
    acc = acc * correction[:, None] + mxu_dot(probs.astype(v.dtype), v, 0)
    return acc, m_next, l_prev * correction + probs.sum(axis=1)


def _split_range(length, split, k_splits: int, block_k: int):
    """[start, end) of the cached keys that split `split` covers: equal block-aligned shares."""
    chunk = pl.cdiv(length, k_splits * block_k) * block_k
    start = jnp.minimum(split * chunk, length)
    return start, jnp.minimum(start + chunk, length)


def _attend_prefix(state, q, k_ref, v_ref, start, end, scale: float, block_k: int):
    """Streams cached keys [start, end) of k_ref `[Dh, S]` / v_ref `[S, Dh]`: full blocks, then a
    masked tail."""
    num_full = (end - start) // block_k

    def full_block(i, carry):
        block = pl.ds(start + i * block_k, block_k)
        return _attend_block(carry, q, k_ref[:, block], v_ref[block, :], scale, None, True)

    state = jax.lax.fori_loop(0, num_full, full_block, state)
    tail_start = start + num_full * block_k

    def tail_block(carry):
        valid = tail_start + jnp.arange(block_k) < end  # [block_k]
        block = pl.ds(tail_start, block_k)
        k = plgpu.load(k_ref.at[:, block], mask=valid[None, :], other=0.0)
        v = plgpu.load(v_ref.at[block, :], mask=valid[:, None], other=0.0)
        return _attend_block(carry, q, k, v, scale, valid[None, :], True)

    return jax.lax.cond(tail_start < end, tail_block, lambda carry: carry, state)


def _verify_kernel(
    q_ref, k_ref, v_ref, kn_ref, vn_ref, mask_ref, len_ref, *refs, scale: float, tiling: Tiling
):
    """One (row b, KV head h, split s, row block) program.

    q_ref `[block_q, Dh]`; k_ref `[Dh, S]`, v_ref `[S, Dh]` (the row's cache for head h); kn_ref, vn_ref
    `[Tp, Dh]`; mask_ref `[block_q, Tp]` int8; len_ref `[1]`; outputs (the last 3 of refs;
    any before them are aliased poison buffers, unused): o_ref `[block_q, Dh]`,
    m_ref, l_ref `[block_q]`.
    """
    o_ref, m_ref, l_ref = refs[-3:]
    split = pl.program_id(2)
    q = q_ref[...].astype(k_ref.dtype)
    block_q, head_dim = q.shape
    state = (
        jnp.zeros((block_q, head_dim), jnp.float32),
        jnp.full((block_q,), MASKED_SCORE, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
    )
    start, end = _split_range(len_ref[0], split, tiling.k_splits, tiling.block_k)
    state = _attend_prefix(state, q, k_ref, v_ref, start, end, scale, tiling.block_k)

    def new_tokens(carry):
        mask = mask_ref[...] != 0
        k_new, v_new = kn_ref[...], vn_ref[...]
        poison = nonfinite_poison(k_new, 1) + nonfinite_poison(v_new, 1)  # [Tp]
        return _attend_block(
            carry, q, k_new, finite_or_zero(v_new), scale, mask, False, key_poison=poison
        )

    acc, m, l = jax.lax.cond(
        split == tiling.k_splits - 1, new_tokens, lambda carry: carry, state
    )
    o_ref[...] = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype)
    m_ref[...] = m
    l_ref[...] = l


def verify_partials(
    q_tiles: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    lengths: jax.Array,
    row_mask: jax.Array,
    *,
    tiling: Tiling,
    scale: float,
    interpret: bool,
    poison: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Runs the kernel: per-split normalised tiles and their softmax statistics.

    Args:
      q_tiles: `[B, KVH, Rp, Dh]` packed queries (`pack_queries`).
      k_new, v_new: `[B, Tp, KVH, Dh]` new keys/values, zero-padded to Tp tokens.
      k_cache: `[B, KVH, Dh, S]`, v_cache: `[B, KVH, S, Dh]` (one layer of `KVCache`).
      lengths: `[B]` int32, 0 ≤ lengths ≤ S.
      row_mask: `[B, Rp, Tp]` int8 (`expand_tree_mask`).
      poison: start the outputs as NaN (aliased buffers), so an element a program fails to
        write stays NaN — a testing aid.

    Returns:
      o `[B, KVH, k_splits, Rp, Dh]` in q's dtype (each split's tile normalised by its own
      sum), m and l `[B, KVH, k_splits, Rp]` f32 (running max and sum of each split).
    """
    batch, kv_heads, rows, head_dim = q_tiles.shape
    capacity, new_block = v_cache.shape[2], k_new.shape[1]
    t = tiling
    grid = (batch, kv_heads, t.k_splits, t.row_blocks)
    out_shape = (
        jax.ShapeDtypeStruct((batch, kv_heads, t.k_splits, rows, head_dim), q_tiles.dtype),
        jax.ShapeDtypeStruct((batch, kv_heads, t.k_splits, rows), jnp.float32),
        jax.ShapeDtypeStruct((batch, kv_heads, t.k_splits, rows), jnp.float32),
    )
    out_specs = (
        pl.BlockSpec((None, None, None, t.block_q, head_dim), lambda b, h, s, r: (b, h, s, r, 0)),
        pl.BlockSpec((None, None, None, t.block_q), lambda b, h, s, r: (b, h, s, r)),
        pl.BlockSpec((None, None, None, t.block_q), lambda b, h, s, r: (b, h, s, r)),
    )
    in_specs = [
        pl.BlockSpec((None, None, t.block_q, head_dim), lambda b, h, s, r: (b, h, r, 0)),
        pl.BlockSpec((None, None, head_dim, capacity), lambda b, h, s, r: (b, h, 0, 0)),
        pl.BlockSpec((None, None, capacity, head_dim), lambda b, h, s, r: (b, h, 0, 0)),
        pl.BlockSpec((None, new_block, None, head_dim), lambda b, h, s, r: (b, 0, h, 0)),
        pl.BlockSpec((None, new_block, None, head_dim), lambda b, h, s, r: (b, 0, h, 0)),
        pl.BlockSpec((None, t.block_q, new_block), lambda b, h, s, r: (b, r, 0)),
        pl.BlockSpec((1,), lambda b, h, s, r: (b,)),
    ]
    args = [q_tiles, k_cache, v_cache, k_new, v_new, row_mask, lengths]
    aliases = {}
    if poison:
        aliases = {len(args) + i: i for i in range(len(out_shape))}
        args += [jnp.full(o.shape, jnp.nan, o.dtype) for o in out_shape]
        in_specs += list(out_specs)
    return pl.pallas_call(
        functools.partial(_verify_kernel, scale=scale, tiling=tiling),
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=triton_compiler_params(t.num_warps, t.num_stages),
        interpret=interpret,
        name="verify_attention",
    )(*args)


def combine_splits(o: jax.Array, m: jax.Array, l: jax.Array) -> jax.Array:
    """Log-sum-exp merge of split tiles: o `[B, KVH, K, Rp, Dh]`, m, l `[B, KVH, K, Rp]` -> `[B, KVH, Rp, Dh]`.

    Split s contributes weight l_s·exp(m_s − max_s m_s); empty splits (l = 0) contribute 0.
    """
    weights = l * jnp.exp(m - m.max(axis=2, keepdims=True))  # [B, KVH, K, Rp]
    total = weights.sum(axis=2)
    merged = (weights[..., None] * o.astype(jnp.float32)).sum(axis=2)
    return (merged / jnp.where(total > 0, total, 1.0)[..., None]).astype(o.dtype)


# ---------------------------------------------------------------------------------------------
# Public entry point
# ---------------------------------------------------------------------------------------------


def kernel_head_dim(head_dim: int) -> int:
    """Head dim the kernel runs at: a power of two ≥ 16 (others are zero-padded, a slow path)."""
    return max(MIN_DOT, next_pow2(head_dim))


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale", "block_q", "block_k", "k_splits", "num_warps", "num_stages", "interpret",
        "poison",
    ),
)
def verify_attention(
    q: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    lengths: jax.Array,
    tree_mask: jax.Array,
    *,
    scale: float | None = None,
    block_q: int | None = None,
    block_k: int = 64,
    k_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
    interpret: bool | None = None,
    poison: bool = False,
) -> jax.Array:
    """Verify attention by the Pallas kernel; same contract as `verify_attention_reference`.

    Args:
      q: `[B, T, Hq, Dh]`; k_new, v_new: `[B, T, KVH, Dh]`; k_cache: `[B, KVH, Dh, S]`;
        v_cache: `[B, KVH, S, Dh]`; lengths: `[B]` int32 (clamped to [0, S]); tree_mask:
        `[B, T, T]` bool.
      scale: softmax scale, default Dh ** -0.5.
      block_q: query rows per tile (default: all G·T rows padded, at most 128).
      block_k: cached keys per block. k_splits: splits of the cached length (default: a
        heuristic filling the GPU, see `default_k_splits`). num_warps / num_stages: Triton.
      interpret: run the kernel in Pallas interpret mode; default: True unless on GPU.
      poison: testing aid, see `verify_partials`.

    Returns:
      `[B, T, Hq, Dh]` in q's dtype.
    """
    batch, seq, heads, head_dim = q.shape
    kv_heads, capacity = v_cache.shape[1], v_cache.shape[2]
    group = heads // kv_heads
    scale = head_dim ** -0.5 if scale is None else scale
    interpret = jax.default_backend() != "gpu" if interpret is None else interpret
    tiling = plan_tiling(
        batch, seq, group, kv_heads, capacity, block_q=block_q, block_k=block_k,
        k_splits=k_splits, num_warps=num_warps, num_stages=num_stages,
    )
    dim = kernel_head_dim(head_dim)
    if dim != head_dim:
        q, k_new, v_new, v_cache = (pad_axis(x, 3, dim) for x in (q, k_new, v_new, v_cache))
        k_cache = pad_axis(k_cache, 2, dim)
    if capacity < tiling.block_k:  # ... except in caches shorter than 16: pad those (tiny)
        k_cache, v_cache = pad_axis(k_cache, 3, tiling.block_k), pad_axis(v_cache, 2, tiling.block_k)
    o, m, l = verify_partials(
        pack_queries(q, kv_heads, tiling.rows),
        pad_axis(k_new, 1, tiling.new_block),
        pad_axis(v_new, 1, tiling.new_block),
        k_cache,
        v_cache,
        jnp.clip(lengths.astype(jnp.int32), 0, capacity),
        expand_tree_mask(tree_mask, group, tiling.rows, tiling.new_block),
        tiling=tiling,
        scale=scale,
        interpret=interpret,
        poison=poison,
    )
    tiles = o[:, :, 0] if tiling.k_splits == 1 else combine_splits(o, m, l)
    return unpack_rows(tiles, seq, group)[..., :head_dim]


__all__ = [
    "Tiling",
    "combine_splits",
    "default_k_splits",
    "expand_tree_mask",
    "pad_axis",
    "pack_queries",
    "plan_tiling",
    "unpack_rows",
    "verify_attention",
    "verify_partials",
]
