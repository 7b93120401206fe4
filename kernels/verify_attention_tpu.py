"""Pallas (Mosaic TPU) verify attention: one tile holds all G·T query rows of a KV head.

Interface: exactly `verify_attention_reference` (kernels/reference.py):

    verify_attention(q [B, T, Hq, Dh], k_new [B, T, KVH, Dh], v_new, k_cache [B, KVH, Dh, S],
                     v_cache [B, KVH, S, Dh], lengths [B], tree_mask [B, T, T]) -> [B, T, Hq, Dh]

Tile layout (shared with the GPU kernel, `kernels/tiling.py`): the G query heads of KV head h
times the T new tokens are rows r = t·G + g of one query tile `[Rp, Dh]`, Rp = G·T rounded up
to 16 rows (bf16 packs 16 rows per vreg tile). Every K/V block of row b, head h is read from
HBM ONCE for the whole tile. The cache is read in the layout it is stored in: a key block is a
`[Dh, block_k]` column block of the transposed key cache, so q·K is a plain `[Rp, Dh]·[Dh, bk]`
MXU matmul with no transpose, and a value block is `[block_k, Dh]` rows.

Grid: (B, KVH, row blocks, KV blocks); the last axis streams the cache ("arbitrary"), the
others are "parallel" (megacore chips split them across their two TensorCores). The running
max m, sum l (`[Rp, 128]`, lane-replicated as in jax's TPU flash attention) and the f32
accumulator live in VMEM scratch across the KV axis (online softmax).

Streaming: BlockSpec pipelining over the KV-block grid axis, not hand-written
`make_async_copy` loops. Pallas's TPU pipeline double-buffers every input block (the copy of
block j+1 is issued before block j is computed), which is exactly the double buffering this
kernel needs, with the semaphores and buffer slots managed by Mosaic itself. Ragged lengths
enter as a scalar-prefetch operand (SMEM): the K/V index maps clamp the block index to the
row's last valid block, and the pipeline skips a copy whose block index did not change, so
blocks past a row's length are never read from HBM (a row of length 0 reads one block, whose
compute is skipped). What that costs against a manual DMA loop: ~0.35 µs of grid-step
overhead per skipped block (S / block_k steps per row and head), small with block_k = 2048
(a block is consumed chunk_k = 512 keys at a time, keeping the f32 score tile small).
A manual loop would also need its own prologue/epilogue and buffer-slot bookkeeping, with no
bandwidth to gain for this access pattern (contiguous blocks, one stream per program).

Blocks: block_k and chunk_k are multiples of 128 (lanes of the key block); a cache shorter than 128 is
zero-padded to 128 (tiny). A cache whose capacity is not a multiple of block_k ends in a
partial block: its out-of-range part is undefined on TPU (NaN in interpret mode), and the
chunk holding the length masks both the scores and the value rows past it, so nothing leaks.
New tokens: handled in the last KV step, as one more block of Tp = T rounded up to 128 keys
under the row-expanded tree mask (int32), transposed like the cache (`[Dh, Tp]`); their
non-finite poison and zeroed values are computed on the XLA side (tiny).

Numerics: scores, m, l and accumulator in f32; dots accumulate in f32 (HIGHEST precision for
f32 inputs); P is cast to V's dtype for the P·V dot. Masked scores and weights are replaced by
the boolean masks, never by a score's value (as the reference). A query row with nothing to
attend to returns zeros.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from specjax.kernels.reference import MASKED_SCORE, finite_or_zero, nonfinite_poison
from specjax.kernels.tiling import (
    expand_tree_mask,
    mxu_dot,
    pack_queries,
    pad_axis,
    round_up,
    unpack_rows,
)

LANES = 128  # TPU vreg lanes: the key block and the new-token block are multiples of this
ROW_MULTIPLE = 16  # query rows per tile, rounded up (bf16 packs 16 sublanes)


@dataclasses.dataclass(frozen=True)
class TpuTiling:
    """Static block sizes of one call (hashable: a jit static argument)."""

    block_q: int  # query rows per tile (multiple of 16)
    row_blocks: int  # tiles per (row, KV head): ceil(G·T / block_q)
    block_k: int  # cached keys per copied K/V block (a multiple of chunk_k)
    chunk_k: int  # keys per softmax step inside a block (multiple of 128)
    kv_blocks: int  # ceil(S / block_k): the streamed grid axis
    new_block: int  # Tp: new keys per row, padded to a multiple of 128

    @property
    def rows(self) -> int:
        """Rp: padded query rows per (row, KV head)."""
        return self.block_q * self.row_blocks


def plan_tpu_tiling(
    seq: int, group: int, capacity: int, *, block_q: int | None = None, block_k: int = 2048,
    chunk_k: int = 512,
) -> TpuTiling:
    """Block sizes for T new tokens, group G and a cache of `capacity` (≥ 128, see `kernel_capacity`).

    block_k keys are copied per grid step: large, since each step costs ~0.35 µs of fixed
    overhead and a 2048-key bf16 K+V block (Dh 128) is 1 MiB, ~1.3 µs of HBM time on a v5e.
    They are consumed chunk_k keys at a time, so the f32 score tile stays `[block_q, chunk_k]`
    (2 MiB at 1024 rows). Default block_q: all G·T rows in one tile.
    """
    for name, size in (("block_k", block_k), ("chunk_k", chunk_k)):
        if size < LANES or size % LANES:
            raise ValueError(f"{name} must be a positive multiple of {LANES}, got {size}")
    rows = round_up(group * seq, ROW_MULTIPLE)
    block_q = rows if block_q is None else min(rows, round_up(max(1, block_q), ROW_MULTIPLE))
    block_k = min(block_k, capacity // LANES * LANES)  # a block never exceeds the cache
    chunk_k = min(chunk_k, block_k)
    block_k = block_k // chunk_k * chunk_k
    return TpuTiling(
        block_q=block_q, row_blocks=-(-group * seq // block_q), block_k=block_k,
        chunk_k=chunk_k, kv_blocks=-(-capacity // block_k), new_block=round_up(seq, LANES),
    )


def kernel_capacity(capacity: int) -> int:
    """Cache length the kernel runs at: ≥ 128 (a shorter cache is zero-padded, tiny)."""
    return max(capacity, LANES)


def kernel_head_dim(head_dim: int) -> int:
    """Head dim the kernel runs at: a multiple of 128, or 64 (others are zero-padded to a
    multiple of 128, a slow path that copies the cache)."""
    return head_dim if head_dim % LANES == 0 or head_dim == 64 else round_up(head_dim, LANES)


# ---------------------------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------------------------


def _lanes(x: jax.Array, width: int) -> jax.Array:
    """x `[M, 128]` (lane-replicated) -> `[M, width]`: tiled for multiples of 128, sliced below."""
    return jnp.tile(x, (1, width // LANES)) if width % LANES == 0 else x[:, :width]


def _attend_block(scratch, q, k, v, scale: float, mask=None, key_bias=None):
    """One online-softmax step of the tile over one key block, updating VMEM scratch in place.

    scratch: (m_ref, l_ref `[Mq, 128]` f32 lane-replicated, acc_ref `[Mq, Dh]` f32);
    q `[Mq, Dh]`; k `[Dh, Nk]` (keys by column, as the cache stores them); v `[Nk, Dh]`;
    mask: None or bool broadcastable to `[Mq, Nk]` (True = attend); key_bias: None or `[1, Nk]`
    f32 added to the scores (the new tokens' 0 / NaN poison). Nk is a multiple of 128.
    """
    m_ref, l_ref, acc_ref = scratch
    scores = mxu_dot(q, k, 0) * scale  # [Mq, Nk] f32
    if key_bias is not None:
        scores = scores + key_bias
    if mask is not None:
        scores = jnp.where(mask, scores, MASKED_SCORE)
    m_prev, l_prev = m_ref[...], l_ref[...]
    m_next = jnp.maximum(m_prev, jnp.max(scores, axis=1, keepdims=True))  # [Mq, 128]
    probs = jnp.exp(scores - _lanes(m_next, scores.shape[1]))
    if mask is not None:  # a fully masked row has m_next == MASKED_SCORE: exp(0) must not count
        probs = jnp.where(mask, probs, 0.0)
    correction = jnp.exp(m_prev - m_next)  # [Mq, 128]
    m_ref[...] = m_next
    l_ref[...] = l_prev * correction + jnp.sum(probs, axis=1, keepdims=True)
    acc_ref[...] = acc_ref[...] * _lanes(correction, acc_ref.shape[1]) + mxu_dot(
        probs.astype(v.dtype), v, 0
    )


def _attend_chunk(scratch, q, k_ref, v_ref, block_start, chunk: int, length, scale, size: int):
    """Keys [c0, c0 + size) of the block in k_ref `[Dh, block_k]` / v_ref `[block_k, Dh]`,
    c0 = block_start + chunk·size: unmasked when all are below `length`, masked (scores
    replaced, values zeroed) when `length` falls inside, skipped when none is below it."""
    lo = block_start + chunk * size
    cols = slice(chunk * size, (chunk + 1) * size)

    @pl.when(lo + size <= length)
    def _full():
        _attend_block(scratch, q, k_ref[:, cols], v_ref[cols, :], scale)

    @pl.when(jnp.logical_and(lo < length, length < lo + size))
    def _tail():  # keys past the length (or past the cache: undefined memory) are masked
        valid_cols = lo + jax.lax.broadcasted_iota(jnp.int32, (1, size), 1) < length
        valid_rows = lo + jax.lax.broadcasted_iota(jnp.int32, (size, 1), 0) < length
        v = v_ref[cols, :]  # the select in f32 (v5e has no bf16 VPU), on the tail chunk only
        v = jnp.where(valid_rows, v.astype(jnp.float32), 0.0).astype(v.dtype)
        _attend_block(scratch, q, k_ref[:, cols], v, scale, mask=valid_cols)


def _verify_kernel(
    len_ref, q_ref, k_ref, v_ref, kn_ref, vn_ref, bias_ref, mask_ref, o_ref, m_ref, l_ref,
    acc_ref, *, scale: float, tiling: TpuTiling,
):
    """One (row b, KV head h, row block, KV block j) grid step.

    len_ref `[B]` int32 (SMEM, scalar prefetch); q_ref `[block_q, Dh]`; k_ref `[Dh, block_k]`;
    v_ref `[block_k, Dh]`; kn_ref `[Dh, Tp]`; vn_ref `[Tp, Dh]` (finite); bias_ref `[1, Tp]`
    f32 (0 / NaN); mask_ref `[block_q, Tp]` int32; o_ref `[block_q, Dh]`; scratch m_ref, l_ref
    `[block_q, 128]`, acc_ref `[block_q, Dh]` f32.
    """
    j = pl.program_id(3)
    length = len_ref[pl.program_id(0)]
    block_k = tiling.block_k
    scratch = (m_ref, l_ref, acc_ref)
    q = q_ref[...].astype(k_ref.dtype)

    @pl.when(j == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, MASKED_SCORE, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    for chunk in range(block_k // tiling.chunk_k):  # static: unrolled, static ref slices
        _attend_chunk(scratch, q, k_ref, v_ref, j * block_k, chunk, length, scale, tiling.chunk_k)

    @pl.when(j == tiling.kv_blocks - 1)
    def _new_tokens_and_store():
        mask = mask_ref[...] != 0
        _attend_block(scratch, q, kn_ref[...], vn_ref[...], scale, mask=mask, key_bias=bias_ref[...])
        l = l_ref[...]
        inv = jnp.where(l > 0, 1.0 / jnp.where(l > 0, l, 1.0), 0.0)  # empty rows -> zeros
        o_ref[...] = (acc_ref[...] * _lanes(inv, acc_ref.shape[1])).astype(o_ref.dtype)


def kv_block_index(j, length, block_k: int):
    """The K/V block grid step j copies for a row of `length`: j, clamped to the last block
    holding one of its keys (0 for an empty row). A step whose block index repeats the previous
    one copies nothing, so no block past a row's length is read from HBM.

    `lax.div` (truncating; length ≥ 0): jnp's floor division lowers through `sign`, which Mosaic
    lowers per TPU generation and so cannot lower off a TPU.
    """
    return jnp.minimum(j, jnp.maximum(jax.lax.div(length + block_k - 1, block_k) - 1, 0))


def verify_tiles(
    q_tiles: jax.Array,
    k_new_t: jax.Array,
    v_new: jax.Array,
    new_bias: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    lengths: jax.Array,
    row_mask: jax.Array,
    *,
    tiling: TpuTiling,
    scale: float,
    interpret,
) -> jax.Array:
    """Runs the kernel on packed operands.

    Args:
      q_tiles: `[B, KVH, Rp, Dh]` packed queries (`pack_queries`).
      k_new_t: `[B, KVH, Dh, Tp]` new keys, transposed like the cache, zero-padded to Tp.
      v_new: `[B, KVH, Tp, Dh]` new values, finite (non-finite entries zeroed).
      new_bias: `[B, KVH, 1, Tp]` f32, 0 or NaN per new token (`nonfinite_poison`).
      k_cache: `[B, KVH, Dh, S]`, v_cache: `[B, KVH, S, Dh]`, S ≥ 128.
      lengths: `[B]` int32, 0 ≤ lengths ≤ S.
      row_mask: `[B, Rp, Tp]` int32 (`expand_tree_mask`).
      interpret: False on TPU; True or a `pltpu.InterpretParams` to interpret elsewhere.

    Returns:
      `[B, KVH, Rp, Dh]` in q's dtype, normalised.
    """
    batch, kv_heads, rows, head_dim = q_tiles.shape
    t = tiling
    new_block = k_new_t.shape[3]

    def kv_index(b, h, r, j, lens):
        return kv_block_index(j, lens[b], t.block_k)

    in_specs = [
        pl.BlockSpec((None, None, t.block_q, head_dim), lambda b, h, r, j, lens: (b, h, r, 0)),
        pl.BlockSpec(
            (None, None, head_dim, t.block_k),
            lambda b, h, r, j, lens: (b, h, 0, kv_index(b, h, r, j, lens)),
        ),
        pl.BlockSpec(
            (None, None, t.block_k, head_dim),
            lambda b, h, r, j, lens: (b, h, kv_index(b, h, r, j, lens), 0),
        ),
        pl.BlockSpec((None, None, head_dim, new_block), lambda b, h, r, j, lens: (b, h, 0, 0)),
        pl.BlockSpec((None, None, new_block, head_dim), lambda b, h, r, j, lens: (b, h, 0, 0)),
        pl.BlockSpec((None, None, 1, new_block), lambda b, h, r, j, lens: (b, h, 0, 0)),
        pl.BlockSpec((None, t.block_q, new_block), lambda b, h, r, j, lens: (b, r, 0)),
    ]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(batch, kv_heads, t.row_blocks, t.kv_blocks),
        in_specs=in_specs,
        out_specs=pl.BlockSpec(
            (None, None, t.block_q, head_dim), lambda b, h, r, j, lens: (b, h, r, 0)
        ),
        scratch_shapes=[
            pltpu.VMEM((t.block_q, LANES), jnp.float32),
            pltpu.VMEM((t.block_q, LANES), jnp.float32),
            pltpu.VMEM((t.block_q, head_dim), jnp.float32),
        ],
    )
    return pl.pallas_call(
        functools.partial(_verify_kernel, scale=scale, tiling=tiling),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((batch, kv_heads, rows, head_dim), q_tiles.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")
        ),
        interpret=interpret,
        name="verify_attention_tpu",
    )(lengths, q_tiles, k_cache, v_cache, k_new_t, v_new, new_bias, row_mask)


def new_token_operands(k_new: jax.Array, v_new: jax.Array, new_block: int):
    """k_new, v_new `[B, T, KVH, Dh]` -> (keys `[B, KVH, Dh, Tp]`, finite values
    `[B, KVH, Tp, Dh]`, poison `[B, KVH, 1, Tp]` f32: NaN for a token with a non-finite K or V)."""
    poison = nonfinite_poison(k_new) + nonfinite_poison(v_new)  # [B, T, KVH]
    keys = pad_axis(k_new.transpose(0, 2, 3, 1), 3, new_block)
    values = pad_axis(finite_or_zero(v_new).transpose(0, 2, 1, 3), 2, new_block)
    return keys, values, pad_axis(poison.transpose(0, 2, 1)[:, :, None, :], 3, new_block)


# ---------------------------------------------------------------------------------------------
# Public entry point
# ---------------------------------------------------------------------------------------------


@functools.partial(
    jax.jit, static_argnames=("scale", "block_q", "block_k", "chunk_k", "interpret")
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
    block_k: int = 2048,
    chunk_k: int = 512,
    interpret=None,
) -> jax.Array:
    """Verify attention by the Mosaic TPU kernel; same contract as `verify_attention_reference`.

    Args:
      q: `[B, T, Hq, Dh]`; k_new, v_new: `[B, T, KVH, Dh]`; k_cache: `[B, KVH, Dh, S]`;
        v_cache: `[B, KVH, S, Dh]`; lengths: `[B]` int32 (clamped to [0, S]); tree_mask:
        `[B, T, T]` bool.
      scale: softmax scale, default Dh ** -0.5.
      block_q: query rows per tile (default: all G·T rows in one tile).
      block_k: cached keys per streamed (double-buffered) block; chunk_k: keys per softmax
        step inside it (multiples of 128; see `plan_tpu_tiling`).
      interpret: default: True unless on TPU; or a `pltpu.InterpretParams`.

    Returns:
      `[B, T, Hq, Dh]` in q's dtype.
    """
    batch, seq, heads, head_dim = q.shape
    kv_heads, capacity = v_cache.shape[1], v_cache.shape[2]
    group = heads // kv_heads
    scale = head_dim ** -0.5 if scale is None else scale
    interpret = jax.default_backend() != "tpu" if interpret is None else interpret
    dim, kv_len = kernel_head_dim(head_dim), kernel_capacity(capacity)
    if dim != head_dim:
        q, k_new, v_new, v_cache = (pad_axis(x, 3, dim) for x in (q, k_new, v_new, v_cache))
        k_cache = pad_axis(k_cache, 2, dim)
    if kv_len != capacity:
        k_cache, v_cache = pad_axis(k_cache, 3, kv_len), pad_axis(v_cache, 2, kv_len)
    tiling = plan_tpu_tiling(
        seq, group, kv_len, block_q=block_q, block_k=block_k, chunk_k=chunk_k
    )
    keys, values, bias = new_token_operands(k_new, v_new, tiling.new_block)
    tiles = verify_tiles(
        pack_queries(q, kv_heads, tiling.rows),
        keys, values, bias, k_cache, v_cache,
        jnp.clip(lengths.astype(jnp.int32), 0, capacity),
        expand_tree_mask(tree_mask, group, tiling.rows, tiling.new_block, jnp.int32),
        tiling=tiling, scale=scale, interpret=interpret,
    )
    return unpack_rows(tiles, seq, group)[..., :head_dim]


__all__ = [
    "TpuTiling",
    "kernel_capacity",
    "kernel_head_dim",
    "kv_block_index",
    "new_token_operands",
    "plan_tpu_tiling",
    "verify_attention",
    "verify_tiles",
]
