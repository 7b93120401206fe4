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

import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cpu_floor import cell_parser, cells, save_cell

import specjax
from specjax.kernels import cpu_ffi

DRAFTS = (None, "ngram")


def decode_rate(model, prompts, batch: int, draft, max_new: int) -> float:
    """Decode tokens/s (compile and prefill excluded) of `prompts` in batches of `batch`."""
    results = specjax.generate(model, prompts, max_new_tokens=max_new, batch_size=batch, draft=draft,
                               num_draft="auto" if draft else None, refill=False)
    tokens = sum(r.num_new_tokens for r in results)
    seconds = sum({id(r.times): r.times.decode_s for r in results}.values())  # one time a batch
    return tokens / seconds


def main() -> None:
    args = cell_parser(__doc__.splitlines()[0], ["int4", "int8", "float32"], 5).parse_args()
    report: dict = {}
    for key, model, batch, prompts in cells(args, report):
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
        save_cell(report, key, cell, args.out, {
            d: {k: v for k, v in c.items() if k != "passes"} if d != "auto_over_plain" else c
            for d, c in cell.items()})


if __name__ == "__main__":
    main()
