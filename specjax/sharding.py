"""One host, many devices: the mesh, and where every array of a generation job lives on it.

    mesh = make_mesh(parse_mesh("dp=2,tp=4"))         # 8 devices: axes ("dp", "tp")
    params = shard_params(params, mesh, cfg)           # the Llama weights by LLAMA_RULES

Two mesh axes:
- `dp` (data parallel): the rows of a batch. The programs' row inputs (prompt tokens, lengths,
  max_new, per-row keys) are split by rows, the KV cache by its row axis (axis 1); the decode
  state the programs carry follows them (GSPMD propagates the layout).
- `tp` (tensor parallel): inside the model. Attention heads (q/k/v output features, o_proj input
  features) and the MLP hidden (gate/up outputs, down inputs) are split, so each device holds
  1/tp of every layer and of the KV cache's heads; the embedding and the LM head are split over
  the vocabulary; norms are replicated. Weights are replicated over `dp`.

The rules are a table of (path pattern, PartitionSpec) (`LLAMA_RULES`), read by one small
function (`rule_spec`); a leaf no rule names is replicated when small (`SMALL_LEAF_BYTES`), else
split over `tp` along its last axis (`fallback_spec`: output features, so no partial sums).
Everything here is static layout: the jitted programs are unchanged, GSPMD inserts the
collectives (docs/scale_out.md lists them).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from specjax.errors import InputError
from specjax.models.cache import KVCache
from specjax.models.checkpoint import param_specs
from specjax.models.config import ModelConfig
from specjax.models.quant import pack_params, unpack_params

AXES = ("dp", "tp")

#: a leaf no rule names is replicated up to this size (bytes); a larger one is split over tp.
#: 16 MiB: every leaf of the learned heads of a 1B-class target (a 2048 x 2048 bf16 kernel is
#: 8 MiB) stays whole on each device, where one copy costs less than the gathers a split would
#: need; an 8B-class head's 4096 x 32000 LM head (262 MB in bf16) is split.
SMALL_LEAF_BYTES = 16 << 20

#: where the Llama weights sit: a params tree (`{"params": ...}`), or the target's parts inside a
#: learned drafter's params (`{"target": {"params": ...}}`, `drafters.learned.drafting`)
_LLAMA_ROOT = r"(?:target/)?params/"

#: (path pattern, PartitionSpec) of every leaf of the Llama-family params tree
#: (`models.checkpoint.param_specs`); layers are stacked on a leading L axis, kernels are
#: `[L, in, out]`. The vocabulary (not the hidden size) of the embedding and the LM head is
#: split: the LM head then yields each device's slice of the logits `[B, K, V/tp]` with no
#: partial sums to add up (a hidden split would all-reduce the whole `[B, K, V]` logits every
#: step), and the embedding lookup is a masked local gather plus one all-reduce of `[B, T, H]`.
LLAMA_RULES: tuple[tuple[str, P], ...] = (
    (r"layers/self_attn/[qkv]_proj/kernel", P(None, None, "tp")),  # [L, H, heads*Dh]: heads
    (r"layers/self_attn/[qkv]_proj/bias", P(None, "tp")),  # [L, heads*Dh]: follows its kernel
    (r"layers/self_attn/o_proj/kernel", P(None, "tp", None)),  # [L, heads*Dh, H]: heads in
    (r"layers/mlp/(gate|up)_proj/kernel", P(None, None, "tp")),  # [L, H, F]: hidden out
    (r"layers/mlp/down_proj/kernel", P(None, "tp", None)),  # [L, F, H]: hidden in
    (r"layers/.*/scale", P()),  # norms (input, post-attention, q / k): replicated
    (r"norm/scale", P()),  # final norm
    (r"embed_tokens/embedding", P("tp", None)),  # [V, H]: vocabulary
    (r"lm_head/kernel", P(None, "tp")),  # [H, V]: vocabulary
    (r"quantized_head/kernel", P(None, "tp")),  # [H, V]: the int8 LM head (models.quant)
)


# ---------------------------------------------------------------------------------------------
# The mesh
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """A mesh of dp x tp devices (rows x model split)."""

    dp: int = 1
    tp: int = 1

    @property
    def size(self) -> int:
        return self.dp * self.tp

    def __str__(self) -> str:
        return f"dp={self.dp},tp={self.tp}"


def parse_mesh(text: str, num_devices: int | None = None) -> MeshSpec:
    """A MeshSpec from "dp=2,tp=4", "dp=8", "tp=8" or "auto" (every device on dp).

    num_devices: the devices there are (default: `jax.local_device_count()`); the product
    dp * tp must equal it (in a job of several processes, or the devices of all processes:
    a mesh across them). InputError naming the problem otherwise.
    """
    available = jax.local_device_count() if num_devices is None else num_devices
    everywhere = jax.device_count() if num_devices is None and jax.process_count() > 1 else None
    text = text.strip()
    if text == "auto":
        return MeshSpec(dp=available, tp=1)
    sizes: dict[str, int] = {}
    for part in text.split(","):
        name, sep, value = (s.strip() for s in part.partition("="))
        if not sep or name not in AXES:
            raise InputError(f"mesh {text!r}: {part.strip()!r} is not dp=N or tp=N "
                             "(axes: dp, tp; or 'auto')")
        if name in sizes:
            raise InputError(f"mesh {text!r}: axis {name} given twice")
        if not re.fullmatch(r"[0-9]+", value) or int(value) < 1:
            raise InputError(f"mesh {text!r}: {name} must be a positive integer, got {value!r}")
        sizes[name] = int(value)
    spec = MeshSpec(**sizes)
    if spec.size != available and spec.size != everywhere:
        across = "" if everywhere is None else f" ({everywhere} across the processes)"
        raise InputError(f"mesh {text!r} needs dp*tp = {spec.size} devices, "
                         f"{'only ' if spec.size > available else ''}{available} available"
                         + across)
    return spec


def make_mesh(spec: MeshSpec, devices: Sequence | None = None) -> Mesh:
    """A `jax.sharding.Mesh` of shape (dp, tp) with axes ("dp", "tp") over `devices` (default:
    this process's first dp * tp devices; in a job of several processes, a mesh of as many
    devices as all processes hold spans them all, process by process along dp, so tp stays
    within a process)."""
    if devices is None:
        spans_processes = jax.process_count() > 1 and spec.size == jax.device_count()
        devices = jax.devices() if spans_processes else jax.local_devices()
    devices = list(devices)
    if len(devices) < spec.size:
        raise InputError(f"mesh {spec} needs {spec.size} devices, only {len(devices)} available")
    return Mesh(np.array(devices[: spec.size]).reshape(spec.dp, spec.tp), AXES)


def as_mesh(mesh) -> Mesh | None:
    """None, a Mesh (as it is, axes dp and tp), a MeshSpec or a mesh string -> Mesh | None."""
    if mesh is None or isinstance(mesh, Mesh):
        if mesh is not None and tuple(mesh.axis_names) != AXES:
            raise InputError(f"a mesh needs the axes {AXES}, got {tuple(mesh.axis_names)}")
        return mesh
    if isinstance(mesh, str):
        mesh = parse_mesh(mesh)
    if isinstance(mesh, MeshSpec):
        return make_mesh(mesh)
    raise TypeError(f"mesh must be None, a 'dp=N,tp=M' string, a MeshSpec or a Mesh, got "
                    f"{type(mesh).__name__}")


def spans_processes(mesh: Mesh | None) -> bool:
    """Whether `mesh` holds devices of several processes (one program across them)."""
    return mesh is not None and len({d.process_index for d in mesh.devices.flat}) > 1


def axis_size(mesh: Mesh, axis: str) -> int:
    return mesh.shape[axis]


def padded_rows(rows: int, mesh: Mesh | None) -> int:
    """Rows of a batch on `mesh`: `rows` rounded up to a multiple of dp (padding rows)."""
    dp = 1 if mesh is None else axis_size(mesh, "dp")
    return -(-rows // dp) * dp


# ---------------------------------------------------------------------------------------------
# Checks: one line naming the dimension, before anything loads or compiles
# ---------------------------------------------------------------------------------------------


def split_dims(cfg: ModelConfig) -> dict[str, int]:
    """The model dimensions LLAMA_RULES split over tp."""
    return {"num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads,
            "intermediate_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size}


def check_model_divides(cfg: ModelConfig, mesh: Mesh) -> None:
    """InputError when tp does not divide a dimension the rules split."""
    tp = axis_size(mesh, "tp")
    for name, size in split_dims(cfg).items():
        if size % tp:
            raise InputError(f"mesh tp={tp} does not divide {name}={size} of model "
                             f"{cfg.name!r}: choose a tp that divides it")


# ---------------------------------------------------------------------------------------------
# Rules -> PartitionSpecs
# ---------------------------------------------------------------------------------------------


def leaf_path(path) -> str:
    """"params/layers/mlp/up_proj/kernel" for a pytree key path."""
    return jax.tree_util.keystr(path, simple=True, separator="/")


def rule_spec(path: str, rules: Sequence[tuple[str, P]]) -> P | None:
    """The spec of the first rule whose pattern matches the whole path (under a Llama root,
    `_LLAMA_ROOT`), or None."""
    for pattern, spec in rules:
        if re.fullmatch(_LLAMA_ROOT + pattern, path):
            return spec
    return None


def fallback_spec(shape: tuple[int, ...], itemsize: int, tp: int,
                  small_bytes: int = SMALL_LEAF_BYTES) -> P:
    """A leaf no rule names: replicated when at most `small_bytes` (or when tp does not divide
    its last axis), else its last axis (output features) split over tp."""
    if math.prod(shape) * itemsize <= small_bytes or not shape or shape[-1] % tp:
        return P()
    return P(*([None] * (len(shape) - 1)), "tp")


#: the parts of a quantized kernel (`qwix.QArray`, `models.quant`): each follows its kernel's rule
_QARRAY_PART = re.compile(r"/(qvalue|scale|zero_point)$")


def part_spec(spec: P, shape: tuple[int, ...], tp: int) -> P:
    """A kernel's spec for a part of its QArray: a split axis stays split where the part's
    size there is a multiple of tp (the values; a block scale with whole blocks per device),
    else it is replicated (a per-channel scale's size-1 input axis)."""
    return P(*(axis if axis is None or shape[i] % tp == 0 and shape[i] > 1 else None
               for i, axis in enumerate(spec)))


def partition_specs(tree, tp: int, rules: Sequence[tuple[str, P]] = LLAMA_RULES,
                    small_bytes: int = SMALL_LEAF_BYTES):
    """A PartitionSpec per leaf of `tree` (arrays or ShapeDtypeStructs): its rule's, else the
    fallback (`fallback_spec`). A rule whose spec has another rank than its leaf is an error.
    The values and scales of a quantized kernel (`.../kernel/qvalue`, `.../kernel/scale`)
    follow the kernel's rule (`part_spec`)."""

    def spec_of(path, leaf):
        name = leaf_path(path)
        kernel_name = _QARRAY_PART.sub("", name)
        spec = rule_spec(kernel_name, rules)
        if spec is None:
            return fallback_spec(tuple(leaf.shape), np.dtype(leaf.dtype).itemsize, tp, small_bytes)
        if len(spec) not in (0, len(leaf.shape)):
            raise ValueError(f"rule {spec} for {name} does not fit its shape {tuple(leaf.shape)}")
        return spec if kernel_name == name else part_spec(spec, tuple(leaf.shape), tp)

    return jax.tree_util.tree_map_with_path(spec_of, tree)


def llama_param_shapes(cfg: ModelConfig):
    """`{"params": ...}` of ShapeDtypeStructs: the tree `init_params(cfg)` and the loaders make
    (from `param_specs`, nothing computed)."""
    params: dict = {}
    for spec in param_specs(cfg):
        shape = spec.hf_shape[::-1] if spec.transpose else spec.hf_shape
        if spec.per_layer:
            shape = (cfg.num_layers, *shape)
        node = params
        for key in spec.path[:-1]:
            node = node.setdefault(key, {})
        node[spec.path[-1]] = jax.ShapeDtypeStruct(shape, cfg.jnp_dtype)
    return {"params": params}


def named(mesh: Mesh, specs):
    """NamedShardings on `mesh` of a PartitionSpec tree."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs,
                        is_leaf=lambda x: isinstance(x, P))


def param_shardings(mesh: Mesh, cfg: ModelConfig):
    """The NamedSharding tree of a Llama params tree of `cfg` on `mesh` (InputError first when
    tp does not divide the model). `functools.partial(param_shardings, mesh)` is what the
    loaders take as `shardings` (`models.load.load_checkpoint`, `models.hub.load_model`)."""
    check_model_divides(cfg, mesh)
    return named(mesh, partition_specs(llama_param_shapes(cfg), axis_size(mesh, "tp")))


def loader_shardings(mesh: Mesh | None) -> Callable[[ModelConfig], Any] | None:
    """The loaders' `shardings` argument for `mesh` (None: one device)."""
    return None if mesh is None else functools.partial(param_shardings, mesh)


# ---------------------------------------------------------------------------------------------
# Placing arrays
# ---------------------------------------------------------------------------------------------


def put(value, sharding):
    """One leaf on `sharding`: an array already there stays; `jax.device_put` when this
    process holds every device of it; else (a mesh over several processes) each process makes
    the shards on its own devices from its copy of the value (the same on every process)."""
    if isinstance(value, jax.Array) and value.sharding == sharding:
        return value
    if sharding.is_fully_addressable:
        return jax.device_put(value, sharding)
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def place(tree, shardings):
    """`tree`'s leaves on their shardings (`put` per leaf: an array already there stays, a host
    or one-device array is split, never gathered on one device first)."""
    return jax.tree.map(put, tree, shardings)


def fetch(tree):
    """`tree`'s leaves as numpy on the host: `jax.device_get`, or for arrays split over several
    processes' devices an all-gather across the processes (every process gets all of it)."""
    leaves = jax.tree.leaves(tree)
    if all(not isinstance(x, jax.Array) or x.is_fully_addressable for x in leaves):
        return jax.device_get(tree)
    return multihost_utils.process_allgather(tree, tiled=True)


def shard_params(params, mesh: Mesh | None, cfg: ModelConfig | None = None,
                 small_bytes: int = SMALL_LEAF_BYTES):
    """Params (a target's, a draft model's or a learned drafter's) placed on `mesh` by
    LLAMA_RULES and the fallback (quantized kernels as qwix QArrays); `cfg`: a Llama config to
    check tp against first. None mesh: the params as they are, but int8 / int4 kernels on one
    CPU device in the CPU kernel's layout (`quant.pack_params`)."""
    if params is None:
        return params
    if mesh is None:
        return pack_params(params)
    if cfg is not None:
        check_model_divides(cfg, mesh)
    params = unpack_params(params)
    specs = partition_specs(params, axis_size(mesh, "tp"), small_bytes=small_bytes)
    return place(params, named(mesh, specs))


def cache_specs() -> KVCache:
    """KVCache specs: rows over dp, KV heads over tp (k `[L, B, KVH, Dh, S]`, v `[L, B, KVH, S,
    Dh]`, lengths `[B]`)."""
    return KVCache(k=P(None, "dp", "tp"), v=P(None, "dp", "tp"), lengths=P("dp"))


def cache_shardings(mesh: Mesh) -> KVCache:
    return named(mesh, cache_specs())


def replicated(mesh: Mesh) -> NamedSharding:
    """A whole copy on every device of `mesh`."""
    return NamedSharding(mesh, P())


def rows_sharding(mesh: Mesh) -> NamedSharding:
    """A row-major array (`[B, ...]`: tokens, lengths, keys) split by rows over dp."""
    return NamedSharding(mesh, P("dp"))


@functools.lru_cache(maxsize=32)
def _empty_cache_program(target, rows: int, capacity: int, mesh: Mesh):
    """A jitted `target.init_cache(rows, capacity)` whose output is born in its shards."""
    return jax.jit(lambda: target.init_cache(rows, capacity), out_shardings=cache_shardings(mesh))


def empty_cache_on(mesh: Mesh | None, target, rows: int, capacity: int) -> KVCache:
    """`target.init_cache(rows, capacity)` (a `specjax.target.TargetModel`'s empty cache),
    created straight into its shards on `mesh` (never whole on one device); None: as it is."""
    if mesh is None:
        return target.init_cache(rows, capacity)
    return _empty_cache_program(target, rows, capacity, mesh)()
