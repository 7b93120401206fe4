"""`specjax bench`: speculative decoding vs the plain baseline, per category, in one process.

Both modes run the same prompts (token-level `generate_ids`, batches formed inside each
category) after a warm-up that compiles every program shape used (so no timed run compiles).
Modes alternate per category (AR then spec, then spec then AR, ...) so that slow drift of the
machine hits both alike. Time to first token (TTFT) is measured by the same programs with
max_new_tokens = 1 (prefill, plus the drafter's prefill, plus one sample).

JSON report (schema "specjax.bench", version 1; keys are stable, new keys may be added):

    {
      "schema": "specjax.bench", "version": 1,
      "created": ISO-8601 time, "command": [argv...] | null,
      "environment": {"backend", "device_kind", "num_devices", "jax_version", "specjax_version"},
      "config": {"model", "draft", "tree": {"name", "num_nodes", "max_depth", "parents"},
                 "dataset", "categories": [...], "per_category", "max_new_tokens",
                 "batch_size", "temperature", "top_k", "top_p", "seed", "repeats",
                 "ignore_eos", "chat"},
      "categories": {NAME: SECTION, ...},
      "overall": SECTION
    }
    SECTION = {
      "num_prompts": int,
      "baseline": MODE,
      "spec": MODE + ACCEPTANCE,
      "speedup": spec tokens_per_s / baseline tokens_per_s (end to end, TTFT included),
      "decode_speedup": the same for decode_tokens_per_s (null when either is null),
      "ideal_speedup": float | null,        (overall only, when latency was profiled:
      "system_efficiency": float | null      decode_speedup / ideal_speedup)
    }
    MODE = {
      "new_tokens": emitted tokens (all repeats), "time_s": summed batch wall times,
      "tokens_per_s": new_tokens / time_s,
      "decode_tokens_per_s": (new_tokens - first tokens) / (time_s - summed batch TTFTs),
                             null when the TTFT runs took as long as the full runs (tiny models),
      "ttft_s": {"median", "mean"} over batches (a batch's first tokens arrive together),
      "compile_s": seconds building the mode's programs (the warm-up's: timed runs build none),
      "prefill_s", "decode_s": the full runs' two programs, summed over batches
                               (time_s = prefill_s + decode_s),
      "prefill_share": prefill_s / (prefill_s + decode_s),
      "slot_utilisation": busy slot-steps / all slot-steps of the full runs' static batches
                          (a row is busy from its first decoding step to its last)
    }
    ACCEPTANCE (vLLM definitions, `specjax.metrics.summarize`) = {
      "steps", "drafted", "accepted", "acceptance_length" (AL = 1 + accepted / steps),
      "acceptance_rate", "accepted_per_position": [Dmax], "joint_acceptance": [Dmax],
      "conditional_acceptance": [Dmax], "accepted_length_histogram": [Dmax + 1]
    }

The ideal speedup is what the measured step costs allow: AL x T_target(B, 1) /
(T_target(B, 1 + N) + T_draft(B)) from `specjax.measure.profile` at the run's mean context; the system
efficiency (measured decode speedup / ideal) shows what the loop's own overheads (accept,
commit, bookkeeping) cost. Forced-acceptance drafters (`forced:...`) make it measurable on
shape-only models.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from specjax import __version__
from specjax.api import batch_rows, bucket, generate_ids
from specjax.drafters.registry import make_drafter
from specjax.measure.datasets import categories_of
from specjax.measure.profile import device_info, draft_latency, target_latency
from specjax.metrics import job_summary
from specjax.progress import progress_bar
from specjax.sharding import MeshSpec
from specjax.timing import JobStats, job_stats

SCHEMA = "specjax.bench"
SCHEMA_VERSION = 1
MODE_KEYS = ("new_tokens", "time_s", "tokens_per_s", "decode_tokens_per_s", "ttft_s")
ACCEPTANCE_KEYS = (
    "steps", "drafted", "accepted", "acceptance_length", "acceptance_rate",
    "accepted_per_position", "joint_acceptance", "conditional_acceptance",
    "accepted_length_histogram",
)
SECTION_KEYS = ("num_prompts", "baseline", "spec", "speedup", "decode_speedup")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """How every timed run generates (shared by both modes)."""

    max_new_tokens: int = 128
    batch_size: int = 1
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    ignore_eos: bool = False  # rows run to max_new_tokens (forced / shape-only runs)
    stop_token_seqs: tuple[tuple[int, ...], ...] = ()
    mesh: MeshSpec | None = None  # None: one device; else the generate_ids mesh
    auto: bool = False  # the drafter runs with num_draft="auto" (its tree: auto's longest chain)


# ---------------------------------------------------------------------------------------------
# Prompts and drafters
# ---------------------------------------------------------------------------------------------


def encode_rows(model, rows: Sequence[dict], chat: bool = True) -> list[list[int]]:
    """Token ids per row: the model's tokenizer (chat template when `chat`), or for shape-only
    models without one, the prompt's UTF-8 bytes (ids < 256, so text structure survives)."""
    tok = model.tokenizer
    if tok is None:
        vocab = model.cfg.vocab_size
        return [[b % vocab for b in r["prompt"].encode("utf-8")] for r in rows]
    return [tok.encode_chat(r["prompt"]) if chat else tok.encode(r["prompt"]) for r in rows]


def encode_by_category(model, rows: Sequence[dict], chat: bool = True) -> dict[str, list[list[int]]]:
    """Token ids of rows (`encode_rows`) grouped by their "category", in first-seen order."""
    groups: dict[str, list[list[int]]] = {}
    for row, ids in zip(rows, encode_rows(model, rows, chat)):
        groups.setdefault(row["category"], []).append(ids)
    return groups


def make_any_drafter(spec: str, tree, model, dtype: str = "float32", auto: bool = False):
    """(drafter, params) for a --draft spec, from the drafter registry (auto: for
    num_draft="auto", `tree` its longest chain; `registry.make_drafter`)."""

    return make_drafter(spec, tree=tree, target=model, dtype=dtype, auto=auto)


# ---------------------------------------------------------------------------------------------
# Timed runs
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class ModeRecord:
    """Accumulated measurements of one mode (baseline or spec) over some batches."""

    new_tokens: int = 0
    first_tokens: int = 0  # rows whose first token counted (one per row)
    batch_times: list[float] = dataclasses.field(default_factory=list)
    ttfts: list[float] = dataclasses.field(default_factory=list)
    spec_rows: list[dict] = dataclasses.field(default_factory=list)
    stats: JobStats = JobStats()  # the full runs' tokens, prefill and decode seconds, and the
    # compile seconds of every run of the mode (the warm-up's included)

    def add(self, other: ModeRecord) -> None:
        self.new_tokens += other.new_tokens
        self.first_tokens += other.first_tokens
        self.batch_times += other.batch_times
        self.ttfts += other.ttfts
        self.spec_rows += other.spec_rows
        self.stats += other.stats


def generate_batches(model, ids, run: RunConfig, drafter, drafter_params, max_new_tokens: int):
    """`generate_ids` over ids with the run's settings -> TokenResults (one per row), in static
    batches (refill=False): bench times each batch's prefill and decode apart, and its
    first-token runs are batches of the same rows."""
    return generate_ids(
        model.cfg, model.params, ids, max_new_tokens=max_new_tokens, temperature=run.temperature,
        top_k=run.top_k, top_p=run.top_p, seed=run.seed, batch_size=run.batch_size,
        eos_ids=() if run.ignore_eos else None, stop_token_seqs=run.stop_token_seqs,
        draft=drafter, drafter_params=drafter_params, mesh=run.mesh, refill=False,
        num_draft="auto" if run.auto and drafter is not None else None,
    )


def timed_run(model, ids, run: RunConfig, drafter=None, drafter_params=None) -> ModeRecord:
    """One mode over ids: a full run, then a TTFT run (max_new_tokens = 1)."""
    results = generate_batches(model, ids, run, drafter, drafter_params, run.max_new_tokens)
    firsts = generate_batches(model, ids, run, drafter, drafter_params, 1)
    starts = range(0, len(ids), run.batch_size)
    stats = job_stats(results)
    return ModeRecord(
        new_tokens=sum(len(r.token_ids) for r in results),
        first_tokens=len(ids),
        batch_times=[results[i].time_s for i in starts],
        ttfts=[firsts[i].time_s for i in starts],
        spec_rows=[r.spec for r in results if r.spec is not None],
        stats=dataclasses.replace(stats, compile_s=stats.compile_s + job_stats(firsts).compile_s),
    )


def decode_rate(model, ids, run: RunConfig, drafter=None, drafter_params=None, repeats: int = 3) -> dict:
    """Decode tokens/s by difference: two runs of the SAME compiled program (max_new_tokens and
    the fewest tokens in its width bucket) cancel prefill and fixed costs exactly.

    Returns {"tokens_per_s", "long_s", "short_s", "tokens", "spec"} (medians over `repeats`;
    "spec": the long runs' acceptance summary or None; the first pass also compiles, so it is
    not timed). Meant for runs with ignore_eos (equal token counts).
    """
    short = dataclasses.replace(run, max_new_tokens=warm_tokens(run.max_new_tokens))
    timing: dict[str, list[float]] = {"long": [], "short": []}
    tokens, spec_rows = {}, []
    for rep in range(repeats + 1):
        for name, cfg in (("long", run), ("short", short)):
            res = generate_batches(model, ids, cfg, drafter, drafter_params, cfg.max_new_tokens)
            if rep:
                timing[name].append(sum(res[i].time_s for i in range(0, len(ids), run.batch_size)))
            tokens[name] = sum(len(r.token_ids) for r in res)
            if name == "long":
                spec_rows += [r.spec for r in res if r.spec is not None]
    long_s, short_s = statistics.median(timing["long"]), statistics.median(timing["short"])
    extra = tokens["long"] - tokens["short"]
    return {"tokens_per_s": extra / (long_s - short_s) if long_s > short_s else None,
            "long_s": long_s, "short_s": short_s, "tokens": extra,
            "spec": job_summary(spec_rows) if spec_rows else None}


def warm_tokens(max_new_tokens: int) -> int:
    """The fewest new tokens whose program has the same shapes as max_new_tokens'."""
    width = bucket(max_new_tokens)
    return next(n for n in range(1, max_new_tokens + 1) if bucket(n) == width)


def warm_up(model, groups: Sequence[list[list[int]]], run: RunConfig, modes) -> list[list[float]]:
    """Compiles every program (per batch rows and prompt bucket, full and TTFT) that the timed
    runs of each mode `(drafter | None, params)` will use; the compile seconds [group][mode]."""
    seen = set()
    short = dataclasses.replace(run, max_new_tokens=warm_tokens(run.max_new_tokens))
    compile_s = [[0.0] * len(modes) for _ in groups]
    for group, ids in enumerate(groups):
        for start in range(0, len(ids), run.batch_size):
            chunk = ids[start : start + run.batch_size]
            shape = (batch_rows(run.batch_size, len(chunk)), bucket(max(len(p) for p in chunk)))
            if shape in seen:
                continue
            seen.add(shape)
            for mode, (d, p) in enumerate(modes):
                compile_s[group][mode] += timed_run(model, chunk, short, d, p).stats.compile_s
    return compile_s


def rotated(items: Sequence, turn: int) -> list:
    """`items` starting at position `turn % len(items)`: the order of the modes on turn `turn`,
    so each mode goes first equally often and a drifting load hits them all alike."""
    first = turn % len(items)
    return [*items[first:], *items[:first]]


def measure(
    model, groups: dict[str, list[list[int]]], run: RunConfig, drafter, drafter_params,
    *, repeats: int = 1, warmup: bool = True, log: Callable[[str], None] | None = None,
    progress: bool = False,
) -> dict[str, tuple[ModeRecord, ModeRecord]]:
    """(baseline, spec) records per group, alternating the order of the modes; `progress`
    shows a bar of the timed runs (one per group, mode and repeat) on a terminal."""
    out = {name: (ModeRecord(), ModeRecord()) for name in groups}
    if warmup:
        if log:
            log("warm-up: compiling every program shape of both modes")
        warm = warm_up(model, list(groups.values()), run, [(None, None), (drafter, drafter_params)])
        for records, compile_s in zip(out.values(), warm):
            for record, seconds in zip(records, compile_s):
                record.stats += JobStats(compile_s=seconds)
    modes = [(0, "baseline", None, None), (1, "spec", drafter, drafter_params)]
    turn = 0
    with progress_bar(total=2 * repeats * len(groups), desc="bench", unit="run",
                      enabled=progress) as bar:
        for _ in range(repeats):
            for name, ids in groups.items():
                for slot, mode, d, p in rotated(modes, turn):
                    bar.set_postfix_str(f"{name}: {mode}")
                    out[name][slot].add(timed_run(model, ids, run, d, p))
                    bar.update()
                turn += 1
                if log:
                    base, spec = out[name]
                    log(f"{name}: baseline {_rate(base.new_tokens, sum(base.batch_times)):.1f} tok/s, "
                        f"spec {_rate(spec.new_tokens, sum(spec.batch_times)):.1f} tok/s")
    return out


# ---------------------------------------------------------------------------------------------
# Statistics and the report
# ---------------------------------------------------------------------------------------------


def _rate(tokens: float, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0


def mode_stats(rec: ModeRecord) -> dict:
    """MODE of the schema."""
    time_s = sum(rec.batch_times)
    decode_time = time_s - sum(rec.ttfts)
    return {
        "new_tokens": rec.new_tokens,
        "time_s": time_s,
        "tokens_per_s": _rate(rec.new_tokens, time_s),
        "decode_tokens_per_s": (
            _rate(rec.new_tokens - rec.first_tokens, decode_time) if decode_time > 0 else None
        ),
        "ttft_s": {
            "median": statistics.median(rec.ttfts) if rec.ttfts else 0.0,
            "mean": statistics.fmean(rec.ttfts) if rec.ttfts else 0.0,
        },
        "compile_s": rec.stats.compile_s,
        "prefill_s": rec.stats.prefill_s,
        "decode_s": rec.stats.decode_s,
        "prefill_share": rec.stats.prefill_s / rec.stats.run_s if rec.stats.run_s else 0.0,
        "slot_utilisation": rec.stats.slot_utilisation,  # busy slot-steps / all (static batches)
    }


def auto_section(acceptance: dict, spec: dict) -> dict:
    """With num_draft="auto": {"shape_histogram" (steps per chain length, 0 = plain),
    "predicted_decode_tokens_per_s" (the auto mode's own prediction of its picks),
    "predicted_over_measured" (over decode_tokens_per_s)}; {} otherwise."""
    if "shape_histogram" not in acceptance:
        return {}
    predicted, measured = acceptance["predicted_tokens_per_s"], spec["decode_tokens_per_s"]
    return {"shape_histogram": acceptance["shape_histogram"],
            "predicted_decode_tokens_per_s": predicted,
            "predicted_over_measured": predicted / measured if measured else None}


def section(num_prompts: int, base: ModeRecord, spec: ModeRecord) -> dict:
    """SECTION of the schema (without the ideal speedup)."""
    b, s = mode_stats(base), mode_stats(spec)
    acceptance = job_summary(spec.spec_rows)
    ratio = lambda x, y: x / y if x is not None and y else None
    return {
        "num_prompts": num_prompts,
        "baseline": b,
        "spec": {**s, **{k: acceptance[k] for k in ACCEPTANCE_KEYS}, **auto_section(acceptance, s)},
        "speedup": ratio(s["tokens_per_s"], b["tokens_per_s"]),
        "decode_speedup": ratio(s["decode_tokens_per_s"], b["decode_tokens_per_s"]),
        "ideal_speedup": None,
        "system_efficiency": None,
    }


def merged(records: Sequence[ModeRecord]) -> ModeRecord:
    total = ModeRecord()
    for r in records:
        total.add(r)
    return total


def ideal_speedup(tokens_per_step: float, t_target_1: float, t_target_n: float, t_draft: float) -> float:
    """AL x T_target(B, 1) / (T_target(B, 1 + N) + T_draft(B)): the speedup of the measured
    step costs when nothing but the target's forwards and the drafter cost time."""
    return tokens_per_step * t_target_1 / (t_target_n + t_draft)


def tree_info(tree) -> dict | None:
    if tree is None:
        return None
    return {"name": tree.name, "num_nodes": tree.num_nodes, "max_depth": tree.max_depth,
            "parents": list(tree.parents)}


def build_report(
    rows: Sequence[dict], records: dict[str, tuple[ModeRecord, ModeRecord]], config: dict,
    command: Sequence[str] | None = None, ideal: dict | None = None,
) -> dict:
    """The JSON report (schema in the module docstring). ideal: {"t_target_1", "t_target_n",
    "t_draft"} seconds from the latency profiler, or None."""

    counts = {c: sum(r["category"] == c for r in rows) for c in categories_of(rows)}
    cats = {c: section(counts[c], *records[c]) for c in records}
    overall = section(
        len(rows), merged([b for b, _ in records.values()]), merged([s for _, s in records.values()])
    )
    if ideal is not None:
        overall["ideal_speedup"] = ideal_speedup(overall["spec"]["acceptance_length"], **ideal)
        if overall["decode_speedup"] is not None:
            overall["system_efficiency"] = overall["decode_speedup"] / overall["ideal_speedup"]
        overall["latency_s"] = ideal
    return {
        "schema": SCHEMA,
        "version": SCHEMA_VERSION,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": list(command) if command is not None else None,
        "environment": {**device_info(), "specjax_version": __version__},
        "config": config,
        "categories": cats,
        "overall": overall,
    }


def validate_report(report: dict) -> None:
    """Raises ValueError when a report does not follow schema version 1."""
    def need(obj, keys, where):
        missing = [k for k in keys if k not in obj]
        if missing:
            raise ValueError(f"{where}: missing {missing}")

    need(report, ("schema", "version", "environment", "config", "categories", "overall"), "report")
    if report["schema"] != SCHEMA or report["version"] != SCHEMA_VERSION:
        raise ValueError(f"not a {SCHEMA} v{SCHEMA_VERSION} report")
    for name, sec in [("overall", report["overall"])] + list(report["categories"].items()):
        need(sec, SECTION_KEYS + ("ideal_speedup", "system_efficiency"), name)
        need(sec["baseline"], MODE_KEYS, f"{name}.baseline")
        need(sec["spec"], MODE_KEYS + ACCEPTANCE_KEYS, f"{name}.spec")
        depth = len(sec["spec"]["accepted_per_position"])
        if len(sec["spec"]["accepted_length_histogram"]) != depth + 1:
            raise ValueError(f"{name}: histogram needs Dmax + 1 = {depth + 1} bins")


# ---------------------------------------------------------------------------------------------
# The whole benchmark
# ---------------------------------------------------------------------------------------------


def profile_ideal(model, drafter, drafter_params, run: RunConfig, ids: Sequence[Sequence[int]],
                  repeats: int = 5) -> dict:
    """The step costs behind the ideal speedup, at the run's mean context and buffer width."""

    mean_prompt = int(np.mean([len(p) for p in ids]))
    context = mean_prompt + run.max_new_tokens // 2
    capacity = bucket(max(len(p) for p in ids)) + bucket(run.max_new_tokens) + drafter.tree.num_nodes + 1
    timing = dict(context=context, capacity=capacity, repeats=repeats)
    cfg, params, b = model.cfg, model.params, run.batch_size
    return {
        "t_target_1": target_latency(cfg, params, b, 1, **timing),
        "t_target_n": target_latency(cfg, params, b, drafter.tree.num_nodes + 1, **timing),
        "t_draft": draft_latency(cfg, params, drafter, drafter_params, b, **timing),
    }


def run_bench(
    model, rows: Sequence[dict], drafter, drafter_params, run: RunConfig, *,
    chat: bool = True, repeats: int = 1, ideal: bool = False, config: dict | None = None,
    command: Sequence[str] | None = None, log: Callable[[str], None] | None = None,
    progress: bool = False,
) -> dict:
    """Benchmarks `drafter` against plain decoding on rows ({"category", "prompt"}) -> report
    (`progress`: a bar of the timed runs on a terminal)."""
    if not rows:
        raise ValueError("run_bench needs at least one prompt row")
    groups = encode_by_category(model, rows, chat)
    ids = [p for group in groups.values() for p in group]
    records = measure(model, groups, run, drafter, drafter_params, repeats=repeats, log=log,
                      progress=progress)
    costs = profile_ideal(model, drafter, drafter_params, run, ids) if ideal else None
    config = {
        **(config or {}), "tree": tree_info(drafter.tree), "categories": list(groups),
        "max_new_tokens": run.max_new_tokens, "batch_size": run.batch_size,
        "temperature": run.temperature, "top_k": run.top_k, "top_p": run.top_p, "seed": run.seed,
        "repeats": repeats, "ignore_eos": run.ignore_eos, "chat": chat,
    }
    return build_report(rows, records, config, command, costs)


def write_json(report: dict, path: str | os.PathLike) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")


def summary_lines(report: dict) -> list[str]:
    """A human-readable table of the report."""
    lines = [f"{'category':<16} {'n':>4} {'AL':>5} {'base tok/s':>10} {'spec tok/s':>10} "
             f"{'speedup':>7} {'TTFT ms':>8}"]
    for name, sec in {**report["categories"], "overall": report["overall"]}.items():
        lines.append(
            f"{name:<16} {sec['num_prompts']:>4} {sec['spec']['acceptance_length']:>5.2f} "
            f"{sec['baseline']['tokens_per_s']:>10.1f} {sec['spec']['tokens_per_s']:>10.1f} "
            f"{sec['speedup']:>7.2f} {sec['spec']['ttft_s']['median'] * 1e3:>8.1f}"
        )
    o = report["overall"]
    if "shape_histogram" in o["spec"]:
        ratio = o["spec"]["predicted_over_measured"]
        lines.append(f"auto: steps per draft length {o['spec']['shape_histogram']}; predicted "
                     f"{o['spec']['predicted_decode_tokens_per_s']:.1f} decode tok/s"
                     + (f" = {ratio:.2f} x measured" if ratio else ""))
    if "compile_s" in o["spec"]:
        lines.append(f"compiled in {o['baseline']['compile_s']:.1f} s (baseline) + "
                     f"{o['spec']['compile_s']:.1f} s (spec), apart from the timed runs; spec: "
                     f"prefill {o['spec']['prefill_s']:.2f} s, decode {o['spec']['decode_s']:.2f} s")
    if o.get("system_efficiency"):
        lines.append(f"ideal speedup {o['ideal_speedup']:.2f}, decode speedup {o['decode_speedup']:.2f}, "
                     f"system efficiency {o['system_efficiency']:.1%}")
    return lines
