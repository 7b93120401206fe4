"""How long auto's first-run step-cost profile takes (`specjax.auto_costs.profile_step_costs`),
split into its first call (compile + one run) and the timed turns, in a fresh process.

    python benchmarks/auto_profile_time.py --model smollm2-135m --draft ngram --batch-size 1 \
        [--steps 4 --rounds 12 --budget-s 10] [--profiles 4]

Prints one JSON line: {"model", "draft", "batch_size", "lengths", "steps", "rounds", "total_s",
"contexts": [{"context", "cached", "width", "total_s", "first_call_s", "timed_s", "step_ms",
"ratios", "ratio_spread", "rounds", "call_ms"}]} (ratios: each branch's step over the plain
one; ratio_spread: the interquartile range of its per-round ratios; `--profiles N` profiles
each context N times in the process, one row each: how far the ratios move between profiles)
(call_ms: a profile call's cost besides its steps, which the step costs leave out; auto
profiles at each of `auto_costs.CONTEXTS`; `--contexts 64 512 1024` also checks how well the
line through the first two predicts a third; `--contexts 1024 1024 --cached 1024 64` whether
a width's cost depends on how much of it is filled; `--prefill-context` runs the target over
every cached token instead of standing a lookup drafter's context in, the profile before
2026-12-06). Run it with SPECJAX_COMPILE_CACHE=0 to time a first run.
"""
from __future__ import annotations

import argparse
import json
import time

from specjax import auto_costs
from specjax.drafters.auto import AutoDrafter, auto_lengths, auto_max_draft
from specjax.drafters.registry import make_drafter
from specjax.models.hub import load_model
from specjax.tree import chain


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--draft", default="ngram")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--steps", type=int, default=auto_costs.STEPS)
    p.add_argument("--rounds", type=int, default=auto_costs.ROUNDS)
    p.add_argument("--budget-s", type=float, default=auto_costs.BUDGET_S)
    p.add_argument("--contexts", type=int, nargs="+", default=list(auto_costs.CONTEXTS),
                   help="the contexts whose cache widths are profiled (auto profiles each of these)")
    p.add_argument("--cached", type=int, nargs="+", default=None,
                   help="tokens cached in each context's program, one per context (default: "
                        "auto's, `auto_costs.cached_tokens`: at most 64 where the attention reads "
                        "the whole buffer)")
    p.add_argument("--profiles", type=int, default=1, help="profiles of each context, in turn")
    p.add_argument("--prefill-context", action="store_true",
                   help="run the target over every cached token (`auto_costs.started_state` with "
                        "fill=False; by default a lookup drafter's context past 64 tokens is stood in)")
    args = p.parse_args()
    model = load_model(args.model, dtype="float32")
    inner, inner_params = make_drafter(args.draft, tree=chain(8), target=model, auto=True)
    drafter = AutoDrafter.wrap(inner, auto_lengths(model.cfg.group_size, auto_max_draft(inner)))
    cached = args.cached or [auto_costs.cached_tokens(model.cfg, c, drafter) for c in args.contexts]
    if len(cached) != len(args.contexts):
        p.error("--cached takes one number per context")
    rows = []
    begin = time.perf_counter()
    for context, tokens in [pair for pair in zip(args.contexts, cached) for _ in range(args.profiles)]:
        phases: dict = {}
        start = time.perf_counter()
        width = auto_costs.profile_width(drafter, max(context, tokens), args.steps)
        step_s = auto_costs.profile_step_costs(model.cfg, model.params, drafter, inner_params,
                                               args.batch_size, context=tokens, steps=args.steps,
                                               rounds=args.rounds, budget_s=args.budget_s,
                                               phases=phases, width=width,
                                               fill=False if args.prefill_context else None)
        rows.append({"context": context, "cached": tokens, "width": width,
                     "total_s": round(time.perf_counter() - start, 1),
                     "first_call_s": round(phases.get("first_call_s", 0.0), 1),
                     "timed_s": round(phases.get("timed_s", 0.0), 1),
                     "step_ms": [round(s * 1e3, 2) for s in step_s],
                     "ratios": [round(s / step_s[0], 3) for s in step_s],
                     "ratio_spread": [round(x, 3) for x in phases.get("ratio_spread", [])],
                     "rounds": phases.get("rounds"),
                     "call_ms": round(phases.get("call_s", 0.0) * 1e3, 2)})
    total = time.perf_counter() - begin
    print(json.dumps({"model": args.model, "draft": args.draft, "batch_size": args.batch_size,
                      "prefill_context": args.prefill_context,
                      "lengths": list(drafter.lengths), "steps": args.steps, "rounds": args.rounds,
                      "total_s": round(total, 1), "contexts": rows}))

if __name__ == "__main__":
    main()
