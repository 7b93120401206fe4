"""Loading checkpoints: one entry point for GGUF files and Hugging Face folders.

    cfg, params = load_checkpoint("model.gguf")           # or an HF folder
    cfg, params = load_gguf(path, dtype="bfloat16")
    cfg, params = load_hf(folder, dtype="float32")

`params` is the `{"params": ...}` tree of `specjax.models.llama` (jnp arrays in `cfg.dtype`).
Every failure is a `CheckpointError` (a ValueError) whose message starts with the file's path.
For preset names ("smollm2-135m") and a tokenizer alongside: `specjax.models.hub.load_model`.
"""

from __future__ import annotations

import os
from pathlib import Path

from specjax.models.checkpoint import CheckpointError, ShardingsFor, TensorSource, assemble_params
from specjax.models.config import ModelConfig
from specjax.models.gguf_loader import load_gguf, permute_qk, unpermute_qk
from specjax.models.hf_loader import load_hf
from specjax.models.quant import check_quantize, quantize_params

__all__ = [
    "CheckpointError",
    "TensorSource",
    "assemble_params",
    "load_checkpoint",
    "load_gguf",
    "load_hf",
    "permute_qk",
    "unpermute_qk",
]


def load_checkpoint(path: str | os.PathLike, dtype: str = "float32",
                    shardings: ShardingsFor | None = None,
                    quantize: str | None = None) -> tuple[ModelConfig, dict]:
    """(ModelConfig, params) of a `.gguf` file or a Hugging Face folder. shardings: None (one
    device), or the config -> Sharding tree function of `assemble_params`
    (`specjax.sharding.loader_shardings(mesh)`): each leaf goes straight into its shards.
    quantize: None or a `models.quant` mode ("int8", "int4", "fp8"): the layer kernels as
    qwix QArrays."""
    check_quantize(quantize)
    path = Path(path)
    if path.is_dir():
        cfg, params = load_hf(path, dtype, shardings)
    elif path.is_file():
        cfg, params = load_gguf(path, dtype, shardings, quantize)
    else:
        raise CheckpointError(path, "no such file or directory")
    return cfg, quantize_params(params, quantize)
