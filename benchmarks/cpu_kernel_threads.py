"""The CPU kernels' helper threads: their own crew (kernels/cpu_crew.h) against XLA's pool.

The kernels share each call's work with helper threads. With XLA's intra-op pool as helpers, a
program XLA runs on its client thread (plain decoding: `loop.ar_finish_program`) ran slower a
step than the same kernels in a program XLA moves onto a pool worker (`num_draft="auto"`'s
loop): each `pool.Schedule` from outside the pool also wakes a pool worker that finds no work,
a third thread on a two-core machine. This prints, side by side in one process (compile
excluded, the settings and modes taking turns in a rotated order), decode tokens/s of plain
decoding and of n-gram with `num_draft="auto"`, each with the crew on and off, per weight mode
(float32 / int8 / int4 through the kernels), prompt set and batch size; medians of `--repeats`
passes, and crew / pool ratios.

    python benchmarks/cpu_kernel_threads.py --modes int4 int8 float32 --batch-sizes 1 8 --repeats 5
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cpu_floor import SETS, SPEC_BENCH, model_in

import specjax
from specjax.kernels import cpu_ffi
from specjax.measure.datasets import load_prompt_set, select_rows

DRAFTS = (None, "ngram")


def decode_rate(model, prompts, batch: int, draft, max_new: int) -> float:
    """Decode tokens/s (compile and prefill excluded) of `prompts` in batches of `batch`."""
    results = specjax.generate(model, prompts, max_new_tokens=max_new, batch_size=batch, draft=draft,
                               num_draft="auto" if draft else None, refill=False)
    tokens = sum(r.num_new_tokens for r in results)
    seconds = sum({id(r.times): r.times.decode_s for r in results}.values())  # one time a batch
    return tokens / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", default=SPEC_BENCH)
    ap.add_argument("--modes", nargs="+", default=["int4", "int8", "float32"])
    ap.add_argument("--sets", nargs="+", default=list(SETS))
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
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
                runs = [(draft, crew) for draft in DRAFTS for crew in (True, False)]
                for draft, crew in runs:  # compile (the crew does not change the programs)
                    cpu_ffi.use_crew(crew)
                    decode_rate(model, prompts[:batch], batch, draft, args.max_new)
                rates: dict = {run: [] for run in runs}
                for rep in range(args.repeats):
                    for draft, crew in runs[rep % len(runs):] + runs[:rep % len(runs)]:
                        cpu_ffi.use_crew(crew)
                        rates[draft, crew].append(decode_rate(model, prompts, batch, draft, args.max_new))
                cpu_ffi.use_crew(True)
                cell = {}
                for draft in DRAFTS:
                    crew, pool = (statistics.median(rates[draft, on]) for on in (True, False))
                    cell[draft or "plain"] = {
                        "crew_tokens_per_s": round(crew, 1), "pool_tokens_per_s": round(pool, 1),
                        "crew_over_pool": round(crew / pool, 3),
                        "passes": {"crew": [round(r, 1) for r in rates[draft, True]],
                                   "pool": [round(r, 1) for r in rates[draft, False]]}}
                cell["auto_over_plain"] = {
                    "crew": round(cell["ngram"]["crew_tokens_per_s"] / cell["plain"]["crew_tokens_per_s"], 3),
                    "pool": round(cell["ngram"]["pool_tokens_per_s"] / cell["plain"]["pool_tokens_per_s"], 3)}
                key = f"{mode} {name} B={batch}"
                report["cells"][key] = cell
                print(key, json.dumps({d: {k: v for k, v in c.items() if k != "passes"} if d != "auto_over_plain" else c
                                       for d, c in cell.items()}), flush=True)
                if args.out:  # after each cell: a long run stopped early keeps what it measured
                    with open(args.out, "w") as f:
                        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
