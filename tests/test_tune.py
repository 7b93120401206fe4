"""specjax tune: the throughput model, analytic starting points, schedules, the profiler."""
from __future__ import annotations

import dataclasses

import pytest

from specjax.drafters.ngram import NgramDrafter
from specjax.measure.profile import LatencyProfile, shape_config, target_latency
from specjax.measure.tune import (
    Calibration,
    batch_steps,
    chain_tokens_per_step,
    draft_grid,
    gemm_ridge_rows,
    knee,
    memory_bound_draft,
    predict,
    predictions,
    throughput,
    tile_draft_lengths,
)
from specjax.schedule import DraftShape, Schedule, ScheduleEntry, load_schedule, scheduled
from specjax.tree import chain, load_tree

# ---- throughput model --------------------------------------------------------------------------


def test_throughput_formula():
    # E = 3 tokens/step, B = 4, T_target(4, 1 + D) = 20 ms, T_draft = 5 ms -> 480 tokens/s
    assert throughput(3.0, 4, 0.020, 0.005) == pytest.approx(480.0)
    assert chain_tokens_per_step([0.8, 0.6, 0.3], 2) == pytest.approx(2.4)
    assert chain_tokens_per_step([0.8, 0.6, 0.3], 5) == pytest.approx(2.7)


def test_batch_utilisation_hand_computed():
    # rows emit 11, 21, 5 tokens at 2, 2, 1 tokens/step -> 5, 10, 4 decode steps
    tokens, tps = [11, 21, 5], [2.0, 2.0, 1.0]
    assert batch_steps(tokens, tps, 2) == (19.0, 14.0)  # batches {5, 10} and {4}
    p = predict(tokens, tps, 2, step_s=0.01)
    assert p["tokens_per_step"] == pytest.approx(34 / 19)
    assert p["utilization"] == pytest.approx(19 / 28)
    assert p["tokens_per_s"] == pytest.approx(34 / (14 * 0.01))
    # the same number through the formula with utilisation folded in
    assert p["tokens_per_s"] == pytest.approx(throughput(p["tokens_per_step"], 2 * p["utilization"], 0.008, 0.002))
    solo = predict(tokens, tps, 1, step_s=0.01)
    assert solo["utilization"] == pytest.approx(1.0)


def _profile():
    prof = LatencyProfile(model="m", device={"device_kind": "cpu"}, context=64)
    prof.target = {1: {1: 0.010, 2: 0.0105, 3: 0.011, 5: 0.012, 9: 0.030}}
    prof.ar_step = {1: 0.011}
    prof.draft = {1: {"1": 0.001, "2": 0.001, "4": 0.001, "8": 0.001}}
    prof.step = {1: {"1": 0.0125, "2": 0.013, "4": 0.014, "8": 0.033}}
    return prof


def test_predictions_rank_candidates():
    cal = Calibration(row_tokens=[65, 65], row_joint=[[0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2]] * 2,
                      spec_rows=[])
    preds = predictions(cal, _profile(), [DraftShape(d) for d in (1, 2, 4, 8)], 1)
    by_label = {p["label"]: p for p in preds}
    e4 = 1 + 0.9 + 0.8 + 0.7 + 0.6
    assert by_label["4"]["tokens_per_step"] == pytest.approx(e4)
    assert by_label["4"]["predicted_tps"] == pytest.approx(throughput(e4, 1, 0.012, 0.001))
    assert by_label["4"]["predicted_tps_step"] == pytest.approx(e4 / 0.014)
    assert by_label["0"]["predicted_tps_step"] == pytest.approx(1 / 0.011)
    assert preds[0]["label"] == "4"  # D = 8 pays 30 ms per step
    assert [p["rank_tps"] for p in preds] == sorted((p["rank_tps"] for p in preds), reverse=True)


def test_latency_profile_round_trip_interpolation_and_knee():
    prof = _profile()
    again = LatencyProfile.from_dict(prof.to_dict())
    assert again == prof
    assert prof.target_at(1, 4) == pytest.approx(0.0115)
    assert prof.target_at(1, 100) == pytest.approx(0.030)
    assert knee(prof, 1) == 2  # T = 3 is 10 % above T = 1, T = 5 20 %
    assert knee(prof, 1, tolerance=0.25) == 4


def test_latency_profiles_merge_by_batch_size():
    prof = _profile()
    other = dataclasses.replace(prof, target={4: {1: 0.02}}, ar_step={4: 0.021}, draft={4: {}}, step={4: {}})
    both = prof.merged(other)
    assert set(both.target) == {1, 4} and both.target[1] == prof.target[1]
    assert both.ar_step[4] == 0.021 and both.target_at(4, 3) == pytest.approx(0.02)
    assert LatencyProfile.from_dict(both.to_dict()) == both


def test_tune_config_needs_batch_sizes():
    from specjax.measure.tune import TuneConfig

    with pytest.raises(ValueError, match="batch sizes"):
        TuneConfig(batch_sizes=())


# ---- analytic starting points ------------------------------------------------------------------


def test_tile_draft_lengths():
    assert tile_draft_lengths(4, 40) == {"tile": 31, "aligned": [31]}
    assert tile_draft_lengths(8, 40) == {"tile": 15, "aligned": [15, 31]}
    assert tile_draft_lengths(3, 64) == {"tile": 41, "aligned": []}  # 3(1+D) % 128 needs D = 127


def test_gemm_ridge_rows_is_the_crossing():
    k, n, ridge, size = 4096, 14336, 200.0, 2
    m = gemm_ridge_rows(k, n, ridge, size)
    intensity = lambda m: 2 * m * k * n / (size * (k * n + m * k + m * n))
    assert intensity(m) >= ridge > intensity(m - 1)
    assert gemm_ridge_rows(8, 8, 1e6, 4) > 1e8  # never compute-bound
    cfg = shape_config("llama3-8b", 2, dtype="bfloat16")
    assert memory_bound_draft(cfg, 16, ridge)["num_draft"] == -(-m // 16) - 1


def test_draft_grid():
    assert draft_grid(32) == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 20, 24, 32]
    assert draft_grid(6) == [1, 2, 3, 4, 5, 6]
    assert draft_grid(13) == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 13]


# ---- schedules ----------------------------------------------------------------------------------


def test_schedule_file_round_trip(tmp_path):
    sched = Schedule(
        (ScheduleEntry(16, DraftShape(tree="kary_2x2x2")),
         ScheduleEntry(1, DraftShape(6), extra={"predicted_tokens_per_s": 12.5}),
         ScheduleEntry(64, DraftShape(0))),
        model="smollm2-135m", draft="ngram", device="cpu",
    )
    path = tmp_path / "tuned" / "s.yaml"
    sched.save(path, header="written by a test\nsecond line")
    text = path.read_text()
    assert text.startswith("# written by a test\n# second line\n")
    again = load_schedule(path)
    assert again == sched and again.to_dict() == sched.to_dict()
    assert again.entries[0].extra == {"predicted_tokens_per_s": 12.5}
    assert [e.batch_size for e in again.entries] == [1, 16, 64]
    assert again.pick(1).num_draft == 6
    assert again.pick(4).tree == "kary_2x2x2"  # smallest entry >= 4
    assert again.pick(64).num_draft == 0 and again.pick(500).num_draft == 0


def test_schedule_errors(tmp_path):
    with pytest.raises(ValueError, match="version"):
        load_schedule({"version": 9, "buckets": []})
    with pytest.raises(ValueError, match="not both"):
        DraftShape(num_draft=3, tree="chain4")
    with pytest.raises(ValueError, match="duplicate"):
        Schedule((ScheduleEntry(4, DraftShape(1)), ScheduleEntry(4, DraftShape(2))))
    with pytest.raises(ValueError, match="cannot read"):
        load_schedule(tmp_path / "missing.yaml")


def test_scheduled_drafter_follows_the_entry():
    sched = Schedule((ScheduleEntry(2, DraftShape(3)), ScheduleEntry(8, DraftShape(tree="kary_2x2x2")),
                      ScheduleEntry(32, DraftShape(0))))
    base = NgramDrafter(tree=chain(4), n_max=2)
    d, p = scheduled(base, "params", sched, 2)
    assert d.tree == chain(3) and d.n_max == 2 and p == "params"
    assert scheduled(base, None, sched, 8)[0].tree == load_tree("kary_2x2x2")
    assert scheduled(base, None, sched, 32) == (None, None)
    assert scheduled(base, "p", None, 32) == (base, "p")


def test_generate_ids_with_schedule(tiny_model):
    """The batch size's schedule entry sets the draft shape (same program shapes as test_bench's e2e)."""
    from specjax.api import generate_ids
    from specjax.drafters.forced import ForcedDrafter, forced_params

    cfg, params = tiny_model
    sched = Schedule((ScheduleEntry(2, DraftShape(2)), ScheduleEntry(4, DraftShape(0))))
    drafter = ForcedDrafter(tree=chain(5), vocab_size=cfg.vocab_size)
    prompts = [[5, 6, 7, 5, 6, 7, 5], [9, 10, 9, 10]]
    spec = generate_ids(cfg, params, prompts, max_new_tokens=16, eos_ids=[], batch_size=2,
                        draft=drafter, drafter_params=forced_params((1.0, 0.0)), schedule=sched)
    assert all(r.spec["conditional_acceptance"] == [1.0, 0.0] for r in spec)
    assert all(len(r.token_ids) == 16 for r in spec)


# ---- profiler ------------------------------------------------------------------------------------


def test_random_shape_models_and_target_latency(tiny_model):
    cfg = shape_config("llama3-8b", 4)
    assert (cfg.num_layers, cfg.group_size, cfg.vocab_size) == (4, 4, 128256)
    assert cfg.rope_scaling is not None and cfg.name == "random:llama3-8b"
    with pytest.raises(ValueError, match="shapes"):
        shape_config("no-such-model")
    tiny_cfg, params = tiny_model
    seconds = target_latency(tiny_cfg, params, 2, 3, context=8, repeats=2, warmup=1)
    assert 0 < seconds < 5


def test_cli_parses_measurement_commands():
    from specjax.cli import build_parser

    args = build_parser().parse_args([
        "tune", "--model", "random:tiny", "--draft", "ngram", "--dataset", "synthetic:2",
        "--batch-sizes", "1,4", "--max-draft", "8", "--out", "x.yaml",
    ])
    assert args.batch_sizes == "1,4" and args.max_draft == 8 and args.func.__name__ == "cmd_tune"
    args = build_parser().parse_args([
        "bench", "--draft", "forced:0.8", "--num-draft", "3", "--dataset", "q.jsonl",
        "--categories", "a,b", "--per-category", "2", "--out", "o.json", "--plots", "p",
    ])
    assert args.out == "o.json" and args.per_category == 2 and args.func.__name__ == "cmd_bench"
    gen = build_parser().parse_args(["generate", "--prompt", "hi", "--tuned", "s.yaml"])
    assert gen.tuned == "s.yaml"
    assert dataclasses.is_dataclass(DraftShape(3)) and DraftShape(3).num_nodes == 3


@pytest.fixture
def tiny_target(tiny_model):
    """(the tiny model as a tokenizer-less target, two synthetic prompts' ids)."""
    from specjax.measure.bench import encode_rows
    from specjax.measure.datasets import synthetic_rows
    from specjax.measure.profile import RandomModel

    model = RandomModel(*tiny_model)
    return model, encode_rows(model, synthetic_rows(2, 12))


def test_measure_candidates_runs_each_shape(tiny_target):
    """The self-check path (same program shapes as test_bench's e2e, so it reuses compiles)."""
    from specjax.measure.bench import RunConfig
    from specjax.measure.tune import measure_candidates

    model, ids = tiny_target
    run = RunConfig(max_new_tokens=16, batch_size=2, ignore_eos=True)
    got = measure_candidates(model, ids, run, "forced:1.0,0.0",
                             [{"num_draft": 0, "tree": None}, {"num_draft": 2, "tree": None}])
    assert set(got) == {"0", "2"}
    assert all(v["tokens_per_s"] > 0 for v in got.values())


def test_calibration_prefers_a_candidates_own_run():
    """A chain calibrated on its own uses its measured per-row AL; others fall back to the
    long chain's joint acceptance; an uncalibrated tree is an error, not a guess."""
    cal = Calibration(row_tokens=[9, 9], row_joint=[[0.5, 0.5, 0.5]] * 2, spec_rows=[],
                      tokens_per_step={"2": [1.9, 2.1]})
    assert cal.row_tokens_per_step(DraftShape(2)) == [1.9, 2.1]
    assert cal.row_tokens_per_step(DraftShape(1)) == [1.5, 1.5]
    with pytest.raises(KeyError, match="not calibrated"):
        cal.row_tokens_per_step(DraftShape(tree="eagle_small"))


def test_sweep_summary_compares_the_pick_and_the_model_choice():
    from specjax.measure.tune import sweep_summary

    preds = [{"label": "2", "measured_tps": 90.0}, {"label": "1", "measured_tps": 100.0},
             {"label": "0", "measured_tps": 80.0}]
    got = sweep_summary(preds, pick="1")
    assert (got["best"], got["pick_vs_best"], got["model_pick"]) == ("1", 1.0, "2")
    assert got["model_pick_vs_best"] == pytest.approx(0.9)


def test_median_rates_ignore_one_slow_pass():
    """Per batch, the median over passes counts: a pass slowed 10x by a load burst is ignored."""
    from specjax.measure.bench import ModeRecord
    from specjax.measure.tune import median_rates

    def rec(total, ttft):  # 2 rows, 10 new tokens each (the first from prefill)
        return ModeRecord(new_tokens=20, first_tokens=2, batch_times=[total], ttfts=[ttft])

    chunk_a = [rec(1.0, 0.1), rec(10.0, 1.0), rec(1.2, 0.2)]  # medians: 1.2 s, decode 1.0 s
    chunk_b = [rec(2.0, 0.5), rec(2.0, 0.5), rec(2.0, 0.5)]  # 2.0 s, decode 1.5 s
    got = median_rates([chunk_a, chunk_b])
    assert got["tokens_per_s"] == pytest.approx(40 / 3.2)
    assert got["decode_tokens_per_s"] == pytest.approx(36 / 2.5)


def test_tune_end_to_end_with_a_forced_drafter(tiny_target):
    """The whole tuner on a tiny model: calibration, profile, ranking, the check with step
    costs re-profiled before every pass, the sweep, and a schedule that loads."""
    from specjax.measure.bench import RunConfig
    from specjax.measure.tune import TuneConfig, tune

    model, ids = tiny_target
    # long enough that decode time (full run - first-token run) stays well above timer noise
    # and a CPU shared with another test worker: at 64 tokens a tiny model's decode is ~5 ms,
    # and a run in CI once lost two of the three candidates' rates to it (full <= first-token)
    run = RunConfig(max_new_tokens=400, batch_size=2, ignore_eos=True)
    tc = TuneConfig(batch_sizes=(2,), max_draft=2, draft_lengths=(1, 2), calib_batch_size=2,
                    profile_repeats=2, check=2, sweep=True, measure_repeats=3)
    passes = []
    report = tune(model, ids, "forced:1.0,1.0", run, tc, log=passes.append)
    assert set(report["calibration"]["own_runs"]) == {"1", "2"}
    entry = report["batch_sizes"][2]
    labels = [p["label"] for p in entry["predictions"]]
    assert sorted(labels) == ["0", "1", "2"]
    # forced full acceptance: E[tokens/step] = 1 + D exactly
    assert {p["label"]: p["tokens_per_step"] for p in entry["predictions"]} == pytest.approx(
        {"0": 1.0, "1": 2.0, "2": 3.0})
    # the sweep ran them all (a tiny model's decode time, a run minus its first-token run, can
    # drown in timer noise on a loaded machine: then measured_tps is None, never a wrong rate)
    assert all(p["measured_tokens_per_step"] == pytest.approx(p["tokens_per_step"], rel=0.1)
               for p in entry["predictions"])
    timed = {p["label"]: p["measured_tps"] for p in entry["predictions"] if p["measured_tps"] is not None}
    assert len(timed) >= 2, f"too few candidates measured to rank: {timed}"  # not vacuous
    assert all(v > 0 for v in timed.values())
    assert [c["label"] for c in entry["check"]] == labels[:2]
    for c in entry["check"]:
        assert c["t_step_check_s"] > 0 and c["step_drift"] > 0
        if c["measured_tps"] is not None:
            assert c["measured_over_predicted_check"] == pytest.approx(c["measured_tps"] / c["predicted_tps_check"])
    # the model's first choice, and the pick: the fastest measured of the checked two
    checked = {c["label"]: c["measured_tps"] or 0.0 for c in entry["check"]}
    assert entry["model_pick"] == labels[0] and entry["pick"] == max(checked, key=checked.get)
    sweep = entry["sweep"]
    assert sweep["best"] == max(timed, key=timed.get)  # the sweep's best is the fastest measured
    assert sweep["best_tps"] == pytest.approx(timed[sweep["best"]])
    assert 0 <= sweep["model_pick_vs_best"] <= sweep["pick_vs_best"] <= 1
    schedule = Schedule.from_dict(report["schedule"])
    assert schedule.entries[0].shape.label == entry["pick"]
    assert any(line.startswith("check ") for line in passes)
