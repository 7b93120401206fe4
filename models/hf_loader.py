"""Hugging Face checkpoints: config.json + model.safetensors (or shards + index), numpy loading.

    cfg, params = load_hf("path/to/Qwen2.5-0.5B-Instruct", dtype="bfloat16")

Architectures: LlamaForCausalLM (incl. "llama3" rope scaling), MistralForCausalLM,
Qwen2ForCausalLM (q/k/v bias), Qwen3ForCausalLM (q/k RMSNorm). Tensors keep their checkpoint
names and layouts, so `assemble_params` reads them directly.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open

from specjax.models.checkpoint import (
    CheckpointError,
    ShardingsFor,
    TensorSource,
    assemble_params,
    float_config,
)
from specjax.models.config import ModelConfig, RopeScaling

# architecture -> (attention_bias on q/k/v, qk_norm)
ARCHITECTURES = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
}
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def read_config(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    if not path.exists():
        raise CheckpointError(directory, "missing config.json")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise CheckpointError(path, f"invalid JSON: {e}") from None


def _rope_scaling(config: dict[str, Any], path: Path) -> RopeScaling | None:
    """llama3 scaling from `rope_scaling` (transformers 4) or `rope_parameters` (transformers 5)."""
    spec = config.get("rope_scaling") or config.get("rope_parameters") or {}
    kind = spec.get("rope_type", spec.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise CheckpointError(path, f"RoPE scaling {kind!r} is not supported (only 'llama3')")
    return RopeScaling(
        factor=float(spec["factor"]),
        low_freq_factor=float(spec["low_freq_factor"]),
        high_freq_factor=float(spec["high_freq_factor"]),
        original_max_position_embeddings=int(spec["original_max_position_embeddings"]),
    )


def _first_id(value) -> int | None:
    if isinstance(value, list):
        return int(value[0]) if value else None
    return None if value is None else int(value)


def config_from_hf(config: dict[str, Any], path: Path, dtype: str = "float32") -> ModelConfig:
    """ModelConfig from a parsed config.json (path names the file in errors)."""
    archs = config.get("architectures") or [config.get("model_type", "?")]
    arch = archs[0]
    if arch not in ARCHITECTURES:
        raise CheckpointError(
            path, f"unsupported architecture {arch!r} (supported: {', '.join(ARCHITECTURES)})"
        )
    bias, qk_norm = ARCHITECTURES[arch]
    if arch == "LlamaForCausalLM" and (config.get("attention_bias") or config.get("mlp_bias")):
        raise CheckpointError(
            path, "Llama attention_bias / mlp_bias (o_proj / MLP biases) are not supported"
        )
    if config.get("sliding_window") and config.get(
        "use_sliding_window", arch == "MistralForCausalLM"
    ):
        warnings.warn(f"{path}: sliding-window attention is ignored (full attention)", stacklevel=2)
    try:
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        eos = config.get("eos_token_id")
        rope_params = config.get("rope_parameters") or {}
        return ModelConfig(
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            rope_theta=float_config(
                config.get("rope_theta", rope_params.get("rope_theta", 10000.0))
            ),
            rope_scaling=_rope_scaling(config, path),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bias,
            qk_norm=qk_norm,
            max_position_embeddings=int(config.get("max_position_embeddings", 8192)),
            dtype=dtype,
            bos_token_id=_first_id(config.get("bos_token_id")),
            eos_token_ids=tuple(
                int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None
            ),
            pad_token_id=_first_id(config.get("pad_token_id")) or 0,
            name=str(config.get("_name_or_path") or config.get("model_type") or arch),
        )
    except KeyError as e:
        raise CheckpointError(path, f"config.json lacks {e.args[0]!r}") from None


def _weight_map(directory: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, from the shard index or the single file's header."""
    index = directory / INDEX_FILE
    if index.exists():
        try:
            mapping = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (ValueError, KeyError) as e:
            raise CheckpointError(index, f"invalid shard index: {e}") from None
        files = {name: directory / shard for name, shard in mapping.items()}
        for shard in sorted(set(files.values())):
            if not shard.exists():
                raise CheckpointError(index, f"shard {shard.name} listed in the index is missing")
        return files
    single = directory / SINGLE_FILE
    if not single.exists():
        raise CheckpointError(directory, f"no {SINGLE_FILE} or {INDEX_FILE}")
    with _open(single) as f:
        return dict.fromkeys(f.keys(), single)


def _open(path: Path):
    try:
        return safe_open(str(path), framework="numpy")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(
            path, f"unreadable safetensors file (truncated or corrupt?): {e}"
        ) from None


def _ignorable(tied: bool):
    """Tensors an HF folder may hold that the model need not read."""

    def ignorable(name: str) -> bool:
        return name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight")

    return ignorable


def hf_source(directory: Path, tied: bool = False) -> TensorSource:
    """Tensors of an HF folder by name; shards are opened once, on first use."""
    weight_map = _weight_map(directory)
    handles: dict[Path, Any] = {}

    def fetch(name: str) -> np.ndarray | None:
        file = weight_map.get(name)
        if file is None:
            return None
        if file not in handles:
            handles[file] = _open(file)
        try:
            return handles[file].get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(
                file, f"cannot read tensor {name!r} (truncated or corrupt?): {e}"
            ) from None

    return TensorSource(
        str(directory), fetch, available=frozenset(weight_map), ignorable=_ignorable(tied)
    )


def load_hf(directory: str | os.PathLike, dtype: str = "float32",
            shardings: ShardingsFor | None = None) -> tuple[ModelConfig, dict]:
    """(ModelConfig, params) of a Hugging Face folder; raises CheckpointError naming the file.
    shardings: see `assemble_params` (None: one device)."""
    root = Path(directory)
    if not root.is_dir():
        raise CheckpointError(root, "not a directory")
    cfg = config_from_hf(read_config(root), root / "config.json", dtype)
    return cfg, assemble_params(cfg, hf_source(root, cfg.tie_word_embeddings), shardings)
