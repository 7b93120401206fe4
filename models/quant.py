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
stay in the model dtype).

On the CPU backend, int8 and int4 kernels of params on one device become `PackedKernel`s
(`pack_params`: `hub.load_model` does it, and so does `sharding.shard_params` without a mesh,
which every job's params pass): the values packed for the CPU kernel (`kernels.qmatmul_cpu`:
int8 `[L, N/16, K, 16]`; int4 two a byte, uint8 `[L, N/16, K/2, 16]`), the scale as it was,
multiplied by that kernel,
which reads the int8 values in place from the whole stack (`PackedKernel.layer`: the layer loop
hands each layer the stack and its index, `models.llama.scan_layers`). `unpack_params` gives
the QArrays back (what sharding places). `SPECJAX_CPU_KERNELS=0`, or no C++ compiler, keeps
the QArrays.

Float layer kernels (f32 / bf16 `params/layers/*/*_proj/kernel`, `[L, K, N]`) of such params
become `BlockedKernel`s the same way: the same values packed `[L, N/16, K, 16]`, multiplied by
the float kernel (`qmatmul_cpu.matmul_blocks`), each column block one contiguous stream. As
stored, a block is 64 bytes of each of K rows N floats apart, which the caches and the
prefetchers serve far worse (30 layers of SmolLM2's MLP at one row: 6.7 ms packed against 8.7 ms
strided and 12.4 ms by XLA); the sums are the same, bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import qwix

from specjax.kernels import cpu_ffi, qmatmul_cpu
from specjax.models.paths import cache_dir

Params = Any
#: block size of int4 along a kernel's input axis (GGUF Q4_0's block: those map exactly)
INT4_BLOCK = 32
#: the params key of the int8 LM head the int8 / int4 modes add (`quantize_head`)
HEAD = "quantized_head"
#: the modes that add it (fp8 leaves the head as it is)
HEAD_MODES = ("int8", "int4")


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
        keys = _keys(path)
        if is_quantized(leaf) or not is_quantized_kernel(keys):
            return leaf
        return _quantize_kernel_jit(leaf, spec, "/".join(("params",) + keys))

    params = unpack_params(params)  # float kernels in the CPU kernel's layout: as stored again
    inner = jax.tree_util.tree_map_with_path(convert, params["params"], is_leaf=is_quantized)
    if spec.mode in HEAD_MODES and HEAD not in inner:
        inner[HEAD] = {"kernel": _quantize_kernel_jit(head_kernel(inner), SPECS["int8"], HEAD)}
    return {**params, "params": inner}


def head_kernel(inner: Params) -> jax.Array:
    """The float LM head `[H, V]` of params' inner dict: `lm_head`'s kernel, or the tied
    embedding transposed."""
    if "lm_head" in inner:
        return inner["lm_head"]["kernel"]
    return inner["embed_tokens"]["embedding"].T


# ---------------------------------------------------------------------------------------------
# The CPU kernel's layout
# ---------------------------------------------------------------------------------------------


@functools.partial(jax.tree_util.register_dataclass, data_fields=["packed", "scale", "layer"],
                   meta_fields=["mode"])
@dataclasses.dataclass(frozen=True)
class PackedKernel:
    """A quantized layer kernel in the CPU kernel's layout (`kernels.qmatmul_cpu`).

    packed: int8 `[L, N/16, K, 16]`, or for int4 uint8 `[L, N/16, K/2, 16]` (two values a byte:
    `qmatmul_cpu.pack_int4`; int8 one a byte where K is not a multiple of 8), or `[N/16, K, 16]`
    for a single kernel (the LM head);
    scale: f32 `[L, G, N]` (G = 1: per output channel; else one per K / G inputs), or `[G, N]`;
    layer: None for the stack as stored, or an int32 `[]` index: the layer `Linear` multiplies
    by, read in place from the whole stack (`models.llama.scan_layers`);
    mode: "int8" or "int4" (what `quantization_of` reports).
    """

    packed: jax.Array
    scale: jax.Array
    layer: jax.Array | None = None
    mode: str = "int8"

    @property
    def shape(self) -> tuple[int, ...]:
        """The kernel's own shape `[L, K, N]` (or `[K, N]` for one layer sliced off a stack)."""
        *lead, nblocks, _, block = self.packed.shape
        return (*lead, qmatmul_cpu.kernel_inputs(self.packed), nblocks * block)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["blocks", "layer"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class BlockedKernel:
    """A float (f32 / bf16) stacked layer kernel in the CPU kernel's layout: blocks `[L, N/16,
    K, 16]` (`qmatmul_cpu.pack` of the `[L, K, N]` param: the same values), and `layer` as
    `PackedKernel`'s (None for the stack as stored, else the index `Linear` multiplies by)."""

    blocks: jax.Array
    layer: jax.Array | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        """The kernel's own shape `[L, K, N]` (`[K, N]` once a layer is chosen)."""
        layers, nblocks, k, block = self.blocks.shape
        return (k, nblocks * block) if self.layer is not None else (layers, k, nblocks * block)

    @property
    def dtype(self):
        return self.blocks.dtype


#: the params leaves that stand for a kernel held in a CPU kernel's layout or quantized
HELD = (qwix.QArray, PackedKernel, BlockedKernel)


def is_held(leaf) -> bool:
    """Whether a params leaf is one of `HELD` (a tree map's `is_leaf` that keeps them whole)."""
    return isinstance(leaf, HELD)


def is_quantized(leaf) -> bool:
    return isinstance(leaf, (qwix.QArray, PackedKernel))


def cpu_kernel_reason() -> str | None:
    """None when the CPU kernel is registered in this process, else why not."""
    return qmatmul_cpu.available(cache_dir() / "kernels")


def _on_one_cpu(array) -> bool:
    sharding = getattr(array, "sharding", None)
    return (sharding is not None and len(sharding.device_set) == 1
            and next(iter(sharding.device_set)).platform == "cpu")


def packs(leaf) -> bool:
    """Whether `pack_params` packs this QArray: int8 / int4 without zero point, f32 scale, a
    stacked `[L, K, N]` or a single `[K, N]` kernel with N a multiple of 16, on one CPU device."""
    return (isinstance(leaf, qwix.QArray) and leaf.zero_point is None
            and jnp.dtype(leaf.qtype) in (jnp.dtype(jnp.int8), jnp.dtype(jnp.int4))
            and leaf.qvalue.ndim in (2, 3) and leaf.scale.ndim == leaf.qvalue.ndim
            and leaf.scale.dtype == jnp.float32 and leaf.qvalue.shape[1] % leaf.scale.shape[1] == 0
            and qmatmul_cpu.packable(leaf.qvalue.shape) and _on_one_cpu(leaf.qvalue))


def blocks(path: tuple[str, ...], leaf) -> bool:
    """Whether `pack_params` packs the params leaf at `path` (keys from the root) as a
    BlockedKernel: a float layer kernel (`params/layers/.../kernel`) the float kernel multiplies
    (`qmatmul_cpu.float_kernel_fits`: f32 / bf16 `[L, K, N]`, N a multiple of 16) on one CPU
    device."""
    return (len(path) >= 2 and path[0] == "params" and is_quantized_kernel(path[1:])
            and isinstance(leaf, jax.Array) and qmatmul_cpu.float_kernel_fits(leaf)
            and _on_one_cpu(leaf))


def pack_params(params: Params) -> Params:
    """`params` with every QArray `packs` accepts a PackedKernel and every float kernel `blocks`
    accepts a BlockedKernel, when the CPU kernels are available and `$SPECJAX_CPU_KERNELS` (read
    at each call) does not switch them off (else unchanged)."""
    found = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_held)[0]
    floats = cpu_ffi.one_cpu_reason() is None  # the float kernel runs on one device only
    if (qmatmul_cpu.switched_off()
            or not any(packs(leaf) or (floats and blocks(_keys(path), leaf)) for path, leaf in found)
            or cpu_kernel_reason() is not None):
        return params

    def convert(path, leaf):
        if floats and blocks(_keys(path), leaf):
            return BlockedKernel(_pack_jit(leaf))
        if not packs(leaf):
            return leaf
        int4 = jnp.dtype(leaf.qtype) == jnp.dtype(jnp.int4)
        nibbles = int4 and qmatmul_cpu.int4_packable(leaf.qvalue.shape)  # two values a byte
        return PackedKernel(_pack_jit(leaf.qvalue, nibbles), leaf.scale, None, "int4" if int4 else "int8")

    return jax.tree_util.tree_map_with_path(convert, params, is_leaf=is_held)


def _keys(path) -> tuple[str, ...]:
    """A tree path's keys as strings (dict keys, attribute names)."""
    return tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


@functools.partial(jax.jit, static_argnums=1)
def _pack_jit(values: jax.Array, nibbles: bool = False) -> jax.Array:
    """`qmatmul_cpu.pack` (nibbles: `pack_int4`) of a stacked `[L, K, N]` or a single `[K, N]`
    kernel."""
    pack = qmatmul_cpu.pack_int4 if nibbles else qmatmul_cpu.pack
    if values.ndim == 2:
        return pack(values[None])[0]
    return pack(values)


@jax.jit
def _unpack(packed: jax.Array) -> jax.Array:
    if packed.ndim == 3:
        return qmatmul_cpu.unpack(packed[None])[0]
    return qmatmul_cpu.unpack(packed)


def unpack_params(params: Params) -> Params:
    """`pack_params`' inverse: every PackedKernel a qwix QArray again and every BlockedKernel its
    float `[L, K, N]` stack (what sharding places and quantization reads)."""

    def convert(leaf):
        if isinstance(leaf, BlockedKernel):
            return _unpack(leaf.blocks)
        if not isinstance(leaf, PackedKernel):
            return leaf
        qtype = SPECS[leaf.mode].qtype
        return qwix.QArray(_unpack(leaf.packed).astype(qtype), leaf.scale, None, qtype)

    return jax.tree.map(convert, params, is_leaf=is_held)


def packed_matmul(x: jax.Array, kernel: PackedKernel, live: jax.Array | None = None) -> jax.Array:
    """x `[..., K]` @ a PackedKernel -> f32 `[..., N]`: the CPU kernel (its jnp reference where
    the kernel is not registered in this process). A kernel sliced off its stack (no layer
    axis, `layer` None) is read as a stack of one. live `[...]` bool | None: the kernel's dead
    rows (`kernels.qmatmul_cpu`: not computed; the reference computes every row)."""
    packed, scale, layer = kernel.packed, kernel.scale, kernel.layer
    if layer is None:
        if packed.ndim == 3:
            packed, scale = packed[None], scale[None]
        layer = 0
    if cpu_kernel_reason() is None:
        return qmatmul_cpu.qmatmul(x, packed, scale, layer, live)
    return qmatmul_cpu.qmatmul_reference(x.astype(jnp.float32), packed, scale, layer)


def blocked_matmul(x: jax.Array, kernel: BlockedKernel, live: jax.Array | None = None) -> jax.Array:
    """x `[..., K]` @ a BlockedKernel -> f32 `[..., N]`: the float CPU kernel where
    `float_kernel_reason` is None, else its jnp reference (the layer's blocks unpacked);
    live: as `packed_matmul`'s."""
    layer = 0 if kernel.layer is None else kernel.layer
    if float_kernel_reason() is None:
        return qmatmul_cpu.matmul_blocks(x, kernel.blocks, layer, live)
    return qmatmul_cpu.matmul_blocks_reference(x, kernel.blocks, layer)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["stack", "layer"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class LayerKernel:
    """One layer of a float (f32 / bf16) stacked kernel, read in place: the whole `[L, K, N]`
    param as stored and the index of the layer `Linear` multiplies by, with the CPU kernel
    (`kernels.qmatmul_cpu.matmul`). Made by the layer loop (`models.llama.layer_params`) where
    `float_kernel_reason` is None; never stored in params."""

    stack: jax.Array
    layer: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        """The layer's kernel shape `[K, N]`."""
        return tuple(self.stack.shape[1:])

    @property
    def dtype(self):
        return self.stack.dtype


def float_kernel_reason() -> str | None:
    """None when the layer loop multiplies float kernels read in place (`LayerKernel`): the
    CPU backend, one device (the kernel has no partitioning rule: a mesh keeps XLA's path),
    the kernel registered; else why not. Read at each trace."""
    return cpu_ffi.one_cpu_reason() or cpu_kernel_reason()


def layer_kernel(leaf, index: jax.Array) -> LayerKernel | None:
    """`leaf` (a stacked layer param) as a LayerKernel at `index`, when it is a float kernel
    the CPU kernel multiplies (`qmatmul_cpu.float_kernel_fits`) and `float_kernel_reason` is
    None; else None."""
    if not qmatmul_cpu.float_kernel_fits(leaf) or float_kernel_reason() is not None:
        return None
    return LayerKernel(leaf, index)


def float_head_product(hidden: jax.Array, weights, rows: bool,
                       live: jax.Array | None = None) -> jax.Array | None:
    """hidden `[..., H]` times a float LM head by the CPU kernel -> f32 logits `[..., V]`: the
    embedding `[V, H]` of a tied head (rows: `hidden @ weights.T`, `qmatmul_cpu.matmul_rows`),
    or an lm_head kernel `[H, V]` (`qmatmul_cpu.matmul`), read as stored, where
    `float_kernel_reason` is None and the kernel fits; else None (the caller's XLA product).
    XLA CPU multiplies a head by one row as a gemv, by 2-9 rows as a gemm several times slower
    (a verify of a few draft tokens paid that), and the two round apart; the kernel's rows do
    not depend on each other, so a verify's logits are a plain step's bit for bit. live: as
    `packed_matmul`'s."""
    if not isinstance(weights, jax.Array) or float_kernel_reason() is not None:
        return None
    stack = weights[None]
    if rows and qmatmul_cpu.rows_kernel_fits(stack):
        return qmatmul_cpu.matmul_rows(hidden, stack, 0, live)
    if not rows and qmatmul_cpu.float_kernel_fits(stack):
        return qmatmul_cpu.matmul(hidden, stack, 0, live)
    return None


def grouped_product(x: jax.Array, kernels: list, live: jax.Array | None = None) -> list[jax.Array] | None:
    """x `[..., K]` times each of `kernels` (layer kernels of one input, e.g. q / k / v) in one
    CPU kernel call (one hand-off to the thread pool instead of one per kernel) -> f32 outputs,
    when they are all PackedKernels, all BlockedKernels or all LayerKernels (of one dtype), of
    one layer index; else None (the
    caller multiplies them one by one). live: as `packed_matmul`'s."""
    if not kernels or cpu_kernel_reason() is not None:
        return None
    layer = getattr(kernels[0], "layer", None)
    if layer is None or any(getattr(k, "layer", None) is not layer for k in kernels):
        return None
    if all(isinstance(k, PackedKernel) for k in kernels):
        return qmatmul_cpu.qmatmul_group(x, [(k.packed, k.scale) for k in kernels], layer, live)
    if float_kernel_reason() is not None or len({getattr(k, "dtype", None) for k in kernels}) != 1:
        return None
    if all(isinstance(k, BlockedKernel) for k in kernels):
        return qmatmul_cpu.matmul_blocks_group(x, [k.blocks for k in kernels], layer, live)
    if all(isinstance(k, LayerKernel) for k in kernels):
        return qmatmul_cpu.matmul_group(x, [k.stack for k in kernels], layer, live)
    return None


def quantization_of(params: Params) -> str | None:
    """The mode of the first quantized kernel of `params` ("int8" / "int4" / "fp8"), None if
    none."""
    if params is None:
        return None
    for leaf in jax.tree.leaves(params, is_leaf=is_quantized):
        if isinstance(leaf, PackedKernel):
            return leaf.mode
        if isinstance(leaf, qwix.QArray):
            return next((m for m, s in SPECS.items() if jnp.dtype(s.qtype) == jnp.dtype(leaf.qtype)),
                        str(leaf.qtype))
    return None

