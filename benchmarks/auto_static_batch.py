"""Plain vs a static chain vs auto on one Spec-Bench category in a static batch: decode seconds,
steps, and auto's predicted tokens and seconds against what it took.

    python benchmarks/auto_static_batch.py --draft suffix --batch 8 --category extraction \
        --max-new 48 --repeats 3 [--num-draft 1]

SmolLM2-135M f32, greedy, the category's first B prompts (chat template), `refill=False` (the
prefill timed apart). Modes in turn, a warm-up pass first (compiles), then `--repeats` passes;
prints each mode's decode seconds, its decoding steps and ms a step (medians), and auto's shape
histogram, acceptance length, predicted tokens / seconds (`metrics.job_summary`) beside the
decode tokens (every row's tokens after its first) and seconds measured. What showed that auto's
tokens/s pick lost in a static batch whose rows drift apart (docs/measure_and_tune.md, "auto").
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from adaptive import DEFAULT_PROMPTS, category_prompts

from specjax.api import generate_ids
from specjax.metrics import job_summary
from specjax.models.hub import load_model
from specjax.timing import job_stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft", default="suffix")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--category", default="extraction")
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument("--num-draft", type=int, default=1, help="the static chain's length")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", default=str(DEFAULT_PROMPTS))
    args = ap.parse_args()
    model = load_model("smollm2-135m", dtype="float32")
    prompts = category_prompts(model.tokenizer, args.prompts, 1024)[args.category][:args.batch]
    print("prompt lengths", [len(p) for p in prompts])
    modes = {"plain": {}, f"D={args.num_draft}": {"draft": args.draft, "num_draft": args.num_draft},
             "auto": {"draft": args.draft}}
    runs: dict[str, list] = {name: [] for name in modes}
    for rep in range(args.repeats + 1):  # pass 0 compiles
        for name, options in modes.items():
            out = generate_ids(model.cfg, model.params, prompts, max_new_tokens=args.max_new,
                               batch_size=args.batch, refill=False, **options)
            if rep:
                runs[name].append((job_stats(out), out))
    for name, passes in runs.items():
        decode = [stats.decode_s for stats, _ in passes]
        stats, out = passes[0]
        steps = max(r.spec["steps"] if r.spec else len(r.token_ids) - 1 for r in out)
        print(f"{name}: decode s {[round(d, 3) for d in decode]}, {steps} steps, "
              f"{1e3 * statistics.median(decode) / steps:.2f} ms/step, "
              f"{stats.new_tokens - len(out)} decode tokens")
    stats, out = runs["auto"][0]
    summary = job_summary([r.spec for r in out])
    decode_s = statistics.median(stats.decode_s for stats, _ in runs["auto"])
    print(f"auto: shapes {summary['shape_histogram']}, acceptance length "
          f"{summary['acceptance_length']:.3f}; predicted {summary['predicted_tokens']:.1f} tokens "
          f"in {summary['predicted_s']:.3f} s, took {stats.new_tokens - len(out)} in {decode_s:.3f} s")


if __name__ == "__main__":
    main()
