"""A job's batches: as many rows as their prompts' bucket (one prompt: a batch of 1), each
shape compiled once (two programs: prefill and decode), and each batch's compile, prefill and
decode seconds reported apart (`time_s` never includes compilation). These are static batches
(`refill=False`); tests/test_refill.py covers the refilling chunks."""
from __future__ import annotations

import jax
import pytest
from helpers import tiny_config

import specjax
from specjax import api
from specjax.api import BatchShape, batch_rows, job_shapes
from specjax.drafters.suffix import SuffixDrafter
from specjax.loop import (
    ar_finish_program,
    ar_start_program,
    spec_finish_program,
    spec_start_program,
)
from specjax.models.llama import init_params
from specjax.timing import JobStats, job_stats
from specjax.tree import chain

MIXED = [[3, 4, 5], list(range(2, 22)), [5, 6, 7, 8, 9], list(range(2, 42)), [7], [9, 8],
         list(range(3, 20)), list(range(2, 20)), [4]]  # lengths 3 20 5 40 1 2 17 18 1


@pytest.fixture(scope="module")
def fresh_model():
    """A model no other test compiled programs for (so the jit caches start empty for it)."""
    cfg = tiny_config(num_layers=1, name="tiny-fresh")
    return cfg, init_params(cfg, jax.random.PRNGKey(1))


def test_a_batch_runs_as_many_rows_as_its_prompts_bucket():
    assert [batch_rows(8, n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 8]
    assert [batch_rows(6, n) for n in (1, 3, 6)] == [1, 4, 6] and batch_rows(None, 9) == 16
    lengths = [len(p) for p in MIXED]
    assert [s.rows for s in job_shapes(lengths, 4, 16)] == [4, 4, 1]
    assert job_shapes(lengths[:3], 8, 16, chain(4))[0] == BatchShape(4, 24, 24 + 16 + 5)


def test_jobs_run_the_rows_they_need(tiny_model, monkeypatch):
    cfg, params = tiny_model
    rows = []
    run_batch = api.run_batch
    monkeypatch.setattr(api, "run_batch", lambda *a, **k: rows.append(k["batch_size"]) or run_batch(*a, **k))
    specjax.generate_ids(cfg, params, MIXED[:1], max_new_tokens=4, batch_size=8, refill=False)
    specjax.generate_ids(cfg, params, MIXED[:3], max_new_tokens=4, refill=False)
    specjax.generate_ids(cfg, params, MIXED, max_new_tokens=4, batch_size=4, refill=False)
    assert rows == [1, 4, 4, 4, 1]


def program_sizes(*programs) -> list[int]:
    return [program._cache_size() for program in programs]


def test_a_mixed_length_job_compiles_each_shape_once(fresh_model):
    cfg, params = fresh_model
    lengths = [len(p) for p in MIXED]
    shapes = set(job_shapes(lengths, 2, 12))
    assert len(shapes) < len(job_shapes(lengths, 2, 12)) == 5  # some batches share a shape
    programs = (ar_start_program, ar_finish_program)
    before = program_sizes(*programs)
    job = lambda: specjax.generate_ids(cfg, params, MIXED, max_new_tokens=12, batch_size=2, eos_ids=(),
                                      refill=False)
    job()
    assert program_sizes(*programs) == [n + len(shapes) for n in before]
    again = job()  # the same shapes: nothing compiles, so the compile time is the lookups'
    assert program_sizes(*programs) == [n + len(shapes) for n in before]
    assert job_stats(again).compile_s < 0.5


def test_a_carried_drafter_state_does_not_compile_again(fresh_model):
    cfg, params = fresh_model
    drafter = SuffixDrafter(tree=chain(2))  # carries its table from batch to batch
    programs = (spec_start_program, spec_finish_program)
    before = program_sizes(*programs)
    specjax.generate_ids(cfg, params, [[3, 4, 5, 3, 4], [5, 6, 5, 6], [7, 8, 7], [4, 4, 4]],
                         max_new_tokens=6, batch_size=2, eos_ids=(), draft=drafter,
                         refill=False)
    assert program_sizes(*programs) == [n + 1 for n in before]  # two batches, one shape


def test_each_batch_reports_compile_prefill_and_decode_apart(tiny_model):
    cfg, params = tiny_model
    prompts = [[3, 4, 5, 6], [7, 8], list(range(2, 60))]
    run = lambda: specjax.generate_ids(cfg, params, prompts, max_new_tokens=9, batch_size=2,
                                       eos_ids=(), draft="ngram", refill=False)
    first, second = run(), run()
    for results in (first, second):
        assert [r.times.batch for r in results] == [0, 0, 1]
        assert results[0].times is results[1].times  # rows of a batch share their batch's
        assert all(r.time_s == r.times.prefill_s + r.times.decode_s for r in results)
        assert all(r.times.prefill_s > 0 and r.times.decode_s > 0 for r in results)
    stats = job_stats(first)
    assert stats.new_tokens == 27
    assert stats.compile_s == first[0].times.compile_s + first[2].times.compile_s
    assert job_stats(second).compile_s < 0.2 * stats.compile_s  # built already: lookups only


def test_the_job_line():
    stats = JobStats(65, 24.1, 0.2, 1.7) + JobStats()
    assert stats.line() == ("compiled in 24.1 s; 65 tokens in 1.90 s (34.2 tokens/s; prefill "
                            "0.20 s, decode 1.70 s)")
    assert JobStats().tokens_per_s == 0.0
