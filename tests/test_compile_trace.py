"""benchmarks/compile_trace.py keeps working: it compiles a tiny model's decode programs under
the profiler and reads from the trace what XLA compiled."""
from __future__ import annotations

import types

import jax
import pytest
from helpers import load_benchmark, tiny_config
from jax._src import compilation_cache

from specjax.models.llama import init_params


def test_compile_trace_reads_what_xla_compiled(monkeypatch):
    trace = load_benchmark("compile_trace")
    cfg = tiny_config()
    model = types.SimpleNamespace(cfg=cfg, params=init_params(cfg, jax.random.PRNGKey(0)))
    cache_setting = jax.config.jax_enable_compilation_cache
    # as in a process (a test worker) that used the persistent cache before: jax memoizes that
    # decision, and the block must still compile instead of hitting the cache
    monkeypatch.setattr(compilation_cache, "_cache_checked", True)
    monkeypatch.setattr(compilation_cache, "_cache_used", True)
    xla_default = {"xla_cpu_use_fusion_emitters": True}  # each fusion compiled on its own
    with trace.bench.persistent_cache_off():
        assert not compilation_cache.is_cache_used(jax.devices()[0].client)
        ar, chain = (trace.traced_compile(model, trace.parse_program(spec, 1), "decode", xla_default)
                     for spec in ("ar", "ngram/chain4"))
        ours = trace.traced_compile(model, trace.parse_program("ar", 1), "decode")
    assert jax.config.jax_enable_compilation_cache == cache_setting
    assert (compilation_cache._cache_checked, compilation_cache._cache_used) == (True, True)
    for record in (ar, chain):
        assert record["stage"] == "decode" and record["compile_s"] > 0
        assert 0 < record["fusions compiled"] <= record["kernels"]
        assert record["fusion compile s (summed over threads)"] > 0
        assert record["module codegen (LLVM)"] > 0 and len(record["slowest fusions"]) <= 5
    # a speculative step holds the drafter, the verify and the acceptance besides a forward
    assert chain["fusions compiled"] > ar["fusions compiled"]
    assert (ar["program"], chain["program"]) == ("ar", "ngram chain4")
    # specjax's options: the same kernels, emitted into the one module (nothing compiled apart)
    assert ours["options"] == {} and ours["kernels"] == ar["kernels"]
    assert ours["fusions compiled"] == 0 and ours["module codegen (LLVM)"] > 0


def test_an_option_is_name_equals_value():
    trace = load_benchmark("compile_trace")
    assert trace.parse_option("xla_cpu_use_fusion_emitters=true") == (
        "xla_cpu_use_fusion_emitters", True)
    assert trace.parse_option("xla_backend_optimization_level=1") == (
        "xla_backend_optimization_level", 1)
    assert trace.parse_option("xla_cpu_scheduler_type=CPU_SCHEDULER_TYPE_DEFAULT")[1] == (
        "CPU_SCHEDULER_TYPE_DEFAULT")
    with pytest.raises(SystemExit, match="NAME=VALUE"):
        trace.parse_option("xla_cpu_use_fusion_emitters")
