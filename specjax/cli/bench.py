"""`specjax bench`: speculative vs plain decoding per category (JSON report, plots)."""
from __future__ import annotations

import sys

from specjax.cli.options import (
    InputError,
    add_dataset_args,
    add_draft_args,
    add_model_args,
    add_sampling_args,
    check_outputs,
    dataset_rows,
    draft_shape,
    positive_int,
    run_config,
    say,
    writing_output,
)


def cmd_bench(args) -> int:
    from specjax.drafters.forced import is_forced
    from specjax.measure.bench import (
        make_any_drafter,
        run_bench,
        summary_lines,
        write_json,
        write_plots,
    )
    from specjax.measure.profile import load_target

    if not args.draft:
        raise InputError("bench needs --draft (the baseline is plain decoding)")
    tree = draft_shape(args)
    check_outputs(args)
    rows = dataset_rows(args)
    model = load_target(args.model, args.dtype)
    drafter, params = make_any_drafter(args.draft, tree, model, args.dtype)
    report = run_bench(
        model, rows, drafter, params, run_config(args, model, args.batch_size),
        chat=not args.no_chat, repeats=args.repeats, ideal=args.ideal or is_forced(args.draft),
        config={"model": args.model, "draft": args.draft, "dataset": args.dataset,
                "per_category": args.per_category, "dtype": args.dtype},
        command=sys.argv, log=say,
    )
    for line in summary_lines(report):
        print(line)
    if args.json_out:
        with writing_output(args.json_out):
            write_json(report, args.json_out)
    if args.plots:
        with writing_output(args.plots):
            for path in write_plots(report, args.plots):
                say(f"wrote {path}")
    return 0


def add_parser(sub) -> None:
    bench = sub.add_parser("bench", help="speculative vs plain decoding per category (JSON, plots)")
    add_model_args(bench)
    add_draft_args(bench)
    add_sampling_args(bench)
    add_dataset_args(bench)
    bench.add_argument("--json", dest="json_out", help="write the report (schema: specjax.bench v1)")
    bench.add_argument("--plots", help="folder for PNG plots (needs the `plots` extra)")
    bench.add_argument("--repeats", type=positive_int, default=1, help="timed passes over the prompts")
    bench.add_argument("--ideal", action="store_true",
                       help="profile step costs for the ideal speedup and system efficiency "
                            "(always on for --draft forced:...)")
    bench.set_defaults(func=cmd_bench)
