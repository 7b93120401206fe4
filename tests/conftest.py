"""Shared fixtures: tiny random Llama-family models (seconds to compile) and the real SmolLM2
(marked `real`). Shared helper functions live in tests/helpers.py."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

# `python -m pytest` puts the checkout's root on sys.path, where the folders `kernels/` and
# `models/` (installed as specjax.kernels / specjax.models) would shadow top-level packages of
# those names: transformers >= 5 imports Hugging Face's `kernels` (the hf extra's tests).
_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or os.getcwd()).resolve() != _ROOT]

import jax  # noqa: E402 (after the sys.path cleanup above)
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from helpers import tiny_config  # noqa: E402

from specjax.models.llama import init_params  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model():
    cfg = tiny_config()
    params = init_params(cfg, jax.random.PRNGKey(0))
    return cfg, params


@pytest.fixture(scope="module")
def smollm2():
    """The real SmolLM2-135M (f32), loaded once per module that asks for it (tests marked real)."""
    from specjax.models.hub import load_model  # only the real-model tests pay for the import

    start = time.perf_counter()
    model = load_model("smollm2-135m", dtype="float32")
    print(f"\nload_model('smollm2-135m'): {time.perf_counter() - start:.2f} s")
    return model


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drops jit caches after each test module: hundreds of compiled programs (the real model's
    among them) otherwise pile up in one process for the whole suite."""
    yield
    jax.clear_caches()
