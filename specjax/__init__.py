"""specjax: speculative decoding in JAX.

    import specjax
    model = specjax.load("smollm2-135m")                  # dtype "auto": bf16 on GPU/TPU, f32 on CPU
    out = specjax.generate(model, ["Write a haiku about tiles."], draft="ngram", num_draft=4)
    print(out[0].completion)

Prompts may be strings, chats (lists of {"role", "content"} messages) or token ids; sampling
options come loose or as one `GenerationConfig`; `generate_ids` runs any target model
(`TargetModel`) on token ids.
"""
__version__ = "0.1.0"

from specjax.api import (
    Generation,
    PromptError,
    TokenResult,
    generate,
    generate_ids,
    iter_generate,
    iter_generate_ids,
)
from specjax.drafters.registry import available_drafters
from specjax.models.hub import LoadedModel, load_model
from specjax.options import GenerationConfig
from specjax.target import TargetModel

__all__ = [
    "Generation", "GenerationConfig", "LoadedModel", "PromptError", "TargetModel", "TokenResult",
    "available_drafters", "generate", "generate_ids", "iter_generate", "iter_generate_ids", "load",
]


def load(name_or_path: str, dtype: str = "auto", quantize: str | None = None) -> LoadedModel:
    """Loads a model preset name (e.g. "smollm2-135m"), a .gguf file or a Hugging Face folder,
    with its tokenizer. dtype: "auto" (bfloat16 on GPU / TPU, float32 on CPU), "float32",
    "bfloat16" or "float16". quantize: None, "int8", "int4" or "fp8" (weight-only, qwix; the
    decoder layers' kernels, docs/quantization.md)."""
    return load_model(name_or_path, dtype=dtype, quantize=quantize)
