"""`specjax merge`: one output file from the parts a job of several processes wrote.

    specjax merge --out out.jsonl --parts 2 [--prompts prompts.jsonl]

Each process of `specjax generate --coordinator ...` writes `out.process-I-of-N.jsonl`
(`specjax.distributed.part_path`); this writes `out.jsonl` with every row once, in the prompt
file's order when --prompts is given (and checks that every prompt has its row), else part by
part.
"""
from __future__ import annotations

import sys

from specjax.cli.options import add_subcommand, check_output_path, int_at_least
from specjax.distributed import merge_parts
from specjax.prompt_io import read_prompts


def add_parser(sub) -> None:
    p = add_subcommand(sub, "merge", "merge the output parts of a job run by several processes")
    p.add_argument("--out", required=True, help="the --out the processes were given; written")
    p.add_argument("--parts", required=True, type=int_at_least(1), metavar="N",
                   help="processes the job ran as (--num-processes of generate)")
    p.add_argument("--prompts", help="the job's prompt file: rows in its order, every id checked "
                   "(default: rows part by part, unchecked against the prompts)")
    p.set_defaults(func=cmd_merge)


def cmd_merge(args) -> int:
    check_output_path(args.out, "--out")
    order = [row["id"] for row in read_prompts(args.prompts)] if args.prompts else None
    count = merge_parts(args.out, args.parts, order)
    print(f"{count} rows from {args.parts} parts -> {args.out}", file=sys.stderr)
    return 0
