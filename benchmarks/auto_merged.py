"""auto's chains in one loop (`AutoDrafter.merged`) against a loop per chain length, side by side.

A lookup drafter's (n-gram, suffix) chain lengths run in one `while_loop` at the longest chain,
the pick's length as data: the draft nodes deeper than the pick are dead rows of the verify,
which the CPU kernels skip (`specjax.verify`, `kernels/qmatmul_cpu.cc`, `attention_cpu.cc`).
That compiles one target forward for the chains instead of one per length
(`benchmarks/compile_time.py --trees auto` measures the compile). This prints decode tokens/s
of plain decoding and of n-gram `num_draft="auto"` merged and separate (`merge=False`), per
weight mode, prompt set and batch size, side by side in one process (compile excluded, the
three taking turns in a rotated order, each auto variant with its own profiled step costs),
medians of `--repeats` passes of the set's prompts, and each one's ratio to plain decoding.

    python benchmarks/auto_merged.py --modes int4 float32 --sets summarization open_chat \
        --batch-sizes 1 8 --repeats 3 --out benchmarks/results/auto_merged.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys

import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cpu_floor import SETS, SPEC_BENCH, model_in

import specjax
from specjax.auto_costs import auto_drafter, step_costs
from specjax.drafters.auto import AutoParams
from specjax.drafters.ngram import NgramDrafter
from specjax.measure.datasets import load_prompt_set, select_rows
from specjax.tree import chain

RUNS = ("plain", "merged", "separate")


def decode_pass(model, prompts, batch: int, draft, max_new: int) -> tuple[float, dict]:
    """(decode tokens/s, the spec metrics' shape counts) of `prompts` in batches of `batch`
    (compile and prefill excluded: static batches)."""
    results = specjax.generate(model, prompts, max_new_tokens=max_new, batch_size=batch, draft=draft,
                               refill=False)
    tokens = sum(r.num_new_tokens for r in results)
    seconds = sum({id(r.times): r.times.decode_s for r in results}.values())  # one time a batch
    shapes: dict = {}
    for r in results:
        for shape, steps in ((r.spec or {}).get("shape_histogram") or {}).items():
            shapes[shape] = shapes.get(shape, 0) + steps
    return tokens / seconds, shapes


def drafts(model, batch: int) -> dict:
    """Each run's `draft` argument: None, and (AutoDrafter, AutoParams) merged and separate."""
    merged, costs = auto_drafter(model.cfg, model.params, NgramDrafter(tree=chain(1)), None, batch)
    separate = dataclasses.replace(merged, merge=False)
    widths, step_s = step_costs(model.cfg, model.params, separate, None, batch)
    assert merged.merged and not separate.merged
    return {"plain": None, "merged": (merged, costs),
            "separate": (separate, AutoParams(None, jnp.asarray(step_s, jnp.float32),
                                              jnp.asarray(widths, jnp.float32)))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", default=SPEC_BENCH)
    ap.add_argument("--modes", nargs="+", default=["int4", "float32"])
    ap.add_argument("--sets", nargs="+", default=list(SETS))
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    f32 = specjax.load(args.model, dtype="float32")
    rows = load_prompt_set(args.prompts)
    report: dict = {"command": " ".join(["python", *sys.argv]), "cpu_count": os.cpu_count(), "cells": {}}
    for mode in args.modes:
        model = model_in(f32, mode)
        for name in args.sets:
            for batch in args.batch_sizes:
                texts = [r["prompt"] for r in select_rows(rows, [SETS[name]], max(2, batch))]
                prompts = [model.tokenizer.encode_chat(t) for t in texts]
                draft = drafts(model, batch)
                tokens = {run: specjax.generate(model, prompts[:batch], max_new_tokens=args.max_new,
                                                batch_size=batch, draft=draft[run], refill=False)
                          for run in RUNS}  # compile
                same = all([r.token_ids for r in tokens[run]] == [r.token_ids for r in tokens["plain"]]
                           for run in RUNS)
                rates: dict = {run: [] for run in RUNS}
                shapes: dict = {}
                for rep in range(args.repeats):
                    for run in RUNS[rep % len(RUNS):] + RUNS[:rep % len(RUNS)]:
                        rate, shapes[run] = decode_pass(model, prompts, batch, draft[run], args.max_new)
                        rates[run].append(rate)
                med = {run: statistics.median(v) for run, v in rates.items()}
                cell = {"tokens_per_s": {run: round(v, 1) for run, v in med.items()},
                        "over_plain": {run: round(med[run] / med["plain"], 3) for run in RUNS[1:]},
                        "merged_over_separate": round(med["merged"] / med["separate"], 3),
                        "shape_histogram": {run: shapes[run] for run in RUNS[1:]},
                        "same_tokens_as_plain": same,
                        "passes": {run: [round(r, 1) for r in v] for run, v in rates.items()}}
                key = f"{mode} {name} B={batch}"
                report["cells"][key] = cell
                print(key, json.dumps({k: v for k, v in cell.items() if k != "passes"}), flush=True)
                if args.out:  # after each cell: a long run stopped early keeps what it measured
                    with open(args.out, "w") as f:
                        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
