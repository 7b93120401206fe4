"""What auto's branch machinery costs a step: a static chain vs auto forced onto that chain.

    python benchmarks/auto_overhead.py --batch 1 --num-draft 4 --repeats 5 [--draft ngram|suffix]

SmolLM2-135M (f32, or `--mode int8|int4`: packed layer kernels), n-gram (or `--draft suffix`),
one fixed prompt per row (200 tokens), greedy, EOS off. Modes, rotated
pass by pass: `static` (`num_draft=D`), `forced` (the default auto's chains, `BASE_LENGTHS`
and D, with D priced far below the rest, so every step picks D: the chains run in one loop at
the longest, the nodes deeper than D dead rows of the verify, `AutoDrafter.merged`, at any
batch size: `merge_rows` raised) and
`separate` (the same with `merge=False`: a loop and a target forward per chain length). Prints the median ms per decoding step (decode
seconds / steps, compile excluded; static batches, `refill=False`, so that the prefill is timed
apart: a refilling run's decode seconds hold its slots' prefills) of each and their ratio, and
checks that both emit the same tokens (docs/measure_and_tune.md quotes a run), and each
mode's median prefill ms (the drafter's own prefill: suffix's table of the prompts).

`--num-draft 0`: auto's plain branch against plain decoding. `static` is then plain decoding
(no drafter) and `forced` the default auto (chains of `BASE_LENGTHS`) with the plain step priced
far below the rest, so every step is auto's plain branch, which watches a chain of 8 (its
lookup proposal, `AutoDrafter.watch`); `watch1` the same watching depth 0 only. ms per step
is then decode seconds per new token of a row (all emit exactly `--max-new` tokens a row, one
a step). Besides the medians, the median of each pass's ratio to `static` (paired).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys

import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cpu_floor import model_in

import specjax
from specjax.drafters.auto import BASE_LENGTHS, AutoDrafter, AutoParams
from specjax.drafters.ngram import NgramDrafter
from specjax.drafters.suffix import SuffixDrafter
from specjax.models.hub import load_model
from specjax.timing import job_stats
from specjax.tree import chain


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--num-draft", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=192)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--draft", choices=("ngram", "suffix"), default="ngram")
    ap.add_argument("--mode", choices=("float32", "int8", "int4"), default="float32")
    args = ap.parse_args()
    model = model_in(load_model("smollm2-135m", dtype="float32"), args.mode)
    prompts = [[1 + (7 * i + j) % 500 for j in range(200)] for i in range(args.batch)]
    plain_only = args.num_draft == 0
    inner = {"ngram": NgramDrafter, "suffix": SuffixDrafter}[args.draft](tree=chain(1))
    lengths = tuple(sorted(set(BASE_LENGTHS) | {args.num_draft}))
    forced = AutoDrafter.wrap(inner, lengths)
    forced = dataclasses.replace(forced, merge_rows=forced.merged_verify_rows(args.batch))  # merged at any B
    step_s = [1e-3 if d == args.num_draft else 1.0 for d in lengths]  # the forced shape: far the cheapest
    costs = AutoParams(None, jnp.asarray(step_s, jnp.float32))
    modes = {"static": {} if plain_only else {"draft": args.draft, "num_draft": args.num_draft},
             "forced": {"draft": (forced, costs)}}
    if not plain_only:
        modes["separate"] = {"draft": (dataclasses.replace(forced, merge=False), costs)}
    if plain_only:
        modes["watch1"] = {"draft": (dataclasses.replace(forced, watch=1), costs)}
    names = list(modes)
    ms: dict[str, list[float]] = {name: [] for name in names}
    prefill_ms: dict[str, list[float]] = {name: [] for name in names}
    tokens = {}
    for rep in range(args.repeats + 1):  # pass 0 compiles
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            out = specjax.generate_ids(model.cfg, model.params, prompts, batch_size=args.batch,
                                       max_new_tokens=args.max_new, eos_ids=[], refill=False,
                                       **modes[name])  # static batches: prefill timed apart
            steps = max(len(r.token_ids) if plain_only else r.spec["steps"] for r in out)
            tokens.setdefault(name, [r.token_ids for r in out])
            if rep:
                stats = job_stats(out)
                ms[name].append(1e3 * stats.decode_s / steps)
                prefill_ms[name].append(1e3 * stats.prefill_s)
    med = {name: statistics.median(v) for name, v in ms.items()}
    print({name: [round(x, 2) for x in v] for name, v in ms.items()})
    print("prefill ms (median):", {name: round(statistics.median(v), 1) for name, v in prefill_ms.items()})
    paired = {name: statistics.median(a / b for a, b in zip(ms[name], ms["static"])) for name in names[1:]}
    print(f"{args.mode} {args.draft} B={args.batch} D={args.num_draft}: static {med['static']:.2f} ms/step, " + ", ".join(
        f"{name} {med[name]:.2f} ms/step, {name}/static {med[name] / med['static']:.3f} (paired "
        f"{paired[name]:.3f})" for name in names[1:]) +
        f"; same tokens: {all(tokens[name] == tokens['static'] for name in names)}")


if __name__ == "__main__":
    main()
