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

import jax.numpy as jnp
import numpy as np

from specjax.models.config import ModelConfig


class CheckpointError(ValueError):
    """A checkpoint cannot be loaded: the message names the file and what is wrong with it."""

    def __init__(self, path, problem: str):
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


@dataclasses.dataclass(frozen=True)
class TensorSource:
    """Tensors of one checkpoint by Hugging Face name.

    `fetch(name)` returns the array (any float dtype, HF layout) or None when the checkpoint has
    no such tensor; `path` names the checkpoint in error messages.
    """

    path: str
    fetch: Callable[[str], np.ndarray | None]

    def require(self, name: str) -> np.ndarray:
        array = self.fetch(name)
        if array is None:
            raise CheckpointError(self.path, f"missing tensor {name!r}")
        return array


# params path under "layers" -> HF name under "model.layers.{i}." of each per-layer linear
_LAYER_LINEARS = {
    ("self_attn", "q_proj"): "self_attn.q_proj",
    ("self_attn", "k_proj"): "self_attn.k_proj",
    ("self_attn", "v_proj"): "self_attn.v_proj",
    ("self_attn", "o_proj"): "self_attn.o_proj",
    ("mlp", "gate_proj"): "mlp.gate_proj",
    ("mlp", "up_proj"): "mlp.up_proj",
    ("mlp", "down_proj"): "mlp.down_proj",
}
_BIASED = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"))


def linear_shapes(cfg: ModelConfig) -> dict[tuple[str, str], tuple[int, int]]:
    """HF `[out, in]` shape of each per-layer linear weight."""
    hidden, q_dim = cfg.hidden_size, cfg.num_heads * cfg.head_dim
    kv_dim, ffn = cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    return {
        ("self_attn", "q_proj"): (q_dim, hidden),
        ("self_attn", "k_proj"): (kv_dim, hidden),
        ("self_attn", "v_proj"): (kv_dim, hidden),
        ("self_attn", "o_proj"): (hidden, q_dim),
        ("mlp", "gate_proj"): (ffn, hidden),
        ("mlp", "up_proj"): (ffn, hidden),
        ("mlp", "down_proj"): (hidden, ffn),
    }


def layer_vectors(cfg: ModelConfig) -> dict[tuple[str, ...], tuple[str, int]]:
    """Per-layer 1-D tensors: params path -> (HF suffix, length)."""
    out = {
        ("input_layernorm", "scale"): ("input_layernorm.weight", cfg.hidden_size),
        ("post_attention_layernorm", "scale"): ("post_attention_layernorm.weight", cfg.hidden_size),
    }
    if cfg.attention_bias:
        shapes = linear_shapes(cfg)
        for key in _BIASED:
            out[(*key, "bias")] = (f"{_LAYER_LINEARS[key]}.bias", shapes[key][0])
    if cfg.qk_norm:
        out[("self_attn", "q_norm", "scale")] = ("self_attn.q_norm.weight", cfg.head_dim)
        out[("self_attn", "k_norm", "scale")] = ("self_attn.k_norm.weight", cfg.head_dim)
    return out


def numpy_dtype(dtype: str) -> np.dtype:
    """numpy dtype for a config dtype name ("bfloat16" -> ml_dtypes' bfloat16)."""
    return np.dtype(jnp.dtype(dtype))


def _checked(source: TensorSource, name: str, shape: tuple[int, ...]) -> np.ndarray:
    array = source.require(name)
    if tuple(array.shape) != tuple(shape):
        raise CheckpointError(
            source.path, f"tensor {name!r} has shape {tuple(array.shape)}, expected {tuple(shape)}"
        )
    return array


def _stacked(source: TensorSource, cfg: ModelConfig, suffix: str, shape, transpose: bool, dtype):
    """`[L, ...]` stack of `model.layers.{i}.{suffix}` over layers, cast to dtype."""
    out_shape = (cfg.num_layers, *(shape[::-1] if transpose else shape))
    out = np.empty(out_shape, dtype)
    for i in range(cfg.num_layers):
        array = _checked(source, f"model.layers.{i}.{suffix}", shape)
        out[i] = array.T if transpose else array
    return jnp.asarray(out)


def _set(tree: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def assemble_params(cfg: ModelConfig, source: TensorSource) -> dict:
    """The `{"params": ...}` tree of `LlamaModel(cfg)` from HF-named tensors, in `cfg.dtype`.

    Linear kernels become `[L, in, out]`, norms `[L, D]`; the LM head is read only when
    `cfg.tie_word_embeddings` is False. Raises CheckpointError on a missing tensor or a shape
    mismatch.
    """
    dtype = numpy_dtype(cfg.dtype)
    layers: dict = {}
    for key, out_in in linear_shapes(cfg).items():
        kernel = _stacked(source, cfg, f"{_LAYER_LINEARS[key]}.weight", out_in, True, dtype)
        _set(layers, (*key, "kernel"), kernel)
    for path, (suffix, size) in layer_vectors(cfg).items():
        _set(layers, path, _stacked(source, cfg, suffix, (size,), False, dtype))

    def single(name, shape):
        return _checked(source, name, shape).astype(dtype)

    vocab_hidden = (cfg.vocab_size, cfg.hidden_size)
    params = {
        "embed_tokens": {"embedding": jnp.asarray(single("model.embed_tokens.weight", vocab_hidden))},
        "layers": layers,
        "norm": {"scale": jnp.asarray(single("model.norm.weight", (cfg.hidden_size,)))},
    }
    if not cfg.tie_word_embeddings:
        params["lm_head"] = {"kernel": jnp.asarray(single("lm_head.weight", vocab_hidden).T)}
    return {"params": params}


def float_config(value) -> float:
    """A float from file metadata, rounded to the shortest decimal that its f32 value prints as.

    GGUF stores eps = 1e-5 as f32 (9.99999974e-06); this gives back 1e-05 (same f32 value).
    """
    return float(str(np.float32(value)))
