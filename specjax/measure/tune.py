"""`specjax tune`: the draft length (or tree) per batch size, from measurements of this device.

Throughput model (decode throughput: the first token, from prefill, is excluded on both sides),
for batch size B and draft shape c (a chain of D, a tree preset, or none):

    tokens/s(c, B) = E[tokens per step](c) x B x U(c, B) / (T_target(B, 1 + N_c) + T_draft(B, c))

- E: by default every candidate is calibrated by its own run, E_i = row i's measured AL
  (`calibrate_each`). The fast alternative runs one chain of max_draft and takes E_i(D) =
  1 + sum_{j<D} joint_ij: a chain of D drafts a prefix of the long chain's draft, but the
  step boundaries move with D, and a short chain spends more of its steps inside the runs it
  copies, so this underestimates short chains (n-gram on SmolLM2: D = 3 measured 1.77 tokens
  per step, 1.62 from the chain of 8). A tree's E is always its measured AL. No speculation: E = 1.
- U: batch utilisation. A batch runs until its slowest row is done, so with per-row steps
  s_i = (tokens_i - 1) / E_i, U = sum_i s_i / (B x sum over batches of max_i s_i) (U = 1 at
  B = 1); computed from the calibration rows grouped as the real run groups them.
- T_target, T_draft from `specjax.measure.profile` at the run's mean context and buffer width
  ("predicted_tps"). "predicted_tps_step" uses T_step(B, c) instead, the measured whole step
  (draft, verify, accept, commit, bookkeeping; T_ar(B) without speculation): the ranking uses
  it when measured, since it includes the loop's own overheads.

The pick: the model ranks every candidate; when the tuner checks itself (`check` > 0) it runs
the best `check` for real and picks the fastest of them (candidates predicted within a few %
of each other are otherwise ordered by the noise in the model's inputs), reporting the model's
own first choice beside it. Before each measuring pass the whole-step costs are re-profiled,
so the check also compares the measurement with a prediction from costs taken under the same
load ("predicted_tps_check").

The analytic starting points printed beside the measured choice: D = 128/G - 1 (G query heads
per KV head: one verify-attention tile of G x (1 + D) rows), the tile-aligned D with
G x (1 + D) a multiple of 128, and the D at which the target's GEMMs (M = B x (1 + D) rows)
leave the memory-bound region (arithmetic intensity above the device's FLOP/byte ridge).
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.api import bucket
from specjax.costmodel import chain_tokens_per_step, throughput
from specjax.measure.bench import (
    ModeRecord,
    RunConfig,
    generate_batches,
    make_any_drafter,
    rotated,
    timed_run,
    warm_up,
)
from specjax.measure.profile import LatencyProfile, profile_latency, step_costs
from specjax.metrics import job_summary
from specjax.progress import progress_bar
from specjax.schedule import DraftShape, Schedule, ScheduleEntry

TILE_ROWS = 128


# ---------------------------------------------------------------------------------------------
# The throughput model (pure): `specjax.costmodel`'s formulas, shared with num_draft="auto"
# ---------------------------------------------------------------------------------------------


def batch_steps(row_tokens: Sequence[int], row_tokens_per_step: Sequence[float], batch_size: int) -> tuple[float, float]:
    """(sum of row decode steps, sum over batches of the slowest row's steps).

    Rows are grouped in order, `batch_size` at a time, as `generate_ids` batches them; a row
    emitting t tokens at E tokens per step takes (t - 1) / E decode steps.
    """
    steps = [max(t - 1, 0) / e for t, e in zip(row_tokens, row_tokens_per_step)]
    batches = [steps[i : i + batch_size] for i in range(0, len(steps), batch_size)]
    return float(sum(steps)), float(sum(max(b) for b in batches))


def predict(row_tokens: Sequence[int], row_tokens_per_step: Sequence[float], batch_size: int, step_s: float) -> dict:
    """Predicted decode throughput of rows at one step cost: {"tokens_per_step" E,
    "utilization" U, "tokens_per_s" = E x B x U / step_s}."""
    row_steps, batch_total = batch_steps(row_tokens, row_tokens_per_step, batch_size)
    decode_tokens = sum(max(t - 1, 0) for t in row_tokens)
    e = decode_tokens / row_steps if row_steps else 1.0
    u = row_steps / (batch_size * batch_total) if batch_total else 1.0
    # E x (B x U) / T: the cost model auto picks with, over the batch's busy rows
    return {"tokens_per_step": e, "utilization": u,
            "tokens_per_s": throughput(e, batch_size * u, step_s) if batch_total else 0.0}


# ---------------------------------------------------------------------------------------------
# Analytic starting points
# ---------------------------------------------------------------------------------------------


def tile_draft_lengths(group_size: int, max_draft: int) -> dict:
    """{"tile": 128/G - 1 (floor), "aligned": [D <= max_draft with G(1+D) % 128 == 0]}."""
    return {
        "tile": TILE_ROWS // group_size - 1,
        "aligned": [d for d in range(1, max_draft + 1) if group_size * (1 + d) % TILE_ROWS == 0],
    }


def gemm_ridge_rows(k: int, n: int, ridge: float, bytes_per_elem: int) -> int:
    """Smallest M at which an [M, K] x [K, N] GEMM's FLOPs / bytes exceeds `ridge`.

    intensity(M) = 2 M K N / (bytes x (K N + M K + M N)); grows with M toward 2 K N / (K + N).
    Returns a huge number when the GEMM never leaves the memory-bound region.
    """
    denom = 2 * k * n - ridge * bytes_per_elem * (k + n)
    if denom <= 0:
        return 1 << 30
    return max(1, math.ceil(ridge * bytes_per_elem * k * n / denom))


def memory_bound_draft(cfg, batch_size: int, ridge: float) -> dict:
    """Where the target's MLP GEMM (hidden x intermediate) becomes compute-bound at batch B:
    {"rows": M*, "num_draft": ceil(M* / B) - 1}."""
    rows = gemm_ridge_rows(cfg.hidden_size, cfg.intermediate_size, ridge, cfg.jnp_dtype.itemsize)
    return {"rows": rows, "num_draft": max(0, -(-rows // batch_size) - 1)}


def measure_roofline(dtype: str = "float32") -> dict:
    """Peak matmul FLOP/s and streaming bytes/s of this device, measured (medians of 5)."""
    accel = jax.default_backend() != "cpu"
    n = 4096 if accel else 1024
    a = jnp.ones((n, n), dtype)
    x = jnp.ones(((512 if accel else 128) << 20) // 4, jnp.float32)
    matmul, stream = jax.jit(lambda a: a @ a), jax.jit(lambda x: jnp.sum(x))

    def med(fn, arg):
        jax.block_until_ready(fn(arg))
        times = []
        for _ in range(5):
            start = time.perf_counter()
            jax.block_until_ready(fn(arg))
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    flops = 2 * n**3 / med(matmul, a)
    bandwidth = x.nbytes / med(stream, x)
    return {"flops": flops, "bytes_per_s": bandwidth, "ridge": flops / bandwidth}


def knee(profile: LatencyProfile, batch_size: int, tolerance: float = 0.1) -> int:
    """Largest measured D with T_target(B, 1 + D) <= (1 + tolerance) x T_target(B, 1)."""
    curve = profile.target[batch_size]
    base = curve[min(curve)]
    return max((t - 1 for t, s in curve.items() if s <= (1 + tolerance) * base), default=0)


# ---------------------------------------------------------------------------------------------
# Candidates, calibration, predictions
# ---------------------------------------------------------------------------------------------


def draft_grid(max_draft: int) -> list[int]:
    """D = 1..8, then 10, 12, 16, 20, 24, 32, ... up to max_draft."""
    extra = [10, 12, 16, 20, 24, 32, 48, 64]
    return sorted({d for d in list(range(1, 9)) + extra if d <= max_draft} | {max_draft})


@dataclasses.dataclass
class Calibration:
    """Per-row measurements of the calibration run: emitted tokens, joint acceptance per
    position (chain of max_draft), speculative summaries, and the per-row AL of each shape
    that ran on its own (trees always; chains with calibrate_each), keyed by DraftShape.label."""

    row_tokens: list[int]
    row_joint: list[list[float]]
    spec_rows: list[dict]
    tokens_per_step: dict[str, list[float]] = dataclasses.field(default_factory=dict)

    def row_tokens_per_step(self, cand: DraftShape) -> list[float]:
        if cand.label in self.tokens_per_step:
            return self.tokens_per_step[cand.label]
        if cand.tree:
            raise KeyError(f"tree {cand.tree!r} was not calibrated")
        return [chain_tokens_per_step(j, cand.num_draft) for j in self.row_joint]

    def acceptance(self) -> dict:
        """The job-level acceptance summary of the calibration chain."""

        return job_summary(self.spec_rows)


def calibrate(model, ids, run: RunConfig, draft_spec: str, max_draft: int,
              candidates: Sequence[DraftShape], dtype: str = "float32", each: bool = True,
              progress: bool = False) -> Calibration:
    """Runs the drafter as a chain of max_draft over ids, then each tree candidate (and, when
    `each`, each chain candidate) on its own; per-row profiles. `progress`: a bar of the runs
    on a terminal."""
    own_runs = [c for c in candidates if c.tree or (each and 0 < c.num_draft < max_draft)]
    with progress_bar(total=1 + len(own_runs), desc="tune: calibrate", unit="run",
                      enabled=progress) as bar:
        bar.set_postfix_str(f"draft {max_draft}")
        drafter, params = make_any_drafter(draft_spec, DraftShape(max_draft).tree_spec, model, dtype)
        results = generate_batches(model, ids, run, drafter, params, run.max_new_tokens)
        bar.update()
        cal = Calibration(
            row_tokens=[len(r.token_ids) for r in results],
            row_joint=[r.spec["joint_acceptance"] for r in results],
            spec_rows=[r.spec for r in results],
        )
        for cand in own_runs:
            bar.set_postfix_str(f"draft {cand.label}")
            drafter, params = make_any_drafter(draft_spec, cand.tree_spec, model, dtype)
            results = generate_batches(model, ids, run, drafter, params, run.max_new_tokens)
            cal.tokens_per_step[cand.label] = [r.spec["acceptance_length"] for r in results]
            bar.update()
    if each:
        cal.tokens_per_step[str(max_draft)] = [r["acceptance_length"] for r in cal.spec_rows]
    return cal


def predictions(cal: Calibration, prof: LatencyProfile, candidates: Sequence[DraftShape], batch_size: int) -> list[dict]:
    """One row per candidate (no speculation included): E, U, costs and predicted tokens/s."""
    out = []
    for cand in [DraftShape(0)] + [c for c in candidates if c.label != "0"]:
        per_step = cal.row_tokens_per_step(cand) if cand.label != "0" else [1.0] * len(cal.row_tokens)
        if cand.label == "0":
            t_target, t_draft, t_step = prof.target_at(batch_size, 1), 0.0, prof.ar_step.get(batch_size)
        else:
            t_target = prof.target_at(batch_size, 1 + cand.num_nodes)
            t_draft = prof.draft[batch_size][cand.label]
            t_step = prof.step.get(batch_size, {}).get(cand.label)
        ideal = predict(cal.row_tokens, per_step, batch_size, t_target + t_draft)
        row = {
            "label": cand.label, "num_draft": cand.num_draft, "tree": cand.tree,
            "tokens_per_step": ideal["tokens_per_step"], "utilization": ideal["utilization"],
            "t_target_s": t_target, "t_draft_s": t_draft, "t_step_s": t_step,
            "predicted_tps": ideal["tokens_per_s"],
            "predicted_tps_step": (
                predict(cal.row_tokens, per_step, batch_size, t_step)["tokens_per_s"] if t_step else None
            ),
        }
        row["rank_tps"] = row["predicted_tps_step"] or row["predicted_tps"]
        out.append(row)
    return sorted(out, key=lambda r: -r["rank_tps"])


# ---------------------------------------------------------------------------------------------
# Measuring candidates for real
# ---------------------------------------------------------------------------------------------


def median_rates(chunk_passes: Sequence[Sequence[ModeRecord]]) -> dict[str, float]:
    """Tokens/s of one candidate from repeated passes over the same chunks of prompts:
    chunk_passes[c][r] is chunk c's record in pass r. Each chunk's times (and token counts) are
    the medians over its passes, so one pass slowed by a load burst does not move the result:
    {"decode_tokens_per_s", "tokens_per_s"} = summed tokens / summed median seconds."""
    med = lambda fn, passes: statistics.median(fn(rec) for rec in passes)
    tokens = sum(med(lambda r: r.new_tokens, ps) for ps in chunk_passes)
    decode_tokens = sum(med(lambda r: r.new_tokens - r.first_tokens, ps) for ps in chunk_passes)
    time_s = sum(med(lambda r: sum(r.batch_times), ps) for ps in chunk_passes)
    decode_s = sum(med(lambda r: sum(r.batch_times) - sum(r.ttfts), ps) for ps in chunk_passes)
    return {"tokens_per_s": tokens / time_s,
            "decode_tokens_per_s": decode_tokens / decode_s if decode_s > 0 else None}


def measure_candidates(model, ids, run: RunConfig, draft_spec: str, labels: Sequence[dict],
                       dtype: str = "float32", repeats: int = 3,
                       before_pass: Callable[[int], None] | None = None,
                       progress: bool = False) -> dict[str, dict]:
    """Real decode throughput of each candidate (prediction rows) at run.batch_size:
    label -> {"decode_tokens_per_s", "tokens_per_s"} (`median_rates` over `repeats` passes).

    The candidates take turns batch by batch (rotating who goes first), so a drifting load
    hits every candidate alike; before_pass(r) runs before pass r (the tuner re-profiles there).
    `progress`: a bar of the timed runs (candidate x batch x pass) on a terminal."""
    modes = {}
    for row in labels:
        cand = DraftShape(row["num_draft"], row["tree"])
        if cand.label == "0":
            modes[cand.label] = (None, None)
        else:
            modes[cand.label] = make_any_drafter(draft_spec, cand.tree_spec, model, dtype)
    warm_up(model, [ids], run, list(modes.values()))
    starts = range(0, len(ids), run.batch_size)
    records = {label: [[] for _ in starts] for label in modes}
    order = list(modes.items())
    with progress_bar(total=repeats * len(starts) * len(order), desc=f"tune: B={run.batch_size}",
                      unit="run", enabled=progress) as bar:
        for rep in range(repeats):
            if before_pass is not None:
                before_pass(rep)
            for chunk, start in enumerate(starts):
                turn = rep * len(starts) + chunk
                for label, (drafter, params) in rotated(order, turn):
                    bar.set_postfix_str(f"pass {rep + 1}/{repeats}, draft {label}")
                    rec = timed_run(model, ids[start : start + run.batch_size], run, drafter, params)
                    records[label][chunk].append(rec)
                    bar.update()
    return {label: median_rates(chunks) | {"tokens_per_step": measured_tokens_per_step(chunks)}
            for label, chunks in records.items()}


def measured_tokens_per_step(chunk_passes: Sequence[Sequence[ModeRecord]]) -> float:
    """The acceptance length of the first pass over all chunks (1.0 without speculation)."""

    rows = [row for passes in chunk_passes for row in passes[0].spec_rows]
    return job_summary(rows)["acceptance_length"] if rows else 1.0


def sweep_summary(preds: Sequence[dict], pick: str) -> dict:
    """The sweep's best measured candidate, and the pick's and the model's first choice's
    throughput relative to it (preds: ranked prediction rows, all measured)."""
    tps = {p["label"]: p["measured_tps"] or 0.0 for p in preds}
    best = max(tps, key=tps.get)
    # None: no decode time was measured at all (runs too short to time)
    relative = lambda label: tps[label] / tps[best] if tps[best] else None
    return {"best": best, "best_tps": tps[best], "pick_tps": tps[pick], "pick_vs_best": relative(pick),
            "model_pick": preds[0]["label"], "model_pick_vs_best": relative(preds[0]["label"])}


def check_row(cal: Calibration, pred: dict, batch_size: int, rechecks: Sequence[dict[str, float]]) -> dict:
    """Predicted vs measured for one candidate. With re-profiled step costs (one dict per
    measuring pass), also the prediction from their median ("..._check") and that cost over
    the one the pick was made with ("step_drift": > 1 when the machine slowed meanwhile)."""
    row = {"label": pred["label"], "predicted_tps": pred["predicted_tps"],
           "predicted_tps_step": pred["predicted_tps_step"], "measured_tps": pred["measured_tps"],
           "measured_over_predicted": (pred["measured_tps"] or 0.0) / pred["rank_tps"],
           "tokens_per_step": pred["tokens_per_step"],
           "measured_tokens_per_step": pred.get("measured_tokens_per_step")}
    if rechecks:
        t_step = statistics.median(r[pred["label"]] for r in rechecks)
        per_step = cal.row_tokens_per_step(DraftShape(pred["num_draft"], pred["tree"]))
        row["t_step_check_s"] = t_step
        row["predicted_tps_check"] = predict(cal.row_tokens, per_step, batch_size, t_step)["tokens_per_s"]
        row["measured_over_predicted_check"] = (pred["measured_tps"] or 0.0) / row["predicted_tps_check"]
        row["step_drift"] = t_step / pred["t_step_s"] if pred["t_step_s"] else None
    return row


# ---------------------------------------------------------------------------------------------
# The whole tuner
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TuneConfig:
    batch_sizes: tuple[int, ...] = (1, 4, 16, 64)
    max_draft: int = 32
    draft_lengths: tuple[int, ...] | None = None  # default: draft_grid(max_draft)
    trees: tuple[str, ...] = ()
    calib_batch_size: int = 4
    calibrate_each: bool = True  # every candidate's own calibration run (else: from the longest chain)
    profile_repeats: int = 5
    step_profile: bool = True
    check: int = 3  # measure the best `check` candidates per batch size (0 = no self-check)
    sweep: bool = False  # measure every candidate (to judge the pick)
    measure_repeats: int = 3  # passes over the prompts per measured candidate (medians per batch)
    dtype: str = "float32"

    def __post_init__(self):
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"tune needs batch sizes >= 1, got {self.batch_sizes}")


def self_check(model, ids, run: RunConfig, draft_spec: str, tc: TuneConfig, cal: Calibration,
               preds: list[dict], drafters: dict, context: int, capacity: int,
               progress: bool = False) -> dict:
    """Runs the best tc.check predictions (every one with tc.sweep) for real at run.batch_size,
    re-profiling their step costs before each pass; fills each prediction row's measured
    fields and returns the entry's "check" rows, the measured "pick" and the "sweep" summary."""
    measure_top = preds if tc.sweep else preds[: tc.check]
    rechecks: list[dict[str, float]] = []
    check_drafters = {p["label"]: drafters[p["label"]] for p in measure_top if p["label"] != "0"}

    def reprofile(_pass: int) -> None:
        rechecks.append(step_costs(model, run.batch_size, check_drafters, context=context,
                                   capacity=capacity, repeats=tc.profile_repeats))

    measured = measure_candidates(model, ids, run, draft_spec, measure_top, tc.dtype,
                                  tc.measure_repeats, reprofile if tc.step_profile else None,
                                  progress=progress)
    for p in preds:
        p["measured_tps"] = measured.get(p["label"], {}).get("decode_tokens_per_s")
        p["measured_tokens_per_step"] = measured.get(p["label"], {}).get("tokens_per_step")
    out = {"check": [check_row(cal, p, run.batch_size, rechecks) for p in preds[: tc.check]]}
    if out["check"]:
        # the model narrows the field, the measurement settles it: candidates predicted within
        # a few % of each other are otherwise ordered by the noise in the model's inputs
        out["pick"] = max(preds[: tc.check], key=lambda p: p["measured_tps"] or 0.0)["label"]
    if tc.sweep:
        out["sweep"] = sweep_summary(preds, out.get("pick", preds[0]["label"]))
    return out


def tune(model, rows_ids: Sequence[Sequence[int]], draft_spec: str, run: RunConfig, tc: TuneConfig,
         log: Callable[[str], None] = lambda _: None, model_name: str | None = None,
         progress: bool = False) -> dict:
    """Calibrate, profile, predict, check; returns the report (schedule in report["schedule"]).

    model_name: how the schedule names the model (default: its config's name); progress: bars
    of the calibration and measuring runs on a terminal."""
    ids = [list(p) for p in rows_ids]
    if not ids:
        raise ValueError("tune needs at least one prompt")
    cands = [DraftShape(d) for d in (tc.draft_lengths or draft_grid(tc.max_draft))]
    cands += [DraftShape(tree=t) for t in tc.trees]
    max_draft = max([tc.max_draft] + [c.num_draft for c in cands])
    start = time.perf_counter()
    cal = calibrate(model, ids, dataclasses.replace(run, batch_size=tc.calib_batch_size),
                    draft_spec, max_draft, cands, tc.dtype, tc.calibrate_each, progress)
    log(f"calibration: {len(ids)} prompts, chain of {max_draft}"
        f"{' and each candidate' if tc.calibrate_each else ''}, "
        f"{time.perf_counter() - start:.0f} s")

    context = int(np.mean([len(p) for p in ids])) + run.max_new_tokens // 2
    capacity = bucket(max(len(p) for p in ids)) + bucket(run.max_new_tokens) + 1 + max(c.num_nodes for c in cands)
    drafters = {c.label: make_any_drafter(draft_spec, c.tree_spec, model, tc.dtype) for c in cands}
    roof = measure_roofline(model.cfg.dtype)
    report = {
        "model": model.cfg.name, "draft": draft_spec,
        "calibration": {"num_prompts": len(ids), "max_draft": max_draft,
                        "acceptance": cal.acceptance(),
                        # E[tokens per step] of each shape calibrated on its own run
                        "own_runs": {k: predict(cal.row_tokens, v, 1, 1.0)["tokens_per_step"]
                                     for k, v in cal.tokens_per_step.items()}},
        "roofline": roof,
        "analytic": {"group_size": model.cfg.group_size,
                     **tile_draft_lengths(model.cfg.group_size, max_draft)},
        "batch_sizes": {},
    }
    entries, prof = [], None
    for b in tc.batch_sizes:
        # profiled right before its candidates are measured: on a shared machine whose load
        # drifts, a profile taken long before the check would mispredict it
        part = profile_latency(
            model, [b], [1] + [1 + c.num_nodes for c in cands], drafters, context=context,
            capacity=capacity, repeats=tc.profile_repeats, steps=tc.step_profile, log=log,
        )
        prof = part if prof is None else prof.merged(part)
        preds = predictions(cal, prof, cands, b)
        entry = {
            "predictions": preds,
            "pick": preds[0]["label"],
            "model_pick": preds[0]["label"],
            "memory_bound": memory_bound_draft(model.cfg, b, roof["ridge"]),
            "knee_num_draft": knee(prof, b),
        }
        if tc.sweep or tc.check:
            entry |= self_check(model, ids, dataclasses.replace(run, batch_size=b), draft_spec, tc,
                                cal, preds, drafters, context, capacity, progress)
        report["batch_sizes"][b] = entry
        top = next(p for p in preds if p["label"] == entry["pick"])
        entries.append(ScheduleEntry(
            batch_size=b, shape=DraftShape(top["num_draft"], top["tree"]),
            extra={"predicted_tokens_per_s": round(top["rank_tps"], 2)}
            | ({"measured_tokens_per_s": round(top["measured_tps"], 2)} if top.get("measured_tps") else {}),
        ))
        for line in format_batch(b, entry, report["analytic"]):
            log(line)
    report["device"], report["profile"] = prof.device, prof.to_dict()
    report["schedule"] = Schedule(tuple(entries), model=model_name or model.cfg.name, draft=draft_spec,
                                  device=prof.device["device_kind"]).to_dict()
    return report


def format_batch(batch_size: int, entry: dict, analytic: dict) -> list[str]:
    """The table printed per batch size: candidates by predicted throughput, then the
    analytic starting points next to the pick."""
    lines = [f"== batch size {batch_size}",
             f"{'D/tree':>12} {'E[tok/step]':>11} {'U':>5} {'T_target ms':>11} {'T_draft ms':>10} "
             f"{'T_step ms':>9} {'pred tok/s':>10} {'pred(step)':>10} {'measured':>9}"]
    fmt = lambda x, spec: format(x, spec) if x is not None else "-"
    for p in entry["predictions"]:
        lines.append(
            f"{p['label']:>12} {p['tokens_per_step']:>11.2f} {p['utilization']:>5.2f} "
            f"{p['t_target_s'] * 1e3:>11.2f} {p['t_draft_s'] * 1e3:>10.2f} "
            f"{fmt(p['t_step_s'] and p['t_step_s'] * 1e3, '9.2f'):>9} {p['predicted_tps']:>10.1f} "
            f"{fmt(p['predicted_tps_step'], '10.1f'):>10} {fmt(p.get('measured_tps'), '9.1f'):>9}"
        )
    mb = entry["memory_bound"]
    lines.append(
        f"pick: {entry['pick']} (the model's first choice: {entry['model_pick']}) | "
        f"analytic: 128/G-1 = {analytic['tile']} (G={analytic['group_size']}), "
        f"tile-aligned D = {analytic['aligned'] or 'none <= max_draft'}, GEMMs leave the "
        f"memory-bound region at B(1+D) >= {mb['rows']} (D >= {mb['num_draft']}), "
        f"measured knee (T_target within 10% of T=1): D = {entry['knee_num_draft']}"
    )
    for c in entry.get("check", []):
        line = (f"check {c['label']}: measured {fmt(c['measured_tps'], '.1f')} tok/s = "
                f"{c['measured_over_predicted']:.2f} x predicted, {fmt(c['measured_tokens_per_step'], '.2f')} "
                f"tokens/step (predicted {c['tokens_per_step']:.2f})")
        if "predicted_tps_check" in c:
            line += (f"; {c['measured_over_predicted_check']:.2f} x the prediction from step costs "
                     f"re-profiled during the check ({fmt(c['step_drift'], '.2f')} x the pick-time cost)")
        lines.append(line)
    if "sweep" in entry:
        s = entry["sweep"]
        lines.append(f"sweep: best {s['best']} at {s['best_tps']:.1f} tok/s; pick reaches "
                     f"{fmt(s['pick_vs_best'], '.1%')} of it (the model's first choice {s['model_pick']}: "
                     f"{fmt(s['model_pick_vs_best'], '.1%')})")
    return lines
