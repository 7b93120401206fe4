"""`specjax bench`: speculative vs plain decoding per category (JSON report, plots)."""
from __future__ import annotations

import dataclasses
import sys

from specjax.cli.options import (
    add_dataset_args,
    add_draft_args,
    add_mesh_arg,
    add_model_args,
    add_renamed_option,
    add_sampling_args,
    add_subcommand,
    check_outputs,
    dataset_rows,
    draft_auto,
    draft_shape,
    mesh_shardings,
    positive_int,
    run_config,
    say,
    writing_output,
)
from specjax.drafters.forced import is_forced
from specjax.measure import bench as measure_bench
from specjax.measure import profile as measure_profile
from specjax.measure.plots import write_plots


def cmd_bench(args) -> int:
    tree = draft_shape(args)
    check_outputs(args)
    rows = dataset_rows(args)
    model = measure_profile.load_target(args.model, args.dtype,
                                        shardings=mesh_shardings(args)[1], quantize=args.quantize)
    drafter, params = measure_bench.make_any_drafter(args.draft, tree, model, args.dtype,
                                                     auto=draft_auto(args))
    report = measure_bench.run_bench(
        model, rows, drafter, params,
        dataclasses.replace(run_config(args, model, args.batch_size), auto=draft_auto(args)),
        chat=not args.no_chat, repeats=args.repeats, ideal=args.ideal or is_forced(args.draft),
        config={"model": args.model, "draft": args.draft, "dataset": args.dataset,
                "per_category": args.per_category, "dtype": args.dtype},
        command=sys.argv, log=say, progress=True,
    )
    for line in measure_bench.summary_lines(report):
        print(line)
    if args.out:
        with writing_output(args.out):
            measure_bench.write_json(report, args.out)
    if args.plots:
        with writing_output(args.plots):
            for path in write_plots(report, args.plots):
                say(f"wrote {path}")
    return 0


def add_parser(sub) -> None:
    bench = add_subcommand(sub, "bench",
                           "speculative vs plain decoding per category (JSON report, plots)")
    add_model_args(bench)
    add_mesh_arg(bench)
    add_draft_args(bench, required=True)
    add_sampling_args(bench)
    add_dataset_args(bench)
    bench.add_argument("--out", help="JSON report (schema specjax.bench v1; default: the summary "
                       "table on stdout only)")
    add_renamed_option(bench, "--json", "--out", dest="out")
    bench.add_argument("--plots", help="folder for PNG plots (needs the `plots` extra; "
                       "default: no plots)")
    bench.add_argument("--repeats", type=positive_int, default=1, help="timed passes over the prompts")
    bench.add_argument("--ideal", action="store_true",
                       help="profile step costs for the ideal speedup and system efficiency "
                            "(always on for --draft forced:...)")
    bench.set_defaults(func=cmd_bench)
