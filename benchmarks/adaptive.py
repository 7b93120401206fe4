"""num_draft="auto" vs plain decoding vs every static chain length, side by side in one run.

    # the reduced run committed in benchmarks/results/adaptive_reduced.json (2 shared CPU cores)
    python benchmarks/adaptive.py --batch-sizes 1 8 --drafts ngram --rows 1=1 8=8 \
        --max-new 32 --repeats 1 --out benchmarks/results/adaptive_reduced.json
    # the issue-15 run (hours on a CPU)
    python benchmarks/adaptive.py --batch-sizes 1 4 8 16 --drafts ngram suffix --rows 1=8 4=8 8=16 16=16 \
        --max-new 128 --repeats 3 --out benchmarks/results/adaptive_full.json

SmolLM2-135M (f32, greedy) on Spec-Bench first turns (chat template), all 13 categories. Per
(drafter, B, category) cell, the first N prompts of the category (`--rows B=N`) run through the
public API (`specjax.generate_ids`, refilled slots: what a user gets) in each mode: `plain`
(no drafter), `auto` (the drafter given no num_draft: the draft shape picked every step; its
step costs are profiled once per batch size, before the timed runs, or read from the cache) and
`D=1, 2, 4, 8` (a fixed chain). Compilation is excluded (each program is built before it runs;
`times.compile_s` is left out), the modes take turns in a rotating order `--repeats` times
(then plain and auto alone `--pair-repeats` more times: the cells under the 0.97 line at 3
repeats were the passes' spread, `docs/measure_and_tune.md`, 2026-12-07), and
each cell reports the median tokens/s (emitted tokens / the programs' run seconds) per mode,
auto / plain (the ratio of the medians, and "paired": the median of the per-repeat ratios, which
cancels the machine's drift between repeats) and auto / the cell's best static D, auto's shape histogram, and its predicted
decode tokens/s beside the measured ones: the prediction prices decoding steps only, and a
refilling run's decode seconds hold its slots' prefills, so the price is checked on auto runs in
static batches (`refill=False`: prefill timed apart; the faster of two runs), every token after
each row's first over its decode seconds. `--auto-variants NAME:FIELD=VALUE,...` adds a mode
`NAME`: auto with those numeric `AutoDrafter` fields changed (an A/B of auto's own settings in
the same run, e.g. `ema:prior_weight=1e9`, the estimate before 2026-12-04). Targets (issue 15): auto >= 0.97 x
plain in every cell, >= 0.95 x the best static D,
and at B = 1 overall, auto above the best single static D.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

from specjax.api import generate_ids
from specjax.drafters.auto import AutoDrafter
from specjax.metrics import job_summary
from specjax.models.hub import load_model
from specjax.timing import job_stats

DEFAULT_PROMPTS = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "spec_bench" / "question.jsonl"
STATIC = (1, 2, 4, 8)


def category_prompts(tokenizer, path: str, max_prompt: int) -> dict[str, list[list[int]]]:
    """{category: token ids of its rows' first turns (chat template, head max_prompt)}, file order."""
    out: dict[str, list[list[int]]] = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            out.setdefault(row["category"], []).append(tokenizer.encode_chat(row["turns"][0])[:max_prompt])
    return out


def modes(draft: str, static=STATIC, variants: dict[str, dict] | None = None) -> dict[str, dict]:
    """{mode name: generate_ids draft options (and "auto_fields": a variant's AutoDrafter fields)}."""
    return {"plain": {}, "auto": {"draft": draft}} | {
        name: {"draft": draft, "auto_fields": fields} for name, fields in (variants or {}).items()} | {
        f"D={d}": {"draft": draft, "num_draft": d} for d in static}


def parse_variants(items: list[str]) -> dict[str, dict]:
    """["ema:prior_weight=1e9,decay=0.8"] -> {"ema": {"prior_weight": 1e9, "decay": 0.8}}."""
    out = {}
    for item in items:
        name, _, fields = item.partition(":")
        out[name] = {k: float(v) for k, _, v in (f.partition("=") for f in fields.split(",") if f)}
        unknown = set(out[name]) - {f.name for f in dataclasses.fields(AutoDrafter)}
        if unknown:
            raise SystemExit(f"--auto-variants {item}: AutoDrafter has no field {sorted(unknown)}")
    return out


@contextlib.contextmanager
def auto_fields(fields: dict):
    """AutoDrafter.wrap with `fields` set, inside the block (the API wraps the drafter itself)."""
    wrap = AutoDrafter.wrap.__func__
    AutoDrafter.wrap = classmethod(lambda cls, *a, **o: wrap(cls, *a, **(fields | o)))
    try:
        yield
    finally:
        AutoDrafter.wrap = classmethod(wrap)


def timed(model, prompts, batch_size: int, max_new: int, options: dict) -> tuple[float, float, list]:
    """(tokens/s over the programs' run seconds, compile excluded; decode tokens/s: every token
    after each row's first over the decode seconds (with refill=False, what auto's prediction
    prices; a refilling run's decode seconds hold its prefills); the results)."""
    options = dict(options)
    with auto_fields(options.pop("auto_fields", {})):
        out = generate_ids(model.cfg, model.params, prompts, max_new_tokens=max_new,
                           batch_size=batch_size, **options)
    stats = job_stats(out)
    return stats.new_tokens / stats.run_s, (stats.new_tokens - len(out)) / stats.decode_s, out


def cell(model, prompts, batch_size: int, max_new: int, draft: str, repeats: int, turn: int,
         static=STATIC, variants: dict[str, dict] | None = None, pair_repeats: int = 0) -> dict:
    """One (drafter, B, category): median tokens/s per mode, modes rotated pass by pass
    (`static` empty: plain and auto alone; the best-static fields then compare with plain),
    then `pair_repeats` more passes of plain, auto and the variants alone (the order reversed
    every other pass): their medians and auto / plain over `repeats + pair_repeats` runs."""
    runs = modes(draft, static, variants)
    names = list(runs)
    rates: dict[str, list[float]] = {name: [] for name in names}
    auto_rows: list[dict] = []
    variant_shapes: dict[str, dict] = {}
    for rep in range(repeats):
        shift = (turn + rep) % len(names)
        for name in names[shift:] + names[:shift]:
            rate, _, out = timed(model, prompts, batch_size, max_new, runs[name])
            rates[name].append(rate)
            if name == "auto" and rep == 0:
                auto_rows = [r.spec for r in out]
            if name in (variants or {}) and rep == 0:
                variant_shapes[name] = job_summary([r.spec for r in out]).get("shape_histogram", {})
    paired_names = [name for name in names if not name.startswith("D=")]
    for rep in range(pair_repeats):
        for name in paired_names[::-1] if (turn + rep) % 2 else paired_names:
            rates[name].append(timed(model, prompts, batch_size, max_new, runs[name])[0])
    med = {name: statistics.median(v) for name, v in rates.items()}
    best = max((f"D={d}" for d in static), key=med.get, default="plain")
    summary = job_summary(auto_rows)
    checks = [timed(model, prompts, batch_size, max_new, runs["auto"] | {"refill": False})
              for _ in range(2)]  # the price check; its programs' first run can be slower
    _, decode_rate, static_out = max(checks, key=lambda check: check[1])
    predicted = job_summary([r.spec for r in static_out]).get("predicted_tokens_per_s")
    return {"num_prompts": len(prompts), "tokens_per_s": med, "runs": rates,
            "auto_runs": len(rates["auto"]),
            "best_static": best,
            "auto_over_plain": med["auto"] / med["plain"],
            "auto_over_plain_paired": paired(rates["auto"], rates["plain"]),
            "auto_over_best_static": med["auto"] / med[best],
            "auto_shape_histogram": summary.get("shape_histogram", {}),
            "variant_shape_histograms": variant_shapes,
            "auto_acceptance_length": summary["acceptance_length"],
            "auto_predicted_tokens_per_s": predicted,
            "auto_decode_tokens_per_s": decode_rate,
            "auto_predicted_over_measured_decode": predicted / decode_rate if predicted else None}


def paired(rates: list[float], baseline: list[float]) -> float:
    """The median over repeats of one mode's tokens/s over another's in the same repeat (the
    two ran one rotation apart at most): the machine's speed drifting between repeats moves
    both, which the ratio of the two medians does not cancel."""
    return statistics.median(a / b for a, b in zip(rates, baseline))


def overall(cells: dict[str, dict]) -> dict:
    """Per mode: summed-time tokens/s over the cells is not available from medians, so the
    geometric means of the per-cell ratios and the mean tokens/s per mode."""
    names = next(iter(cells.values()))["tokens_per_s"].keys()
    mean = {n: statistics.fmean(c["tokens_per_s"][n] for c in cells.values()) for n in names}
    best = max((n for n in names if n.startswith("D=")), key=mean.get, default="plain")
    geo = lambda key: statistics.geometric_mean(c[key] for c in cells.values())
    return {"mean_tokens_per_s": mean, "best_single_static": best,
            "auto_over_best_single_static": mean["auto"] / mean[best],
            "geomean_auto_over_plain": geo("auto_over_plain"),
            "geomean_auto_over_plain_paired": geo("auto_over_plain_paired"),
            "min_auto_over_plain_paired": min(c["auto_over_plain_paired"] for c in cells.values()),
            "geomean_auto_over_best_static": geo("auto_over_best_static"),
            "min_auto_over_plain": min(c["auto_over_plain"] for c in cells.values()),
            "min_auto_over_best_static": min(c["auto_over_best_static"] for c in cells.values())}


def parse_rows(items: list[str]) -> dict[int, int]:
    """["1=2", "8=8"] -> {1: 2, 8: 8} (prompts per category at each batch size)."""
    return {int(b): int(n) for b, _, n in (item.partition("=") for item in items)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default=str(DEFAULT_PROMPTS))
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--drafts", nargs="+", default=["ngram"])
    parser.add_argument("--rows", nargs="+", default=["1=2", "8=8"], help="B=N: prompts per category")
    parser.add_argument("--categories", nargs="*", default=None, help="default: all")
    parser.add_argument("--max-new", type=int, default=48)
    parser.add_argument("--max-prompt", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--static", type=int, nargs="*", default=list(STATIC),
                        help="static chain lengths to compare (none: plain and auto alone)")
    parser.add_argument("--auto-variants", nargs="*", default=[],
                        help="NAME:FIELD=VALUE,...: auto with those AutoDrafter fields, as mode NAME")
    parser.add_argument("--pair-repeats", type=int, default=0,
                        help="more passes of plain, auto and the variants alone, after --repeats")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    rows = parse_rows(args.rows)
    variants = parse_variants(args.auto_variants)
    model = load_model(args.model, dtype="float32")
    groups = category_prompts(model.tokenizer, args.prompts, args.max_prompt)
    names = args.categories or list(groups)
    report = {"command": "python " + " ".join(sys.argv), "model": args.model, "dtype": "float32",
              "max_new_tokens": args.max_new, "repeats": args.repeats,
              "pair_repeats": args.pair_repeats, "static": args.static,
              "results": {}}
    start = time.perf_counter()
    turn = 0
    for draft in args.drafts:
        for b in args.batch_sizes:
            cells = {}
            for name in names:
                cells[name] = cell(model, groups[name][: rows.get(b, b)], b, args.max_new, draft,
                                   args.repeats, turn, tuple(args.static), variants,
                                   args.pair_repeats)
                turn += 1
                c = cells[name]
                print(f"{draft} B={b} {name:<15} plain {c['tokens_per_s']['plain']:6.1f} auto "
                      f"{c['tokens_per_s']['auto']:6.1f} best {c['best_static']} "
                      f"{c['tokens_per_s'][c['best_static']]:6.1f} | auto/plain "
                      f"{c['auto_over_plain']:.2f} (paired {c['auto_over_plain_paired']:.2f}) "
                      f"auto/best {c['auto_over_best_static']:.2f} "
                      + "".join(f"{v}/plain {c['tokens_per_s'][v] / c['tokens_per_s']['plain']:.2f} "
                                for v in variants) +
                      f"shapes {c['auto_shape_histogram']} {c['variant_shape_histograms'] or ''}"
                      f"decode predicted/measured {c['auto_predicted_over_measured_decode'] or 0:.2f} "
                      f"({time.perf_counter() - start:.0f} s)",
                      flush=True)
                if args.out:  # every finished cell is kept, should the run be cut short
                    report["results"][f"{draft}/B={b}"] = {"cells": cells, "overall": overall(cells)}
                    Path(args.out).write_text(json.dumps(report, indent=1))
            report["results"][f"{draft}/B={b}"] = {"cells": cells, "overall": overall(cells)}
            print(f"{draft} B={b} overall {json.dumps(report['results'][f'{draft}/B={b}']['overall'])}",
                  flush=True)
            if args.out:
                Path(args.out).write_text(json.dumps(report, indent=1))
    report["wall_s"] = time.perf_counter() - start
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
