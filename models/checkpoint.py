"""Checkpoint-format-independent part of loading: errors, expected shapes, params assembly.

Both loaders (GGUF, HF safetensors) expose their file as a `TensorSource`: a lookup from the
Hugging Face tensor name (`model.layers.3.self_attn.q_proj.weight`) to a numpy array in the
Hugging Face layout (linear weights `[out, in]`, q/k rows in rotate-half order). `assemble_params`
turns such a source into the params tree of `specjax.models.llama` (kernels `[in, out]`, layers
stacked on a leading axis `[L, ...]`), checking every shape on the way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import qwix

from specjax.models.config import ModelConfig
from specjax.models.finite import CheckpointError, check_finite
from specjax.models.quant import SPECS, is_quantized_kernel, unpack_params


@dataclasses.dataclass(frozen=True)
class TensorSource:
    """Tensors of one checkpoint by Hugging Face name.

    `fetch(name)` returns the array (any float dtype, HF layout) or None when the checkpoint has
    no such tensor; `path` and `native_name` (the file's own name of a tensor) go into errors.
    `available` lists the file's own tensor names: any that the model does not read, other than
    those `ignorable` accepts, are an error (a bias or layer this model would silently drop).
    `fetch_blocks(name, mode)`: the tensor as (values `[out, in]`, block scales `[out, in/32]`)
    when the file stores it in a block type quantization `mode` holds exactly (GGUF Q8_0 /
    Q4_0), else None.
    """

    path: str
    fetch: Callable[[str], np.ndarray | None]
    native_name: Callable[[str], str] = str
    available: frozenset[str] = frozenset()
    ignorable: Callable[[str], bool] = lambda name: False
    fetch_blocks: Callable[[str, str], tuple[np.ndarray, np.ndarray] | None] = (
        lambda name, mode: None)

    def describe(self, name: str) -> str:
        native = self.native_name(name)
        return repr(name) if native == name else f"{native!r} ({name})"

    def require(self, name: str) -> np.ndarray:
        array = self.fetch(name)
        if array is None:
            raise CheckpointError(self.path, f"missing tensor {self.describe(name)}")
        return array


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """Where one params leaf lives in a Hugging Face checkpoint."""

    path: tuple[str, ...]  # under "params"
    hf_name: str  # "{i}" stands for the layer index of per-layer tensors
    hf_shape: tuple[int, ...]  # one tensor, HF layout (linear weights [out, in])
    per_layer: bool  # stacked over layers on a leading axis in params
    transpose: bool  # HF [out, in] -> Flax kernel [in, out]


def param_specs(cfg: ModelConfig) -> tuple[ParamSpec, ...]:
    """Every leaf of `init_params(cfg)`, with its HF name and shape."""
    hidden, ffn, dh = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q_dim, kv_dim = cfg.num_heads * dh, cfg.num_kv_heads * dh
    linears = {
        ("self_attn", "q_proj"): (q_dim, hidden),
        ("self_attn", "k_proj"): (kv_dim, hidden),
        ("self_attn", "v_proj"): (kv_dim, hidden),
        ("self_attn", "o_proj"): (hidden, q_dim),
        ("mlp", "gate_proj"): (ffn, hidden),
        ("mlp", "up_proj"): (ffn, hidden),
        ("mlp", "down_proj"): (hidden, ffn),
    }
    vectors = {
        ("input_layernorm",): ("input_layernorm.weight", hidden),
        ("post_attention_layernorm",): ("post_attention_layernorm.weight", hidden),
    }
    if cfg.qk_norm:
        vectors[("self_attn", "q_norm")] = ("self_attn.q_norm.weight", dh)
        vectors[("self_attn", "k_norm")] = ("self_attn.k_norm.weight", dh)

    def layer(path, suffix, shape, transpose):
        return ParamSpec(("layers", *path), f"model.layers.{{i}}.{suffix}", shape, True, transpose)

    vocab = (cfg.vocab_size, hidden)
    specs = [
        ParamSpec(("embed_tokens", "embedding"), "model.embed_tokens.weight", vocab, False, False)
    ]
    for (group, name), shape in linears.items():
        specs.append(layer((group, name, "kernel"), f"{group}.{name}.weight", shape, True))
        if cfg.attention_bias and name in ("q_proj", "k_proj", "v_proj"):
            specs.append(layer((group, name, "bias"), f"{group}.{name}.bias", shape[:1], False))
    for path, (suffix, size) in vectors.items():
        specs.append(layer((*path, "scale"), suffix, (size,), False))
    specs.append(ParamSpec(("norm", "scale"), "model.norm.weight", (hidden,), False, False))
    if not cfg.tie_word_embeddings:
        specs.append(ParamSpec(("lm_head", "kernel"), "lm_head.weight", vocab, False, True))
    return tuple(specs)


def numpy_dtype(dtype: str) -> np.dtype:
    """numpy dtype for a config dtype name ("bfloat16" -> ml_dtypes' bfloat16)."""
    return np.dtype(jnp.dtype(dtype))


def _checked(source: TensorSource, name: str, shape: tuple[int, ...]) -> np.ndarray:
    array = source.require(name)
    if tuple(array.shape) != tuple(shape):
        raise CheckpointError(
            source.path,
            f"tensor {source.describe(name)} has shape {tuple(array.shape)}, "
            f"expected {tuple(shape)}",
        )
    return array


def _names(spec: ParamSpec, num_layers: int) -> list[str]:
    """HF names of the tensors behind one leaf (one per layer for per-layer leaves)."""
    if spec.per_layer:
        return [spec.hf_name.format(i=i) for i in range(num_layers)]
    return [spec.hf_name]


def _leaf(source: TensorSource, spec: ParamSpec, num_layers: int, dtype) -> np.ndarray:
    """One params leaf: `[L, ...]` stacked per-layer tensors or a single tensor, cast to dtype.

    Each tensor is checked for NaN / Inf after the cast (an f32 value past the dtype's range
    counts too), naming it.
    """
    names = _names(spec, num_layers)
    shape = spec.hf_shape[::-1] if spec.transpose else spec.hf_shape
    out = np.empty((len(names), *shape), dtype)
    for i, name in enumerate(names):
        array = _checked(source, name, spec.hf_shape)
        out[i] = array.T if spec.transpose else array
        check_finite(out[i], source.path, f"tensor {source.describe(name)}")
    return out if spec.per_layer else out[0]


def _block_leaf(source: TensorSource, spec: ParamSpec, num_layers: int, dtype,
                mode: str) -> qwix.QArray | None:
    """A layer kernel `[L, in, out]` as a QArray of `mode` read straight from the file's blocks
    (values `[L, in, out]`, scales `[L, in / 32, out]` in `dtype`; no float detour), or None
    unless every layer's tensor is stored in the block type `mode` holds exactly."""
    names = _names(spec, num_layers)
    parts = [source.fetch_blocks(name, mode) for name in names]
    if not parts or any(part is None for part in parts):
        return None
    for name, (values, scales) in zip(names, parts):
        if tuple(values.shape) != tuple(spec.hf_shape):
            raise CheckpointError(source.path, f"tensor {source.describe(name)} has shape "
                                  f"{tuple(values.shape)}, expected {tuple(spec.hf_shape)}")
        check_finite(scales.astype(dtype), source.path, f"block scales of tensor {source.describe(name)}")
    values = np.stack([v.T for v, _ in parts])
    scales = np.stack([s.T for _, s in parts]).astype(dtype)
    return qwix.QArray(jnp.asarray(values), jnp.asarray(scales), None, SPECS[mode].qtype)


def _set(tree: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _get(tree, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree


#: what the loaders take as `shardings`: the model's config -> the params' Sharding tree
#: (`specjax.sharding.loader_shardings(mesh)`), asked once the config is read, before any tensor
ShardingsFor = Callable[[ModelConfig], Any]


def placed_leaf(host: np.ndarray, sharding: jax.sharding.Sharding | None) -> jax.Array:
    """A host leaf on the device(s): whole on the default device without a sharding, else each
    device gets only its own slice (`make_array_from_callback`: the whole leaf never sits on
    one device)."""
    if sharding is None:
        return jnp.asarray(host)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def assemble_params(cfg: ModelConfig, source: TensorSource,
                    shardings: ShardingsFor | None = None, quantize: str | None = None) -> dict:
    """The `{"params": ...}` tree of `LlamaModel(cfg)` from HF-named tensors, in `cfg.dtype`.

    Linear kernels become `[L, in, out]`, norms `[L, D]`; the LM head is read only when
    `cfg.tie_word_embeddings` is False. Raises CheckpointError on a missing tensor or a shape
    mismatch, or a tensor holding NaN / Inf.
    shardings: None (every leaf whole on the default device), or a function of `cfg` giving the
    params' Sharding tree: each leaf is then read on the host (one leaf at a time: layers
    stacked `[L, ...]`) and sent to each device as its slice only.
    quantize: a `models.quant` mode: layer kernels the file stores in a block type that mode
    holds exactly (`TensorSource.fetch_blocks`) become QArrays here, straight from the blocks
    (one device only: a sharded load quantizes after placement); the rest stay floats for
    `quant.quantize_params`.
    """
    placement = None if shardings is None else shardings(cfg)["params"]
    specs = param_specs(cfg)
    used = {source.native_name(n) for spec in specs for n in _names(spec, cfg.num_layers)}
    unused = sorted(n for n in source.available - used if not source.ignorable(n))
    if unused:
        shown = ", ".join(unused[:8]) + (", ..." if len(unused) > 8 else "")
        raise CheckpointError(
            source.path,
            f"{len(unused)} tensors this model does not use (unsupported variant?): {shown}",
        )
    dtype = numpy_dtype(cfg.dtype)
    params: dict = {}
    for spec in specs:
        blocks = None
        if quantize is not None and placement is None and is_quantized_kernel(spec.path):
            blocks = _block_leaf(source, spec, cfg.num_layers, dtype, quantize)
        if blocks is not None:
            _set(params, spec.path, blocks)
            continue
        sharding = None if placement is None else _get(placement, spec.path)
        _set(params, spec.path, placed_leaf(_leaf(source, spec, cfg.num_layers, dtype), sharding))
    return {"params": params}


def params_to_hf(cfg: ModelConfig, params) -> dict[str, np.ndarray]:
    """Inverse of `assemble_params`: HF-named numpy tensors (HF layout) of a params tree (float
    kernels in the CPU kernel's layout unpacked first)."""
    params = unpack_params(params)
    out = {}
    for spec in param_specs(cfg):
        leaf = np.asarray(_get(params["params"], spec.path))
        for i, array in enumerate(leaf if spec.per_layer else [leaf]):
            out[spec.hf_name.format(i=i)] = np.ascontiguousarray(
                array.T if spec.transpose else array
            )
    return out


def float_config(value) -> float:
    """A float from file metadata, rounded to the shortest decimal that its f32 value prints as.

    GGUF stores eps = 1e-5 as f32 (9.99999974e-06); this gives back 1e-05 (same f32 value).
    """
    return float(str(np.float32(value)))
