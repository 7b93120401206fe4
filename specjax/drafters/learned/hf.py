"""Upstream Hugging Face folders of learned heads: read (import) and write (export).

A folder holds `config.json` and `*.safetensors` (PyTorch Linear weights are `[out, in]`;
ours are Flax kernels `[in, out]`). What the tensors are called and what config.json says is
the kind's `UpstreamLayout` (`HeadKind.upstream`; EAGLE-3: `eagle3.py`, DFlash: `dflash.py`).
The target's embedding and LM head are not part of either layout's draft weights we use
(EAGLE-3's optional `embed_tokens.weight` copy and `t2d` are ignored on import).
"""
from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util
from safetensors.numpy import load_file, save_file

from specjax.drafters.learned.kind import HeadKind, UpstreamLayout
from specjax.drafters.learned.registry import get_kind, init_head, kind_of, upstream_formats
from specjax.models.config import ModelConfig
from specjax.models.finite import check_finite


def layout(kind: HeadKind) -> UpstreamLayout:
    """The kind's upstream layout; a kind without one -> ValueError naming those that have one."""
    if kind.upstream is None:
        having = sorted(k.name for k in upstream_formats().values())
        raise ValueError(f"no upstream layout for {kind.name!r} ({', '.join(having)} have one)")
    return kind.upstream


def read_tensors(folder: Path) -> dict[str, np.ndarray]:
    """Every tensor of the folder's *.safetensors files."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder}: no *.safetensors file (PyTorch .bin checkpoints: convert first)")
    tensors: dict[str, np.ndarray] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors


def variables_from_tensors(head_cfg, tensors: dict[str, np.ndarray], where: str = "checkpoint"):
    """Head variables from upstream tensors; shapes are checked against a fresh init, values for
    NaN / Inf (a CheckpointError naming `where` and the tensor)."""
    kind = kind_of(head_cfg)
    reference = init_head(head_cfg, jax.random.PRNGKey(0))
    shapes = {path: value.shape for path, value in traverse_util.flatten_dict(reference["params"]).items()}
    dtype = head_cfg.layer.jnp_dtype
    params = {}
    for name, path, transpose in layout(kind).tensor_names(head_cfg):
        if name not in tensors:
            raise ValueError(f"{where}: missing tensor {name!r}")
        value = np.asarray(tensors[name], np.float32)
        check_finite(value, where, f"tensor {name!r}")
        value = value.T if transpose else value
        want = shapes[path]
        if value.shape != want:
            raise ValueError(f"{where}: {name} has shape {value.shape[::-1] if transpose else value.shape}, "
                             f"expected {want[::-1] if transpose else want}")
        params[path] = jnp.asarray(value, dtype)
    consts = {**reference.get("consts", {}), **layout(kind).consts_from_tensors(head_cfg, tensors)}
    return {"params": traverse_util.unflatten_dict(params), "consts": consts}


def tensors_from_variables(head_cfg, variables) -> dict[str, np.ndarray]:
    """The upstream tensors (f32, upstream names and orientation) of a head's variables."""
    upstream = layout(kind_of(head_cfg))
    flat = traverse_util.flatten_dict(variables["params"])
    tensors = {}
    for name, path, transpose in upstream.tensor_names(head_cfg):
        value = np.asarray(flat[path], np.float32)
        tensors[name] = np.ascontiguousarray(value.T if transpose else value)
    return {**tensors, **upstream.tensors_from_consts(head_cfg, variables)}


def load_upstream(kind: str, folder: str | Path, target: ModelConfig):
    """(head config, variables) of an upstream folder of `kind` for `target`."""
    folder = Path(folder)
    config_path = folder / "config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{config_path}: not a readable JSON config ({e})") from None
    vocab = int(config.get("vocab_size", target.vocab_size))
    if vocab != target.vocab_size:
        raise ValueError(f"{config_path}: the {kind} head has a vocabulary of {vocab}, the target "
                         f"{target.vocab_size}")
    head_cfg = layout(get_kind(kind)).config_from_hf(config, target)
    return head_cfg, variables_from_tensors(head_cfg, read_tensors(folder), str(folder))


def save_upstream(head_cfg, variables, folder: str | Path) -> Path:
    """Writes a head in its kind's upstream layout (config.json + model.safetensors)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors_from_variables(head_cfg, variables), str(folder / "model.safetensors"))
    config = layout(kind_of(head_cfg)).config_to_hf(head_cfg)
    (folder / "config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
    return folder
