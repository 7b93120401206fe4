"""GGUF checkpoints (llama.cpp): config from metadata, dequantized params in the HF layout.

    cfg, params = load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", dtype="float32")

Supports the architectures `llama` (also Mistral files, which llama.cpp writes as llama),
`qwen2` (q/k/v bias) and `qwen3` (q/k RMSNorm); tensor types F32, F16, BF16 and every block
quantization `gguf.quants.dequantize` knows (Q8_0, Q4_0, Q4_1, Q5_x, the K-quants, ...).
With `quantize="int8"` / `"int4"`, Q8_0 / Q4_0 layer kernels are read as qwix QArrays straight
from their blocks (`gguf_reader.block_values`, docs/quantization.md).

The header reader lives in `gguf_reader` (shared with the tokenizer).

llama.cpp permutes the rows of `attn_q` / `attn_k` of llama-arch files so its interleaved RoPE
(pairs (2i, 2i+1)) matches Hugging Face's rotate-half RoPE (pairs (i, i + Dh/2));
`unpermute_qk` undoes it. Qwen files are written unpermuted (llama.cpp runs NEOX RoPE on them).
"""

from __future__ import annotations

import os
import re

import numpy as np

from specjax.models.checkpoint import (
    CheckpointError,
    ShardingsFor,
    TensorSource,
    assemble_params,
    float_config,
)
from specjax.models.config import ModelConfig, RopeScaling
from specjax.models.gguf_reader import GGUFFile, read_gguf
from specjax.models.llama import rope_inv_freq
from specjax.models.tokenizer import end_token_ids

# architecture -> whether llama.cpp permuted the q/k rows
ARCHITECTURES = {"llama": True, "qwen2": False, "qwen3": False}


# ---------------------------------------------------------------------------------------------
# Names, q/k permutation
# ---------------------------------------------------------------------------------------------

_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_IGNORABLE = frozenset({"rope_freqs.weight"})  # read into the config (llama3 RoPE scaling)
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")


def gguf_tensor_name(hf_name: str) -> str:
    """llama.cpp's name of an HF tensor.

    `model.layers.0.mlp.up_proj.weight` -> `blk.0.ffn_up.weight`.
    """
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    match = _LAYER_RE.fullmatch(hf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise KeyError(f"no GGUF name for tensor {hf_name!r}")
    layer, module, kind = match.groups()
    return f"blk.{layer}.{_LAYER_NAMES[module]}.{kind}"


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF rotate-half rows -> llama.cpp interleaved rows; w `[n_head * Dh, ...]` (weight, bias)."""
    rest = w.shape[1:]
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *rest).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of `permute_qk`: llama.cpp rows `[n_head * Dh, ...]` -> HF rotate-half rows."""
    rest = w.shape[1:]
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def gguf_source(file: GGUFFile, cfg: ModelConfig, permuted: bool) -> TensorSource:
    """HF-named, HF-layout view of the file's tensors (dequantized, q/k rows un-permuted)."""
    heads = {"self_attn.q_proj": cfg.num_heads, "self_attn.k_proj": cfg.num_kv_heads}

    def hf_rows(hf_name: str, name: str, array: np.ndarray) -> np.ndarray:
        """`array` (rows of tensor `name`: values, or their block scales) in HF row order."""
        match = _LAYER_RE.fullmatch(hf_name)
        if permuted and match is not None and match.group(2) in heads:
            n_head = heads[match.group(2)]
            if array.shape[0] % (2 * n_head):
                raise CheckpointError(
                    file.path,
                    f"tensor {name!r} has {array.shape[0]} rows, not a multiple of "
                    f"2 x {n_head} heads",
                )
            array = unpermute_qk(array, n_head)
        return array

    def fetch(hf_name: str) -> np.ndarray | None:
        name = gguf_tensor_name(hf_name)
        if name not in file.tensors:
            return None
        return hf_rows(hf_name, name, file.read(name))

    def fetch_blocks(hf_name: str, mode: str) -> tuple[np.ndarray, np.ndarray] | None:
        name = gguf_tensor_name(hf_name)
        blocks = file.read_blocks(name, mode) if name in file.tensors else None
        if blocks is None:
            return None
        return tuple(hf_rows(hf_name, name, part) for part in blocks)

    return TensorSource(
        file.path, fetch, gguf_tensor_name, frozenset(file.tensors), _IGNORABLE.__contains__,
        fetch_blocks,
    )


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------


def _uniform_int(file: GGUFFile, key: str, default=None) -> int:
    value = file.get(key, default)
    if value is None:
        raise CheckpointError(file.path, f"missing metadata {key!r}")
    if isinstance(value, np.ndarray):  # per-layer values (e.g. head counts of hybrid models)
        if value.size == 0 or (value != value.flat[0]).any():
            raise CheckpointError(
                file.path, f"per-layer {key!r} = {value.tolist()} is not supported"
            )
        value = value.flat[0]
    return int(value)


def _llama3_scaling(file: GGUFFile, head_dim: int, theta: float) -> RopeScaling | None:
    """Llama-3 RoPE scaling from llama.cpp's `rope_freqs.weight` (per-frequency divisors)."""

    def divisors(scaling):  # [Dh/2] base / scaled inverse frequencies
        base = np.asarray(rope_inv_freq(head_dim, theta, None), np.float64)
        return base / np.asarray(rope_inv_freq(head_dim, theta, scaling), np.float64)

    factors = file.read("rope_freqs.weight").astype(np.float64)
    if factors.shape == (head_dim // 2,):
        if np.allclose(factors, 1.0):
            return None
        # 1 / divisor_i = a_i / factor + (1 - a_i), a_i in [0, 1] fixed by the band of frequency i;
        # read a_i off a probe factor of 2, then solve for the factor where a_i is largest.
        weight = 2.0 * (1.0 - 1.0 / divisors(RopeScaling(factor=2.0)))
        i = int(np.argmax(weight))
        factor = weight[i] / (1.0 / factors[i] - 1.0 + weight[i])
        scaling = RopeScaling(factor=float(f"{factor:.5g}"))  # f32 noise off: 8.000002 -> 8
        if np.allclose(factors, divisors(scaling), rtol=1e-4):
            return scaling
    raise CheckpointError(
        file.path,
        "rope_freqs.weight does not match Llama-3 RoPE scaling "
        "(low_freq_factor 1, high_freq_factor 4, original context 8192): unsupported",
    )


def _rope_scaling(file: GGUFFile, arch: str, head_dim: int, theta: float) -> RopeScaling | None:
    kind = file.get(f"{arch}.rope.scaling.type", "none")
    factor = float(file.get(f"{arch}.rope.scaling.factor", 1.0))
    if kind not in ("none", "linear") or (kind == "linear" and factor != 1.0):
        raise CheckpointError(
            file.path, f"RoPE scaling {kind!r} (factor {factor}) is not supported"
        )
    if "rope_freqs.weight" in file.tensors:
        return _llama3_scaling(file, head_dim, theta)
    return None


def config_from_gguf(file: GGUFFile, dtype: str = "float32") -> ModelConfig:
    """ModelConfig from a GGUF's metadata (shapes, RoPE, eps, special token ids)."""
    arch = file.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(
            file.path, f"unsupported architecture {arch!r} (supported: {', '.join(ARCHITECTURES)})"
        )
    if "token_embd.weight" not in file.tensors:
        raise CheckpointError(file.path, "missing tensor 'token_embd.weight'")
    hidden = _uniform_int(file, f"{arch}.embedding_length")
    heads = _uniform_int(file, f"{arch}.attention.head_count")
    head_dim = _uniform_int(file, f"{arch}.attention.key_length", hidden // heads)
    rope_dims = _uniform_int(file, f"{arch}.rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise CheckpointError(
            file.path, f"partial RoPE ({rope_dims} of {head_dim} dims) is not supported"
        )
    theta = float_config(file.get(f"{arch}.rope.freq_base", 10000.0))
    tokens = file.get("tokenizer.ggml.tokens") or []
    declared = [file.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    return ModelConfig(
        vocab_size=file.tensors["token_embd.weight"].shape[0],
        hidden_size=hidden,
        intermediate_size=_uniform_int(file, f"{arch}.feed_forward_length"),
        num_layers=_uniform_int(file, f"{arch}.block_count"),
        num_heads=heads,
        num_kv_heads=_uniform_int(file, f"{arch}.attention.head_count_kv", heads),
        head_dim=head_dim,
        rope_theta=theta,
        rope_scaling=_rope_scaling(file, arch, head_dim, theta),
        rms_norm_eps=float_config(file.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings="output.weight" not in file.tensors,
        attention_bias="blk.0.attn_q.bias" in file.tensors,
        qk_norm="blk.0.attn_q_norm.weight" in file.tensors,
        max_position_embeddings=_uniform_int(file, f"{arch}.context_length", 8192),
        dtype=dtype,
        bos_token_id=file.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=end_token_ids(tokens, declared),
        pad_token_id=int(file.get("tokenizer.ggml.padding_token_id", 0)),
        name=str(file.get("general.name", arch)),
    )


def params_from_gguf(file: GGUFFile, cfg: ModelConfig,
                     shardings: ShardingsFor | None = None, quantize: str | None = None) -> dict:
    """The params tree (see `assemble_params`, its `shardings` and `quantize`: Q8_0 / Q4_0
    kernels straight to int8 / int4 QArrays) from an opened GGUF and its config."""
    permuted = ARCHITECTURES[file.get("general.architecture")]
    return assemble_params(cfg, gguf_source(file, cfg, permuted), shardings, quantize)


def load_gguf(path: str | os.PathLike, dtype: str = "float32",
              shardings: ShardingsFor | None = None,
              quantize: str | None = None) -> tuple[ModelConfig, dict]:
    """(ModelConfig, params) of a GGUF checkpoint; raises CheckpointError naming the file.
    shardings: see `assemble_params` (None: one device); quantize: the kernels stored in the
    mode's exact block type as QArrays (the others still floats: `quant.quantize_params`)."""
    file = read_gguf(path)
    cfg = config_from_gguf(file, dtype)
    return cfg, params_from_gguf(file, cfg, shardings, quantize)
