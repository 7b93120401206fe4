"""Shared fixtures: tiny random Llama-family models (seconds to compile)."""
from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

import jax
import pytest

jax.config.update("jax_default_matmul_precision", "highest")

from specjax.models.config import ModelConfig  # noqa: E402
from specjax.models.llama import init_params  # noqa: E402


def load_benchmark(name: str):
    """A script of benchmarks/ (not a package) as a module."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_config(**overrides) -> ModelConfig:
    """A 2-layer GQA model, vocab 64, f32."""
    base = dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=8, rope_theta=10000.0, tie_word_embeddings=False,
        eos_token_ids=(1,), name="tiny",
    )
    base.update(overrides)
    return ModelConfig(**base)


@pytest.fixture(scope="session")
def tiny_model():
    cfg = tiny_config()
    params = init_params(cfg, jax.random.PRNGKey(0))
    return cfg, params


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drops jit caches after each test module: hundreds of compiled programs (the real model's
    among them) otherwise pile up in one process for the whole suite."""
    yield
    jax.clear_caches()
