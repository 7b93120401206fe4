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

import dataclasses
import os
import statistics
import sys

import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cpu_floor import cell_parser, cells, save_cell

import specjax
from specjax.auto_costs import auto_drafter, step_costs
from specjax.drafters.auto import AutoParams
from specjax.drafters.ngram import NgramDrafter
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
    auto, _ = auto_drafter(model.cfg, model.params, NgramDrafter(tree=chain(1)), None, batch)
    merged = dataclasses.replace(auto, merge_rows=auto.merged_verify_rows(batch))  # at any batch size
    separate = dataclasses.replace(auto, merge=False)
    assert merged.merged(batch) and not separate.merged(batch)
    out: dict = {"plain": None}
    for name, drafter in (("merged", merged), ("separate", separate)):
        widths, step_s = step_costs(model.cfg, model.params, drafter, None, batch)
        out[name] = (drafter, AutoParams(None, jnp.asarray(step_s, jnp.float32), jnp.asarray(widths, jnp.float32)))
    return out


def main() -> None:
    args = cell_parser(__doc__.splitlines()[0], ["int4", "float32"], 3).parse_args()
    report: dict = {}
    for key, model, batch, prompts in cells(args, report):
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
        save_cell(report, key, cell, args.out, {k: v for k, v in cell.items() if k != "passes"})


if __name__ == "__main__":
    main()
