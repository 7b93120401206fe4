"""`specjax profile`: latency curves T_target(B, T), T_draft(B, D), T_step(B, D)."""
from __future__ import annotations

import json

from specjax.cli.options import (
    DRAFTER_HELP,
    add_model_args,
    add_renamed_option,
    add_subcommand,
    check_draft_spec,
    check_outputs,
    draft_length_list,
    int_list,
    positive_int,
    say,
    writing_output,
)
from specjax.measure import profile as measure_profile
from specjax.measure.bench import make_any_drafter
from specjax.tree import chain


def cmd_profile(args) -> int:
    tokens = int_list(args.tokens, "--tokens") or tuple(range(1, args.max_tokens + 1))
    batch_sizes = int_list(args.batch_sizes, "--batch-sizes")
    draft_lengths = draft_length_list(args.draft_lengths, "--draft-lengths")
    if args.draft:
        check_draft_spec(args.draft)
    check_outputs(args)
    model = measure_profile.load_target(args.model, args.dtype, quantize=args.quantize)
    drafters = {}
    if args.draft:
        for d in draft_lengths:
            drafters[str(d)] = make_any_drafter(args.draft, chain(d), model, args.dtype)
    prof = measure_profile.profile_latency(
        model, batch_sizes, tokens, drafters, context=args.context,
        repeats=args.repeats, steps=not args.no_step_profile, log=say,
    )
    text = json.dumps(prof.to_dict(), indent=2)
    if args.out:
        from pathlib import Path

        with writing_output(args.out):
            Path(args.out).write_text(text + "\n", encoding="utf-8")
    else:
        print(text)
    return 0


def add_parser(sub) -> None:
    prof = add_subcommand(sub, "profile", "latency curves T_target(B, T), T_draft(B, D), T_step")
    add_model_args(prof)
    prof.add_argument("--batch-sizes", default="1,4", help="comma-separated batch sizes B")
    prof.add_argument("--max-tokens", type=positive_int, default=16,
                      help="time the target at T = 1..T_max tokens per row")
    prof.add_argument("--tokens", help="comma-separated T values (default: 1..--max-tokens)")
    prof.add_argument("--draft", help=DRAFTER_HELP + ", to time as T_draft(B, D) and T_step "
                      "(default: the target only)")
    prof.add_argument("--draft-lengths", default="1,2,4,8",
                      help="comma-separated draft lengths D to time with --draft")
    prof.add_argument("--context", type=positive_int, default=256, help="tokens already in the cache")
    prof.add_argument("--repeats", type=positive_int, default=5, help="timed runs per point (median)")
    prof.add_argument("--no-step-profile", action="store_true",
                      help="skip T_step(B, D), the timing of whole speculative steps")
    prof.add_argument("--out", help="write the JSON here (default: print it on stdout)")
    add_renamed_option(prof, "--json", "--out", dest="out")
    prof.set_defaults(func=cmd_profile)
