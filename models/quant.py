"""Weight-only quantization of the Llama params with qwix (int8, int4, fp8).

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

and `models.llama.Linear` multiplies with `qwix.dot_general` (weight-only: the activations
stay in the model dtype). `nn.scan` slices QArray leaves on their layer axis like any array.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import qwix

Params = Any
#: block size of int4 along a kernel's input axis (GGUF Q4_0's block: those map exactly)
INT4_BLOCK = 32


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """How one mode quantizes a kernel: the qwix qtype and the block size along the input axis
    (None: one scale per output channel)."""

    mode: str
    qtype: Any
    block: int | None = None


SPECS: dict[str, QuantSpec] = {
    "int8": QuantSpec("int8", jnp.int8),
    "int4": QuantSpec("int4", jnp.int4, INT4_BLOCK),
    "fp8": QuantSpec("fp8", jnp.float8_e4m3fn),
}
QUANT_MODES = tuple(SPECS)


@functools.cache
def backend_supports(qtype_name: str) -> bool:
    """Whether this process's default backend compiles and runs a `qtype_name` quantize ->
    dot_general (a tiny probe, once per process)."""
    qtype = SPECS[qtype_name].qtype
    try:
        x = jnp.linspace(-1.0, 1.0, 64, dtype=jnp.float32).reshape(8, 8)
        q = qwix.quantize(x, qtype, channelwise_axes=(1,))
        y = jax.jit(lambda a, w: qwix.dot_general(a, w, (((1,), (0,)), ((), ()))))(x, q)
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
    return qwix.quantize(kernel, spec.qtype, channelwise_axes=channelwise, tiled_axes=tiled)


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
    """The mode of the first QArray leaf of `params` ("int8" / "int4" / "fp8"), None if none."""
    if params is None:
        return None
    for leaf in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, qwix.QArray)):
        if isinstance(leaf, qwix.QArray):
            return next((m for m, s in SPECS.items() if jnp.dtype(s.qtype) == jnp.dtype(leaf.qtype)),
                        str(leaf.qtype))
    return None

