"""How many programs a `specjax generate` job compiles, decided on the host from the prompts'
lengths alone (nothing is compiled or run): each distinct batch shape (rows, prompt bucket,
buffer width) compiles once, as two programs (prefill and decode).

    python benchmarks/job_programs.py --prompts ../shared/data/spec_bench/question.jsonl \
        [--model smollm2-135m] [--batch-size 8] [--max-new-tokens 128] [--num-draft 4] [--no-chat]

Prints one JSON object: batches, distinct shapes and programs, each shape's batch count, and the
prompt tokens prefilled (padding included) against the prompts' own.
"""
from __future__ import annotations

import argparse
import collections
import json

from specjax.api import job_shapes
from specjax.models.hub import load_model
from specjax.prompt_io import read_prompts
from specjax.tree import chain


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--num-draft", type=int, default=0, help="a draft chain's length (0: plain)")
    parser.add_argument("--no-chat", action="store_true")
    args = parser.parse_args()

    tokenizer = load_model(args.model).tokenizer
    encode = tokenizer.encode if args.no_chat else tokenizer.encode_chat
    lengths = [len(encode(row["prompt"])) for row in read_prompts(args.prompts)]
    tree = chain(args.num_draft) if args.num_draft else None
    shapes = job_shapes(lengths, args.batch_size, args.max_new_tokens, tree)
    counts = collections.Counter(shapes)
    print(json.dumps({
        "prompts": len(lengths), "batches": len(shapes), "shapes": len(counts),
        "programs": 2 * len(counts),
        "batches_per_shape": {f"rows {s.rows}, prompt {s.prompt_width}, width {s.width}": n
                              for s, n in sorted(counts.items(), key=lambda c: c[0].width)},
        "prefill_tokens": sum(s.rows * s.prompt_width for s in shapes),
        "prompt_tokens": sum(lengths),
    }, indent=2))


if __name__ == "__main__":
    main()
