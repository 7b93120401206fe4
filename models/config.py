"""Static configuration of a Llama-family decoder (frozen, hashable: safe as a jit static arg)."""
from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

AttentionImpl = Literal["auto", "pallas", "pallas_tpu", "cpu", "xla"]  # kernels/dispatch.py
DTYPES = ("float32", "bfloat16", "float16")
#: backends where "auto" means bfloat16 (fast matmuls in bf16, f32 accumulation)
BF16_BACKENDS = ("gpu", "cuda", "rocm", "tpu")


def resolve_dtype(dtype: str) -> str:
    """A params dtype from `dtype`: "auto" = bfloat16 on GPU / TPU, float32 on CPU; "float32",
    "bfloat16", "float16" as they are (ValueError for anything else)."""
    if dtype == "auto":
        return "bfloat16" if jax.default_backend() in BF16_BACKENDS else "float32"
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}: use auto, float32, bfloat16 or float16")
    return dtype


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency-dependent RoPE scaling ("rope_type": "llama3")."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder.

    Covers Llama 2/3 (incl. llama3 RoPE scaling), Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k
    RMSNorm) and SmolLM2. `dtype` is the dtype of params and activations; softmax, norms and
    logits are always computed in f32.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q, k, v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    max_position_embeddings: int = 8192
    dtype: str = "float32"
    attention_impl: AttentionImpl = "auto"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0
    name: str = "llama"

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {self.dtype!r}: use float32, bfloat16 or float16")
        if self.attention_impl not in ("auto", "pallas", "pallas_tpu", "cpu", "xla"):
            raise ValueError(
                f"attention_impl must be auto, pallas, pallas_tpu, cpu or xla, not {self.attention_impl!r}"
            )

    @property
    def group_size(self) -> int:
        """G: query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    @property
    def jnp_dtype(self):
        return jnp.dtype(self.dtype)

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)
