"""The most any n-gram (prompt-lookup) drafter can give on this target, from its own outputs.

    python benchmarks/ngram_ceiling.py [--categories summarization] [--per-category 10]
        [--max-new-tokens 128] [--out benchmarks/results/ngram_ceiling.json]

Greedy speculative decoding emits exactly the target's greedy tokens, so once those are known
the tokens any copying drafter gets accepted at each step follow from them alone: replaying a
drafter on the final output gives its acceptance length (AL) without running the target again.
Per category this script
  1. runs plain greedy decoding (SmolLM2-135M f32, batch 1, CPU) on each prompt, timing the
     whole call and a 1-token call (= prefill + first token, "TTFT");
  2. replays on those outputs: the `ngram` chain as specjax drafts it (longest suffix match,
     n in [1, 3], most recent occurrence; D = 4 and 8), trees branching on the best k matches
     with distinct first tokens, and the ORACLE: at each step the longest run of the future
     output that follows ANY earlier occurrence of the row's last token (every n >= 1 match,
     every depth up to 16, at once). No prompt-lookup drafter, chain or tree, accepts more.
     (Replayed AL counts emitted tokens; the engine's metrics, like vLLM's, also count drafts
     accepted past max_new_tokens in a row's last step, at most D per row more.)
  3. times one decoding step without and with the ngram chain (D = 4) at the mean prompt length
     (`specjax.measure.profile`, interleaved medians) for the verify-cost ratio;
  4. bounds the end-to-end speedup over plain decoding, tokens/s including prefill as in
     `benchmarks/spec_vs_ar.py`: with free verification and drafting,
        speedup <= (prefill + decode) / (prefill + decode / AL_oracle),
     and with the measured step costs, (prefill + decode) / (prefill + decode x ratio / AL).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

from specjax.drafters.ngram import NgramDrafter
from specjax.measure.bench import RunConfig, encode_by_category, generate_batches, warm_up
from specjax.measure.datasets import load_prompt_set, select_rows
from specjax.measure.profile import ar_step_timer, interleaved_medians, step_timer
from specjax.models.hub import load_model
from specjax.tree import chain

DEFAULT_PROMPTS = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "spec_bench" / "question.jsonl"
ORACLE_DEPTH = 16


def match_starts(context: np.ndarray, n_min: int, n_max: int) -> list[int]:
    """Continuation starts s (tokens context[s:] follow a match) ranked as specjax's ngram
    drafter ranks them: longest suffix match n in [n_min, n_max] first, then most recent."""
    length = len(context)
    ranked = []
    for n in range(n_max, n_min - 1, -1):
        if length <= n:
            continue
        suffix = context[length - n:]
        windows = np.lib.stride_tricks.sliding_window_view(context[: length - 1], n)  # [L - n, n]
        hits = np.flatnonzero(np.all(windows == suffix, axis=1)) + n  # starts s in [n, L - 1]
        ranked += [int(s) for s in hits[::-1] if s not in ranked]
    return ranked


def accepted_along(context: np.ndarray, start: int, future: np.ndarray, depth: int) -> int:
    """How many of the draft context[start : start + depth] (inside the row) equal `future`."""
    draft = context[start : start + depth]
    n = min(len(draft), len(future))
    miss = np.flatnonzero(draft[:n] != future[:n])
    return int(miss[0]) if miss.size else n


def tree_acceptance(context, future, depth: int, width: int, n_min: int = 1, n_max: int = 3) -> int:
    """Accepted tokens of a drafter proposing the best `width` matches (distinct first tokens)."""
    best, firsts = 0, set()
    for s in match_starts(context, n_min, n_max):
        first = int(context[s])
        if first in firsts:
            continue
        firsts.add(first)
        best = max(best, accepted_along(context, s, future, depth))
        if len(firsts) == width:
            break
    return best


def oracle_acceptance(context: np.ndarray, future: np.ndarray, depth: int = ORACLE_DEPTH) -> int:
    """Accepted tokens of the best continuation of any earlier occurrence of the last token."""
    starts = np.flatnonzero(context[:-1] == context[-1]) + 1  # [M]
    if starts.size == 0 or future.size == 0:
        return 0
    idx = starts[:, None] + np.arange(min(depth, future.size))[None, :]  # [M, d]
    inside = idx < len(context)
    equal = inside & (context[np.minimum(idx, len(context) - 1)] == future[None, : idx.shape[1]])
    return int(np.max(np.argmin(np.concatenate([equal, np.zeros_like(equal[:, :1])], 1), axis=1)))


def replay(prompt: list[int], output: list[int], propose_accept) -> tuple[int, int]:
    """(steps, accepted) of greedy speculative decoding that reproduces `output` when each step
    accepts `propose_accept(context, future)` tokens (then appends the target's own token).
    The first output token comes from the prefill, as in `specjax.loop`."""
    row = np.asarray(prompt + output, np.int64)
    pos, steps, accepted = 1, 0, 0
    while pos < len(output):
        context, future = row[: len(prompt) + pos], row[len(prompt) + pos :]
        got = min(propose_accept(context, future), len(future) - 1)
        steps, accepted, pos = steps + 1, accepted + got, pos + got + 1
    return steps, accepted


DRAFTERS = {
    "ngram chain D=4": lambda c, f: tree_acceptance(c, f, 4, 1),
    "ngram chain D=8": lambda c, f: tree_acceptance(c, f, 8, 1),
    "ngram tree 4x4": lambda c, f: tree_acceptance(c, f, 4, 4),
    "ngram tree 16x8": lambda c, f: tree_acceptance(c, f, 8, 16, n_max=5),
    "oracle": oracle_acceptance,
}


def acceptance_lengths(pairs: list[tuple[list[int], list[int]]]) -> dict[str, float]:
    """AL = 1 + accepted / steps of every replayed drafter over (prompt, output) pairs."""
    out = {}
    for name, fn in DRAFTERS.items():
        steps, accepted = map(sum, zip(*(replay(p, o, fn) for p, o in pairs)))
        out[name] = 1 + accepted / steps
    return out


def step_cost_ratio(model, context: int) -> dict:
    """Median seconds of one AR step and one ngram-chain(4) step at `context` cached tokens."""
    drafter = NgramDrafter(tree=chain(4))
    times = interleaved_medians({
        "ar": ar_step_timer(model.cfg, model.params, 1, context=context),
        "ngram4": step_timer(model.cfg, model.params, drafter, None, 1, context=context),
    }, repeats=15)
    return {"t_ar_ms": 1e3 * times["ar"], "t_ngram4_ms": 1e3 * times["ngram4"],
            "ratio": times["ngram4"] / times["ar"]}


def category_report(model, prompts: list[list[int]], run: RunConfig) -> dict:
    """Greedy outputs and timings of one category, the replayed ALs and the speedup bounds."""
    pairs, wall, ttft = [], [], []
    for ids in prompts:
        full = generate_batches(model, [ids], run, None, None, run.max_new_tokens)[0]
        first = generate_batches(model, [ids], run, None, None, 1)[0]
        pairs.append((list(ids), list(map(int, full.token_ids))))
        wall.append(full.time_s)
        ttft.append(first.time_s)
    prefill, decode = sum(ttft), sum(wall) - sum(ttft)
    als = acceptance_lengths(pairs)
    cost = step_cost_ratio(model, int(statistics.mean(len(p) for p in prompts)))
    total = prefill + decode
    return {
        "num_prompts": len(prompts), "mean_prompt_tokens": statistics.mean(len(p) for p in prompts),
        "new_tokens": sum(len(o) for _, o in pairs), "ar_tokens_per_s": sum(len(o) for _, o in pairs) / total,
        "prefill_share": prefill / total, "acceptance_length": als, "step_cost": cost,
        "speedup_bound_free_verify": {k: total / (prefill + decode / al) for k, al in als.items()},
        "speedup_bound_measured_cost": {
            k: total / (prefill + decode * cost["ratio"] / al) for k, al in als.items()},
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dataset", default=str(DEFAULT_PROMPTS))
    p.add_argument("--categories", nargs="*", default=["summarization"])
    p.add_argument("--per-category", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--out", default="benchmarks/results/ngram_ceiling.json")
    args = p.parse_args(argv)
    jax.config.update("jax_default_matmul_precision", "highest")

    model = load_model(args.model, dtype="float32")
    rows = select_rows(load_prompt_set(args.dataset), categories=args.categories, per_category=args.per_category)
    groups = encode_by_category(model, rows)
    run = RunConfig(max_new_tokens=args.max_new_tokens)
    warm_up(model, list(groups.values()), run, [(None, None)])
    report = {"device": jax.devices()[0].device_kind, "cpu_count": os.cpu_count(), "jax": jax.__version__,
              "date": time.strftime("%Y-%m-%d"), "command": ["python", "benchmarks/ngram_ceiling.py", *(argv or sys.argv[1:])],
              "max_new_tokens": args.max_new_tokens, "categories": {}}
    for name, prompts in groups.items():
        report["categories"][name] = category_report(model, prompts, run)
        print(f"{name}: done", file=sys.stderr)

    for name, r in report["categories"].items():
        c = r["step_cost"]
        print(f"\n{name}: {r['num_prompts']} prompts, mean {r['mean_prompt_tokens']:.0f} prompt tokens, "
              f"AR {r['ar_tokens_per_s']:.1f} tok/s, prefill {100 * r['prefill_share']:.0f} % of AR wall time; "
              f"step AR {c['t_ar_ms']:.1f} ms, ngram chain(4) {c['t_ngram4_ms']:.1f} ms ({c['ratio']:.2f}x)")
        print(f"{'drafter (replayed)':<20}{'AL':>7}{'bound, free verify':>20}{'at chain(4) step cost':>23}")
        for k, al in r["acceptance_length"].items():
            print(f"{k:<20}{al:>7.2f}{r['speedup_bound_free_verify'][k]:>19.2f}x"
                  f"{r['speedup_bound_measured_cost'][k]:>21.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
