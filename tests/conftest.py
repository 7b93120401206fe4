"""Shared fixtures: tiny random Llama-family models (seconds to compile) and the real SmolLM2
(marked `real`). Shared helper functions live in tests/helpers.py."""
from __future__ import annotations

import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

import jax
import pytest

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
