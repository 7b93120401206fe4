"""Quantization of the Llama params with qwix: weight-only int8, int4, fp8, and W8A8.

    params = quantize_params(params, "int8")     # layer kernels -> qwix.QArray
    quantization_of(params)                      # "int8" (None for float params)

What is quantized: the linear kernels of the decoder layers (`params/layers/*/*_proj/kernel`,
`[L, in, out]`, ~80 % of SmolLM2's weights). The embedding, the LM head and the norms stay in
the model dtype (learned drafters read the target's embedding / LM head as plain arrays). A
quantized kernel is a `qwix.QArray` in the same place of the tree: `qvalue [L, in, out]`
(int8 / int4 / float8_e4m3fn) and `scale` in the model dtype,

    int8  per output channel      scale [L, 1, out]        (qwix absmax, symmetric)
    int4  blocks of 32 inputs     scale [L, in / 32, out]  (qwix absmax, symmetric)
    fp8   per output channel      scale [L, 1, out]        (e4m3fn)

    w8a8  int8 kernels as int8 (an `ActivationQArray`), and each matmul quantizes its input
          too: int8, one absmax scale per token (per row of `[..., in]`), so the product is
          an int8 x int8 -> int32 dot (`qwix.dot_general`'s fast path) scaled back to float

and `models.llama.Linear` multiplies with `linear` below (weight-only modes: the activations
stay in the model dtype and qwix dequantizes the kernel into the matmul). Per-token scales keep
each row's result independent of the other rows in the batch (and the int32 sum is exact), so a
verify pass over 1+D tokens gives each token the logits a one-token decode step gives it: greedy
speculative output still equals plain decoding of the same W8A8 target. `nn.scan` slices QArray
leaves on their layer axis like any array.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import qwix

Params = Any
#: block size of int4 along a kernel's input axis (GGUF Q4_0's block: those map exactly)
INT4_BLOCK = 32


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """How one mode quantizes a kernel: the qwix qtype, the block size along the input axis
    (None: one scale per output channel) and the qtype its matmuls quantize their activations
    to per token (None: weight-only)."""

    mode: str
    qtype: Any
    block: int | None = None
    activations: Any = None


SPECS: dict[str, QuantSpec] = {
    "int8": QuantSpec("int8", jnp.int8),
    "int4": QuantSpec("int4", jnp.int4, INT4_BLOCK),
    "fp8": QuantSpec("fp8", jnp.float8_e4m3fn),
    "w8a8": QuantSpec("w8a8", jnp.int8, activations=jnp.int8),
}
QUANT_MODES = tuple(SPECS)


@flax.struct.dataclass
class ActivationQArray(qwix.QArray):
    """A quantized kernel whose matmuls quantize their input too (`act_qtype`, one scale per
    token): a `qwix.QArray` (same leaves, `qvalue` / `scale`) with the activation qtype as
    static pytree data, so the params tree says how it is multiplied."""

    act_qtype: Any = flax.struct.field(pytree_node=False, default=None)


def linear(x: jax.Array, kernel: qwix.QArray) -> jax.Array:
    """x `[..., in]` @ a quantized kernel `[in, out]` -> `[..., out]` in the kernel's scale dtype.

    Weight-only kernels: `qwix.dot_general` (the kernel dequantized into a float matmul).
    `ActivationQArray`: x quantized per token (absmax over `in`) to `act_qtype`, then an integer
    dot. One token (a one-row decode step) runs as two identical rows: XLA CPU's int8
    matrix-vector product is ~1.5x slower than its two-row product, and row 0 of the integer
    product is the same either way."""
    dims = (((x.ndim - 1,), (0,)), ((), ()))
    if not isinstance(kernel, ActivationQArray):
        return qwix.dot_general(x, kernel, dims)
    rows = x.reshape(-1, x.shape[-1])
    single = rows.shape[0] == 1
    if single:
        rows = jnp.concatenate([rows, rows])
    quantized = qwix.quantize(rows, kernel.act_qtype, channelwise_axes=(0,))
    y = qwix.dot_general(quantized, kernel, (((1,), (0,)), ((), ())))
    return (y[:1] if single else y).reshape(*x.shape[:-1], y.shape[-1])


@functools.cache
def backend_supports(qtype_name: str) -> bool:
    """Whether this process's default backend compiles and runs a `qtype_name` quantize ->
    dot_general (a tiny probe, once per process)."""
    spec = SPECS[qtype_name]
    try:
        x = jnp.linspace(-1.0, 1.0, 64, dtype=jnp.float32).reshape(8, 8)
        q = _with_activations(qwix.quantize(x, spec.qtype, channelwise_axes=(1,)), spec)
        y = jax.jit(linear)(x, q)
        return bool(jnp.allclose(y, x @ x, atol=0.5))
    except Exception:  # any lowering / runtime failure means "not supported"
        return False


def check_quantize(mode: str | None) -> QuantSpec | None:
    """The QuantSpec of `mode` (None: no quantization); ValueError for an unknown mode or one
    this backend cannot run (never a silent fallback to another precision)."""
    if mode is None:
        return None
    if mode not in SPECS:
        raise ValueError(f"unknown quantization {mode!r}: use {', '.join(QUANT_MODES)}")
    if not backend_supports(mode):
        raise ValueError(f"quantize={mode!r} is not supported by the {jax.default_backend()} "
                         f"backend of this jaxlib ({SPECS[mode].qtype.__name__} dot failed)")
    return SPECS[mode]


def is_quantized_kernel(path: tuple[str, ...]) -> bool:
    """Whether the params leaf at `path` (keys under "params") is one this module quantizes."""
    return len(path) >= 2 and path[0] == "layers" and path[-1] == "kernel"


def quantize_kernel(kernel: jax.Array, spec: QuantSpec, name: str = "kernel") -> qwix.QArray:
    """kernel `[..., in, out]` (leading stacked axes kept) -> QArray (see the module doc).

    The scale keeps the kernel's dtype. ValueError naming `name` when `in` is not a multiple of
    the block."""
    axis_in = kernel.ndim - 2
    tiled = {}
    if spec.block is not None:
        if kernel.shape[axis_in] % spec.block:
            raise ValueError(f"{spec.mode} needs the input size of {name} "
                             f"({kernel.shape[axis_in]}) to be a multiple of {spec.block}")
        tiled = {axis_in: spec.block}
    channelwise = tuple(a for a in range(kernel.ndim) if a != axis_in)
    return _with_activations(
        qwix.quantize(kernel, spec.qtype, channelwise_axes=channelwise, tiled_axes=tiled), spec)


def _with_activations(q: qwix.QArray, spec: QuantSpec) -> qwix.QArray:
    """`q` as an `ActivationQArray` when `spec` quantizes activations, else as it is."""
    if spec.activations is None:
        return q
    return ActivationQArray(q.qvalue, q.scale, q.zero_point, q.qtype, act_qtype=spec.activations)


_quantize_kernel_jit = jax.jit(quantize_kernel, static_argnums=(1, 2))


def quantize_params(params: Params, mode: str | None) -> Params:
    """`{"params": ...}` with every layer kernel a QArray of `mode` (None: unchanged). Kernels
    already quantized (e.g. read as such from a GGUF file) stay as they are."""
    spec = check_quantize(mode)
    if spec is None:
        return params

    def convert(path, leaf):
        keys = tuple(getattr(k, "key", getattr(k, "name", str(k))) for k in path)
        if isinstance(leaf, qwix.QArray) or not is_quantized_kernel(keys):
            return leaf
        return _quantize_kernel_jit(leaf, spec, "/".join(("params",) + keys))

    inner = jax.tree_util.tree_map_with_path(
        convert, params["params"], is_leaf=lambda x: isinstance(x, qwix.QArray))
    return {**params, "params": inner}


def quantization_of(params: Params) -> str | None:
    """The mode of the first QArray leaf of `params` ("int8" / "int4" / "fp8" / "w8a8"), None
    if none."""
    if params is None:
        return None
    for leaf in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, qwix.QArray)):
        if isinstance(leaf, qwix.QArray):
            act = getattr(leaf, "act_qtype", None)
            return next((m for m, s in SPECS.items() if jnp.dtype(s.qtype) == jnp.dtype(leaf.qtype)
                         and (s.activations is None) == (act is None)), str(leaf.qtype))
    return None

