"""How many programs a `specjax generate` job compiles, decided on the host from the prompts'
lengths alone (nothing is compiled or run). With --no-refill (static batches) each distinct
batch shape (rows, prompt bucket, buffer width) compiles once, as two programs (prefill and
decode); a refilling job (the default) has ONE slot shape (the bucket of its longest prompt and
its max_new_tokens) per group of prompts of similar length (`api.length_groups`) and compiles
two programs per slot shape (its empty slots, and the chunk program every call of the group
runs), however many chunks it has.

    python benchmarks/job_programs.py --prompts ../shared/data/spec_bench/question.jsonl \
        [--model smollm2-135m] [--batch-size 8] [--max-new-tokens 128] [--num-draft 4] [--no-chat]

Prints one JSON object: static batches, distinct shapes and programs, each shape's batch count,
the prompt tokens prefilled (padding included) against the prompts' own, and the refilling
job's shape, calls, programs and prefilled tokens (one row per prompt, after a first pass of
all slots).
"""
from __future__ import annotations

import argparse
import collections
import json

from specjax.api import (
    batch_rows,
    batch_shape,
    bucket,
    chunk_capacity,
    draft_margin,
    job_shapes,
    length_groups,
)
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
        "refill": refill_job(lengths, args.batch_size, args.max_new_tokens, tree),
    }, indent=2))


def refill_job(lengths, batch_size: int, max_new_tokens: int, tree) -> dict:
    """The refilling job's length groups (`api.length_groups`: prompts, slot shape and calls of
    each), its programs (two per distinct slot shape) and prefilled tokens (each prompt at its
    group's prompt width; a group's first pass prefills all its slots)."""
    rows = batch_rows(batch_size, len(lengths))
    capacity = chunk_capacity(rows, len(lengths))
    groups, shapes, prefill = [], set(), 0
    extra = bucket(max_new_tokens) + draft_margin(tree)
    for group in length_groups(lengths, 2 * rows, extra):
        shape = batch_shape([lengths[i] for i in group], rows, max_new_tokens, tree)
        shapes.add(shape)
        prefill += (max(len(group) - rows, 0) + rows) * shape.prompt_width
        groups.append({"prompts": len(group), "prompt_width": shape.prompt_width,
                       "width": shape.width, "calls": -(-len(group) // capacity)})
    return {"slots": rows, "groups": groups, "programs": 2 * len(shapes), "prefill_tokens": prefill}


if __name__ == "__main__":
    main()
