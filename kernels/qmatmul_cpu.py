"""Matmuls over a stack of layer kernels read in place on XLA CPU: C++ kernels behind the XLA
FFI, and their jnp references.

    w = pack(qvalue)                         # int8 [L, K, N] -> [L, N/16, K, 16]
    y = qmatmul(x, w, scale, layer)          # x f32 [..., K] -> [..., N]
    y = qmatmul_reference(x, w, scale, layer)
    y = matmul(x, stack, layer)              # a float stack f32 / bf16 [L, K, N] as stored
    y = matmul_reference(x, stack, layer)

`y = x @ (w[layer] * scale[layer])`, the scale per output channel (`[L, 1, N]`) or per block of
K / G inputs (`[L, G, N]`). Why a kernel: XLA CPU dequantizes an int8 kernel to f32 in a fusion
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

The source is compiled on first use (`kernels.cpu_ffi`: `-O3 -march=native`, cached in
`$SPECJAX_CACHE/kernels`). `SPECJAX_CPU_KERNELS=0` switches it off; without a compiler, or when
the build fails, the callers keep XLA's path (`available()` says why).
"""
from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp

from specjax.kernels import cpu_ffi
from specjax.kernels.cpu_ffi import ENV_SWITCH, switched_off  # noqa: F401 (this kernel's switch)

#: columns per packed block
BLOCK = 16
#: the FFI targets' names: the int8 kernel, and the float kernel per weight dtype
TARGET = "specjax_qmatmul_int8"
FLOAT_TARGETS = {jnp.dtype(jnp.float32): "specjax_matmul_f32", jnp.dtype(jnp.bfloat16): "specjax_matmul_bf16"}
SOURCE = Path(__file__).with_name("qmatmul_cpu.cc")


# ---------------------------------------------------------------------------------------------
# Layout
# ---------------------------------------------------------------------------------------------


def packable(shape: tuple[int, ...]) -> bool:
    """Whether a kernel `[..., K, N]` packs: N a whole number of blocks."""
    return len(shape) >= 2 and shape[-1] % BLOCK == 0 and shape[-1] > 0 and shape[-2] > 0


def pack(values: jax.Array) -> jax.Array:
    """int kernel `[L, K, N]` -> int8 `[L, N/16, K, 16]` (column blocks, each row after row)."""
    layers, k, n = values.shape
    blocks = values.astype(jnp.int8).reshape(layers, k, n // BLOCK, BLOCK)
    return blocks.transpose(0, 2, 1, 3)


def unpack(packed: jax.Array) -> jax.Array:
    """`pack`'s inverse: `[L, N/16, K, 16]` -> `[L, K, N]`."""
    layers, nblocks, k, _ = packed.shape
    return packed.transpose(0, 2, 1, 3).reshape(layers, k, nblocks * BLOCK)


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


def qmatmul(x: jax.Array, packed: jax.Array, scale: jax.Array, layer: jax.Array | int) -> jax.Array:
    """x f32 `[..., K]`, packed int8 `[L, N/16, K, 16]`, scale f32 `[L, G, N]`, layer int32 `[]`
    -> f32 `[..., N]` by the CPU kernel (call `available()` first: this one assumes it).
    Differentiable in x and scale (the backward pass is the reference's)."""
    layers, nblocks, k, _ = packed.shape
    if x.shape[-1] != k or scale.ndim != 3 or scale.shape[::2] != (layers, nblocks * BLOCK):
        raise ValueError(f"qmatmul: x {x.shape}, packed {packed.shape} and scale {scale.shape} "
                         "do not fit")
    return _qmatmul(x.astype(jnp.float32), packed, scale.astype(jnp.float32),
                    jnp.asarray(layer, jnp.int32))


@jax.custom_batching.custom_vmap
def _call(x, packed, scale, layer):
    out = jax.ShapeDtypeStruct((*x.shape[:-1], packed.shape[1] * BLOCK), jnp.float32)
    return jax.ffi.ffi_call(TARGET, out)(x, packed, scale, layer)


@_call.def_vmap
def _call_vmap(axis_size, in_batched, x, packed, scale, layer):
    """Rows batched alone are more rows of one call (the kernel reads any leading shape of x);
    a batched kernel, scale or layer maps the call over the batch."""
    if not any(in_batched[1:]):
        return _call(x, packed, scale, layer), in_batched[0]
    args = [a if batched else jnp.broadcast_to(a, (axis_size, *a.shape))
            for a, batched in zip((x, packed, scale, layer), in_batched)]
    return jax.lax.map(lambda one: _call(*one), tuple(args)), True


@jax.custom_vjp
def _qmatmul(x, packed, scale, layer):
    return _call(x, packed, scale, layer)


def _qmatmul_fwd(x, packed, scale, layer):
    return _qmatmul(x, packed, scale, layer), (x, packed, scale, layer)


def _qmatmul_bwd(residuals, grad):
    x, packed, scale, layer = residuals
    _, pullback = jax.vjp(lambda a, s: qmatmul_reference(a, packed, s, layer), x, scale)
    grad_x, grad_scale = pullback(grad)
    return grad_x, None, grad_scale, None


_qmatmul.defvjp(_qmatmul_fwd, _qmatmul_bwd)


# ---------------------------------------------------------------------------------------------
# Float kernels as stored
# ---------------------------------------------------------------------------------------------


def float_kernel_fits(stack) -> bool:
    """Whether `matmul` multiplies by this stacked kernel: f32 / bf16 `[L, K, N]`, N a positive
    multiple of 16, K > 0."""
    return (getattr(stack, "ndim", 0) == 3 and jnp.dtype(stack.dtype) in FLOAT_TARGETS
            and packable(stack.shape))


def matmul_reference(x: jax.Array, stack: jax.Array, layer: jax.Array | int) -> jax.Array:
    """x `[..., K]` @ stack[layer] (f32 products and sums) -> f32 `[..., N]`: jnp."""
    kernel = jax.lax.dynamic_index_in_dim(stack, layer, keepdims=False).astype(jnp.float32)
    return jnp.matmul(x.astype(jnp.float32), kernel, precision=jax.lax.Precision.HIGHEST)


def matmul(x: jax.Array, stack: jax.Array, layer: jax.Array | int) -> jax.Array:
    """x `[..., K]` (cast to f32), stack f32 / bf16 `[L, K, N]` (`float_kernel_fits`), layer
    int32 `[]` -> f32 `[..., N]` by the CPU kernel (call `available()` first: this one assumes
    it). Differentiable in x and the stack (the backward pass is the reference's)."""
    if not float_kernel_fits(stack) or x.shape[-1] != stack.shape[1]:
        raise ValueError(f"matmul: x {x.shape} and stack {stack.shape} {stack.dtype} do not fit "
                         "(a f32 / bf16 [L, K, N] stack, N a multiple of 16)")
    return _matmul(x.astype(jnp.float32), stack, jnp.asarray(layer, jnp.int32))


@jax.custom_batching.custom_vmap
def _float_call(x, stack, layer):
    out = jax.ShapeDtypeStruct((*x.shape[:-1], stack.shape[-1]), jnp.float32)
    return jax.ffi.ffi_call(FLOAT_TARGETS[jnp.dtype(stack.dtype)], out)(x, stack, layer)


@_float_call.def_vmap
def _float_call_vmap(axis_size, in_batched, x, stack, layer):
    """As `_call_vmap`: batched rows alone are more rows of one call, else a map."""
    if not any(in_batched[1:]):
        return _float_call(x, stack, layer), in_batched[0]
    args = [a if batched else jnp.broadcast_to(a, (axis_size, *a.shape))
            for a, batched in zip((x, stack, layer), in_batched)]
    return jax.lax.map(lambda one: _float_call(*one), tuple(args)), True


@jax.custom_vjp
def _matmul(x, stack, layer):
    return _float_call(x, stack, layer)


def _matmul_fwd(x, stack, layer):
    return _matmul(x, stack, layer), (x, stack, layer)


def _matmul_bwd(residuals, grad):
    x, stack, layer = residuals
    _, pullback = jax.vjp(lambda a, w: matmul_reference(a, w, layer), x, stack)
    grad_x, grad_stack = pullback(grad)
    return grad_x, grad_stack.astype(stack.dtype), None


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def available(folder: Path) -> str | None:
    """None when the kernels are registered with XLA (built into `folder` if needed, once per
    process), else the reason they are not (switched off, no compiler, a failed build)."""
    return cpu_ffi.available(SOURCE, {TARGET: "SpecjaxQMatmulInt8",
                                      FLOAT_TARGETS[jnp.dtype(jnp.float32)]: "SpecjaxMatmulF32",
                                      FLOAT_TARGETS[jnp.dtype(jnp.bfloat16)]: "SpecjaxMatmulBF16"},
                              folder)
