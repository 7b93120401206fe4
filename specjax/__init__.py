"""specjax: speculative decoding in JAX.

    import specjax
    model = specjax.load("smollm2-135m")
    out = specjax.generate(model, ["Write a haiku about tiles."], max_new_tokens=64)
"""
__version__ = "0.1.0"

from specjax.api import Generation, PromptError, generate, generate_ids, iter_generate  # noqa: E402,F401


def load(name_or_path: str, dtype: str = "float32"):
    """Loads a model preset name (e.g. "smollm2-135m"), a .gguf file or a Hugging Face folder."""
    from specjax.models.hub import load_model

    return load_model(name_or_path, dtype=dtype)
