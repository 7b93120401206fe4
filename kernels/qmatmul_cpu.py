"""Matmuls over a stack of layer kernels read in place on XLA CPU: C++ kernels behind the XLA
FFI, and their jnp references.

    w = pack(qvalue)                         # int8 [L, K, N] -> [L, N/16, K, 16]
    w = pack_int4(qvalue)                    # int4 [L, K, N] -> uint8 [L, N/16, K/2, 16]
    y = qmatmul(x, w, scale, layer)          # x f32 [..., K] -> [..., N]
    y = qmatmul_reference(x, w, scale, layer)
    y = matmul(x, stack, layer)              # a float stack f32 / bf16 [L, K, N] as stored
    y = matmul_reference(x, stack, layer)
    y = matmul_rows(x, stack, layer)         # rows as stored f32 / bf16 [L, N, K]: x @ stack[layer].T
    y = matmul_rows_reference(x, stack, layer)

Each takes `live` too (keyword, default None): `[...]` bool, x's leading shape. A row flagged
False is dead: its outputs are zeros and the kernel neither reads its input nor computes it
(a verify's rows for draft nodes deeper than the step's draft, `specjax.verify`: one program
at the widest draft serves every shorter one at its own cost). The references take the
outputs of every row; `with_dead_rows` zeroes the dead ones.

`y = x @ (w[layer] * scale[layer])`, the scale per output channel (`[L, 1, N]`) or per block of
K / G inputs (`[L, G, N]`); int4 values are held two a byte (`pack_int4`: half int8's bytes,
which a decode step reads all of). Why a kernel: XLA CPU dequantizes an int8 kernel to f32 in a fusion
of its own (int8 read, f32 written and read back: ~9 bytes a weight), and copies each layer's
slice out of the stacked `[L, ...]` params before the matmul reads it; decoding reads every
weight every step, so those bytes are the step (docs/quantization.md). The kernel reads the
int8 weights in place, once per 6 rows of x, from the whole stack at `layer` (no slice copy),
packed in column blocks of 16 so each block is one contiguous stream (`kernels/qmatmul_cpu.cc`).
Each output is one f32 sum over k in order, the same whatever the number of rows.

`matmul` is the same product for float params (f32 or bf16, `y = x @ stack[layer]`): XLA CPU
copies each layer's slice of a stacked kernel before its dot reads it (a `dynamic-slice` fusion
per kernel per layer: every weight read, written and read again each step); the kernel reads
the stack as stored, a column block of 16 row after row (N a multiple of 16).

`matmul_rows` multiplies by a kernel held one row per output (`[N, K]`: an LM head tied to the
embedding, `y = x @ embedding.T`). XLA CPU runs that product as a gemv at one row of x, but as
a gemm 3-4x slower at 2-9 rows (SmolLM2's 113 MB f32 head: 3-4 ms at one row, 8-16 ms at
2-5), so every verify of a few draft tokens paid it; the kernel reads each output's row once
per 6 rows of x.

The source is compiled on first use (`kernels.cpu_ffi`: `-O3 -march=native`, cached in
`$SPECJAX_CACHE/kernels`). `SPECJAX_CPU_KERNELS=0` switches it off; without a compiler, or when
the build fails, the callers keep XLA's path (`available()` says why).
"""
from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp

from specjax.kernels import cpu_ffi
from specjax.kernels.cpu_ffi import ENV_SWITCH, switched_off  # noqa: F401 (this kernel's switch)

#: columns per packed block
BLOCK = 16
#: rows of a column block in one 64-byte run of `pack_int4`'s layout (4 in each nibble)
NIBBLE_ROWS = 8
#: the FFI targets' names: the int8 kernel, and the float kernel per weight dtype
TARGET = "specjax_qmatmul_int8"
FLOAT_TARGETS = {jnp.dtype(jnp.float32): "specjax_matmul_f32", jnp.dtype(jnp.bfloat16): "specjax_matmul_bf16"}
ROWS_TARGETS = {jnp.dtype(jnp.float32): "specjax_matmul_rows_f32",
                jnp.dtype(jnp.bfloat16): "specjax_matmul_rows_bf16"}
BLOCKS_TARGETS = {jnp.dtype(jnp.float32): "specjax_matmul_blocks_f32",
                  jnp.dtype(jnp.bfloat16): "specjax_matmul_blocks_bf16"}
SOURCE = Path(__file__).with_name("qmatmul_cpu.cc")


@functools.partial(jax.tree_util.register_dataclass, data_fields=["stack"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Rows:
    """A float stack `[L, N, K]` held one row of K weights per output (`matmul_rows`), as one
    weight of a kernel call."""

    stack: jax.Array


@functools.partial(jax.tree_util.register_dataclass, data_fields=["stack"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Blocks:
    """A float stack packed in column blocks `[L, N/16, K, 16]` (`pack`; `matmul_blocks`), as
    one weight of a kernel call."""

    stack: jax.Array


# ---------------------------------------------------------------------------------------------
# Layout
# ---------------------------------------------------------------------------------------------


def packable(shape: tuple[int, ...]) -> bool:
    """Whether a kernel `[..., K, N]` packs: N a whole number of blocks."""
    return len(shape) >= 2 and shape[-1] % BLOCK == 0 and shape[-1] > 0 and shape[-2] > 0


def pack(values: jax.Array) -> jax.Array:
    """kernel `[L, K, N]` -> `[L, N/16, K, 16]` (column blocks, each row after row): int values
    as int8, floats in their dtype."""
    layers, k, n = values.shape
    if not jnp.issubdtype(values.dtype, jnp.floating):
        values = values.astype(jnp.int8)
    blocks = values.reshape(layers, k, n // BLOCK, BLOCK)
    return blocks.transpose(0, 2, 1, 3)


def int4_packable(shape: tuple[int, ...]) -> bool:
    """Whether a kernel `[..., K, N]` of int4 values packs two a byte (`pack_int4`): `packable`
    and K a multiple of 8."""
    return packable(shape) and shape[-2] % NIBBLE_ROWS == 0


def pack_int4(values: jax.Array) -> jax.Array:
    """int4 values (-8..7) `[L, K, N]` -> uint8 `[L, N/16, K/2, 16]`, two a byte as the kernel
    reads them: in column block j, the 64 bytes of rows [8 c, 8 c + 8) hold at byte 16 i + col
    row 8 c + i in the low nibble and row 8 c + 4 + i in the high one, each as value + 8
    (`int4_packable` shapes)."""
    layers, k, n = values.shape
    biased = (values.astype(jnp.int32) + 8).astype(jnp.uint8)  # [L, K, N], 0..15
    split = biased.reshape(layers, k // NIBBLE_ROWS, 2, 4, n // BLOCK, BLOCK)
    pairs = split[:, :, 0] | (split[:, :, 1] << 4)  # [L, K/8, 4, N/16, 16]
    return pairs.transpose(0, 3, 1, 2, 4).reshape(layers, n // BLOCK, k // 2, BLOCK)


def unpack(packed: jax.Array) -> jax.Array:
    """`pack`'s inverse: `[L, N/16, K, 16]` -> `[L, K, N]`; and `pack_int4`'s: uint8 `[L, N/16,
    K/2, 16]` -> int8 `[L, K, N]`."""
    layers, nblocks, rows, _ = packed.shape
    if packed.dtype == jnp.uint8:
        runs = packed.reshape(layers, nblocks, rows // 4, 4, BLOCK)
        halves = jnp.stack([runs & 0x0F, runs >> 4], axis=3)  # [L, N/16, K/8, 2, 4, 16]
        packed = (halves.reshape(layers, nblocks, 2 * rows, BLOCK).astype(jnp.int8) - 8)
        rows *= 2
    return packed.transpose(0, 2, 1, 3).reshape(layers, rows, nblocks * BLOCK)


def kernel_inputs(packed: jax.Array) -> int:
    """K of a packed kernel `[..., N/16, K, 16]` (uint8 `[..., N/16, K/2, 16]`: int4 two a byte)."""
    return packed.shape[-2] * (2 if packed.dtype == jnp.uint8 else 1)


def dequantize(packed: jax.Array, scale: jax.Array) -> jax.Array:
    """f32 `[L, K, N]`: the unpacked values times their scale (`[L, G, N]`, G dividing K)."""
    values = unpack(packed).astype(jnp.float32)
    layers, k, n = values.shape
    groups = scale.shape[1]
    grouped = values.reshape(layers, groups, k // groups, n) * scale[:, :, None, :]
    return grouped.reshape(layers, k, n)


# ---------------------------------------------------------------------------------------------
# The product
# ---------------------------------------------------------------------------------------------


def qmatmul_reference(x: jax.Array, packed: jax.Array, scale: jax.Array,
                      layer: jax.Array | int) -> jax.Array:
    """x f32 `[..., K]` @ the dequantized kernel `layer` -> f32 `[..., N]` (jnp, f32 products)."""
    one = [jax.lax.dynamic_index_in_dim(a, layer, keepdims=True) for a in (packed, scale)]
    return jnp.matmul(x, dequantize(*one)[0], precision=jax.lax.Precision.HIGHEST)


def float_kernel_fits(stack) -> bool:
    """Whether `matmul` multiplies by this stacked kernel: f32 / bf16 `[L, K, N]`, N a positive
    multiple of 16, K > 0."""
    return (getattr(stack, "ndim", 0) == 3 and jnp.dtype(stack.dtype) in FLOAT_TARGETS
            and packable(stack.shape))


def matmul_reference(x: jax.Array, stack: jax.Array, layer: jax.Array | int) -> jax.Array:
    """x `[..., K]` @ stack[layer] (f32 products and sums) -> f32 `[..., N]`: jnp."""
    kernel = jax.lax.dynamic_index_in_dim(stack, layer, keepdims=False).astype(jnp.float32)
    return jnp.matmul(x.astype(jnp.float32), kernel, precision=jax.lax.Precision.HIGHEST)


def rows_kernel_fits(stack) -> bool:
    """Whether `matmul_rows` multiplies by this stack: f32 / bf16 `[L, N, K]`, K a positive
    multiple of 8, N > 0."""
    return (getattr(stack, "ndim", 0) == 3 and jnp.dtype(stack.dtype) in ROWS_TARGETS
            and stack.shape[1] > 0 and stack.shape[2] > 0 and stack.shape[2] % 8 == 0)


def matmul_rows_reference(x: jax.Array, stack: jax.Array, layer: jax.Array | int) -> jax.Array:
    """x `[..., K]` @ stack[layer].T (f32 products and sums) -> f32 `[..., N]`: jnp."""
    kernel = jax.lax.dynamic_index_in_dim(stack, layer, keepdims=False).astype(jnp.float32)
    return jnp.matmul(x.astype(jnp.float32), kernel.T, precision=jax.lax.Precision.HIGHEST)


def blocks_kernel_fits(blocks) -> bool:
    """Whether `matmul_blocks` multiplies by this packed stack: f32 / bf16 `[L, N/16, K, 16]`."""
    return (getattr(blocks, "ndim", 0) == 4 and jnp.dtype(blocks.dtype) in BLOCKS_TARGETS
            and blocks.shape[-1] == BLOCK and 0 not in blocks.shape)


def matmul_blocks_reference(x: jax.Array, blocks: jax.Array, layer: jax.Array | int) -> jax.Array:
    """x `[..., K]` @ unpack(blocks)[layer] (f32 products and sums) -> f32 `[..., N]`: jnp."""
    one = jax.lax.dynamic_index_in_dim(blocks, layer, keepdims=True)
    return matmul_reference(x, unpack(one), 0)


def qmatmul(x: jax.Array, packed: jax.Array, scale: jax.Array, layer: jax.Array | int,
            live: jax.Array | None = None) -> jax.Array:
    """x f32 `[..., K]`, packed int8 `[L, N/16, K, 16]` (or uint8 `[L, N/16, K/2, 16]`:
    `pack_int4`), scale f32 `[L, G, N]`, layer int32 `[]`
    -> f32 `[..., N]` by the CPU kernel (call `available()` first: this one assumes it).
    Differentiable in x and scale (the backward pass is the reference's). live: dead rows (the module docstring)."""
    return qmatmul_group(x, [(packed, scale)], layer, live)[0]


def qmatmul_group(x: jax.Array, kernels, layer: jax.Array | int,
                  live: jax.Array | None = None) -> list[jax.Array]:
    """`qmatmul` of one x by each (packed, scale) of `kernels` (of one K), in one call: one
    hand-off to the thread pool for the group (q / k / v, gate / up)."""
    for packed, scale in kernels:
        layers, nblocks, k = packed.shape[0], packed.shape[1], kernel_inputs(packed)
        if x.shape[-1] != k or scale.ndim != 3 or scale.shape[::2] != (layers, nblocks * BLOCK):
            raise ValueError(f"qmatmul: x {x.shape}, packed {packed.shape} and scale {scale.shape} "
                             "do not fit")
    weights = tuple((packed, scale.astype(jnp.float32)) for packed, scale in kernels)
    return list(_product(x.astype(jnp.float32), jnp.asarray(layer, jnp.int32), live_flags(x, live), weights))


def matmul(x: jax.Array, stack: jax.Array, layer: jax.Array | int,
           live: jax.Array | None = None) -> jax.Array:
    """x `[..., K]` (cast to f32), stack f32 / bf16 `[L, K, N]` (`float_kernel_fits`), layer
    int32 `[]` -> f32 `[..., N]` by the CPU kernel (call `available()` first: this one assumes
    it). Differentiable in x and the stack (the backward pass is the reference's)."""
    return matmul_group(x, [stack], layer, live)[0]


def matmul_group(x: jax.Array, stacks, layer: jax.Array | int,
                 live: jax.Array | None = None) -> list[jax.Array]:
    """`matmul` of one x by each stack of `stacks` (one K, one dtype), in one call."""
    _check_float_group("matmul", x, stacks, float_kernel_fits, 1, "[L, K, N] stacks, N a multiple of 16")
    return list(_product(x.astype(jnp.float32), jnp.asarray(layer, jnp.int32), live_flags(x, live),
                         tuple(stacks)))


def _check_float_group(name: str, x: jax.Array, stacks, fits, k_axis: int, layout: str) -> None:
    """ValueError unless every stack `fits`, has x's K on `k_axis` and the first one's dtype."""
    for stack in stacks:
        if not fits(stack) or x.shape[-1] != stack.shape[k_axis] or stack.dtype != stacks[0].dtype:
            raise ValueError(f"{name}: x {x.shape} and stack {stack.shape} {stack.dtype} do not fit "
                             f"(f32 / bf16 {layout} of one dtype)")


def matmul_rows(x: jax.Array, stack: jax.Array, layer: jax.Array | int,
                live: jax.Array | None = None) -> jax.Array:
    """x `[..., K]` (cast to f32), stack f32 / bf16 `[L, N, K]` (`rows_kernel_fits`), layer
    int32 `[]` -> f32 `[..., N]` = x @ stack[layer].T by the CPU kernel (call `available()`
    first). Differentiable in x and the stack (the backward pass is the reference's)."""
    if not rows_kernel_fits(stack) or x.shape[-1] != stack.shape[2]:
        raise ValueError(f"matmul_rows: x {x.shape} and stack {stack.shape} {stack.dtype} do not fit "
                         "(an f32 / bf16 [L, N, K] stack, K a multiple of 8)")
    return _product(x.astype(jnp.float32), jnp.asarray(layer, jnp.int32), live_flags(x, live),
                    (Rows(stack),))[0]


def matmul_blocks(x: jax.Array, blocks: jax.Array, layer: jax.Array | int,
                  live: jax.Array | None = None) -> jax.Array:
    """x `[..., K]` (cast to f32), blocks f32 / bf16 `[L, N/16, K, 16]` (a float stack `pack`ed:
    `blocks_kernel_fits`), layer int32 `[]` -> f32 `[..., N]` = x @ unpack(blocks)[layer] by
    the CPU kernel (call `available()` first). Differentiable in x and the blocks."""
    return matmul_blocks_group(x, [blocks], layer, live)[0]


def matmul_blocks_group(x: jax.Array, stacks, layer: jax.Array | int,
                        live: jax.Array | None = None) -> list[jax.Array]:
    """`matmul_blocks` of one x by each packed stack of `stacks` (one K, one dtype), in one call."""
    _check_float_group("matmul_blocks", x, stacks, blocks_kernel_fits, 2, "[L, N/16, K, 16] stacks")
    return list(_product(x.astype(jnp.float32), jnp.asarray(layer, jnp.int32), live_flags(x, live),
                         tuple(Blocks(b) for b in stacks)))


def live_flags(x: jax.Array, live: jax.Array | None) -> jax.Array:
    """The kernel's live operand for x `[..., K]`: int32 `[M]` (M = x's rows, 0 = a dead row:
    zeros out, its input not read) from live `[...]` bool (x's leading shape), or `[0]` (None:
    every row live)."""
    if live is None:
        return jnp.zeros((0,), jnp.int32)
    if live.shape != x.shape[:-1]:
        raise ValueError(f"live {live.shape} must be x's leading shape {x.shape[:-1]}")
    return live.reshape(-1).astype(jnp.int32)


def with_dead_rows(outputs: tuple, live: jax.Array) -> tuple:
    """The kernel's outputs for the live flags `[M]` (`live_flags`; `[0]`: all live) from each
    output `[..., N]` of every row: a dead row's zeros (what a reference gives the kernel's dead rows)."""
    if live.shape[0] == 0:
        return tuple(outputs)
    return tuple(jnp.where(live.reshape(y.shape[:-1])[..., None] != 0, y, 0.0) for y in outputs)


def _widths(weights) -> list[int]:
    """Each kernel's N: packed int8 (packed, scale) pairs, float stacks `[L, K, N]`, Rows
    `[L, N, K]` or Blocks `[L, N/16, K, 16]`."""
    return [w[0].shape[1] * BLOCK if isinstance(w, tuple) else w.stack.shape[1] if isinstance(w, Rows)
            else w.stack.shape[1] * BLOCK if isinstance(w, Blocks) else w.shape[-1] for w in weights]


def _reference(x, layer, weights) -> tuple:
    def one(w):
        if isinstance(w, tuple):
            return qmatmul_reference(x, *w, layer)
        if isinstance(w, Rows):
            return matmul_rows_reference(x, w.stack, layer)
        if isinstance(w, Blocks):
            return matmul_blocks_reference(x, w.stack, layer)
        return matmul_reference(x, w, layer)
    return tuple(one(w) for w in weights)


def _target(first) -> str:
    """The FFI target of a call whose first weight is `first` (a call holds one kind)."""
    if isinstance(first, tuple):
        return TARGET
    if isinstance(first, Rows):
        return ROWS_TARGETS[jnp.dtype(first.stack.dtype)]
    if isinstance(first, Blocks):
        return BLOCKS_TARGETS[jnp.dtype(first.stack.dtype)]
    return FLOAT_TARGETS[jnp.dtype(first.dtype)]


@jax.custom_batching.custom_vmap
def _call(x, layer, live, weights):
    outs = tuple(jax.ShapeDtypeStruct((*x.shape[:-1], n), jnp.float32) for n in _widths(weights))
    return tuple(jax.ffi.ffi_call(_target(weights[0]), outs)(x, layer, live, *jax.tree.leaves(weights)))


@_call.def_vmap
def _call_vmap(axis_size, in_batched, x, layer, live, weights):
    """Rows batched alone are more rows of one call (the kernel reads any leading shape of x;
    their live flags, batched or not, go with them); a batched kernel, scale or layer maps the
    call over the batch."""
    outs = len(weights)
    x_batched, layer_batched, live_batched, *rest = jax.tree.leaves(in_batched)
    if not layer_batched and not any(rest):
        if not x_batched:  # only the flags vary: each map entry its own call
            return jax.lax.map(lambda flags: _call(x, layer, flags, weights), live), (True,) * outs
        if live.shape[-1] and not live_batched:
            live = jnp.broadcast_to(live, (axis_size, *live.shape))
        return _call(x, layer, live.reshape(-1), weights), (True,) * outs
    args = jax.tree.map(lambda a, batched: a if batched else jnp.broadcast_to(a, (axis_size, *a.shape)),
                        (x, layer, live, weights), tuple(in_batched))
    return jax.lax.map(lambda one: _call(*one), args), (True,) * outs


@jax.custom_vjp
def _product(x, layer, live, weights):
    return _call(x, layer, live, weights)


def _product_fwd(x, layer, live, weights):
    return _product(x, layer, live, weights), (x, layer, live, weights)


def _product_bwd(residuals, grads):
    """The reference's backward: in x, the int8 kernels' scales and the float stacks (None for
    the int8 values and the layer index)."""
    x, layer, live, weights = residuals

    def differentiable(w):
        return w[1] if isinstance(w, tuple) else w.stack if isinstance(w, (Rows, Blocks)) else w

    def rebuilt(w, f):
        return (w[0], f) if isinstance(w, tuple) else type(w)(f) if isinstance(w, (Rows, Blocks)) else f

    def forward(a, floats):
        return with_dead_rows(_reference(a, layer, tuple(rebuilt(w, f) for w, f in zip(weights, floats))), live)

    floats = tuple(differentiable(w) for w in weights)
    _, pullback = jax.vjp(forward, x, floats)
    grad_x, grad_floats = pullback(tuple(grads))
    grad_weights = tuple((None, g) if isinstance(w, tuple) else rebuilt(w, g.astype(f.dtype))
                         for w, f, g in zip(weights, floats, grad_floats))
    return grad_x, None, None, grad_weights


_product.defvjp(_product_fwd, _product_bwd)


def available(folder: Path) -> str | None:
    """None when the kernels are registered with XLA (built into `folder` if needed, once per
    process), else the reason they are not (switched off, no compiler, a failed build)."""
    return cpu_ffi.available(SOURCE, {TARGET: "SpecjaxQMatmulInt8",
                                      FLOAT_TARGETS[jnp.dtype(jnp.float32)]: "SpecjaxMatmulF32",
                                      FLOAT_TARGETS[jnp.dtype(jnp.bfloat16)]: "SpecjaxMatmulBF16",
                                      ROWS_TARGETS[jnp.dtype(jnp.float32)]: "SpecjaxMatmulRowsF32",
                                      ROWS_TARGETS[jnp.dtype(jnp.bfloat16)]: "SpecjaxMatmulRowsBF16",
                                      BLOCKS_TARGETS[jnp.dtype(jnp.float32)]: "SpecjaxMatmulBlocksF32",
                                      BLOCKS_TARGETS[jnp.dtype(jnp.bfloat16)]: "SpecjaxMatmulBlocksBF16"},
                              folder)
