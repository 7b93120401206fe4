"""benchmarks/compile_time.py keeps working: its core compiles AR and speculative programs of a
tiny model through the AOT path, with sizes, and leaves JAX's persistent cache setting alone."""
from __future__ import annotations

import types

import jax
import pytest
from helpers import load_benchmark, tiny_config

from specjax.models.llama import init_params


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("compile_time")


def test_compile_time_core_on_a_tiny_model(bench):
    cfg = tiny_config()
    model = types.SimpleNamespace(cfg=cfg, params=init_params(cfg, jax.random.PRNGKey(0)))
    progs = bench.programs([1], ["ngram", "medusa"], ["chain4"])
    assert [p.label for p in progs] == ["ar", "ngram chain4", "medusa chain4"]
    cache_setting = jax.config.jax_enable_compilation_cache
    lines = []
    records = bench.run(model, progs, prompt_width=8, max_new=8, log=lines.append)
    assert jax.config.jax_enable_compilation_cache == cache_setting
    # every speculative compile sits between two AR compiles of its batch (its ratio to AR)
    assert [p.label for p in bench.timeline(progs, 1)] == [
        "ar", "ngram chain4", "ar", "medusa chain4", "ar"]
    assert len(lines) == 5
    assert [r["draft"] for r in records] == ["ar", "ngram", "medusa"]
    for r in records:  # the prefill and the decode program of each
        assert len(r["stages"]) == 2 and r["lower_s"] > 0 and r["compile_s"] > 0
        assert r["hlo_ops"] > 0 and r["kernels"] > 0 and r["while_ops"] >= 1
    assert records[0]["x_ar"] == 1.0
    assert all(r["x_ar"] > 0 for r in records)
    table = bench.table(records)
    assert table.count("\n") == len(records) + 1 and "| 1 | medusa | chain4 |" in table


def test_greedy_programs_carry_no_sampling_code(bench):
    """SamplingParams.make(0) is static greedy: no sort (top-k / top-p) is compiled; a sampling
    program has them."""
    cfg = tiny_config()
    model = types.SimpleNamespace(cfg=cfg, params=init_params(cfg, jax.random.PRNGKey(0)))
    sorts = {}
    for temperature in (0.0, 0.7):
        stages = bench.program_call(model, bench.Program(1), prompt_width=8, max_new=8,
                                    temperature=temperature, fused=True)
        fn, args, kwargs = stages[0]
        sorts[temperature] = fn.lower(*args, **kwargs).as_text().count("stablehlo.sort")
    assert sorts[0.0] == 0 and sorts[0.7] > 0


def test_auto_program_holds_every_branch(bench):
    """`--trees auto` compiles num_draft="auto"'s program: one while loop per branch (the plain
    step and each chain) on top of what the chain-4 program holds."""
    cfg = tiny_config()
    model = types.SimpleNamespace(cfg=cfg, params=init_params(cfg, jax.random.PRNGKey(0)))
    measure = bench.Measurer(model, prompt_width=8, max_new=8)
    chain4, auto = (measure(bench.Program(1, "ngram", tree)) for tree in ("chain4", bench.AUTO))
    drafter, _ = bench.build_auto("ngram", model, None)
    assert drafter.lengths == (0, 1, 2, 4, 8)
    assert auto["stages"][1]["kernels"] > chain4["stages"][1]["kernels"]
    assert auto["while_ops"] >= chain4["while_ops"] + len(drafter.lengths) - 1
