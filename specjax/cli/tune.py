"""`specjax tune`: pick the draft shape per batch size from measured costs; write a schedule."""
from __future__ import annotations

import sys

from specjax.cli.options import (
    DRAFTER_HELP,
    add_dataset_args,
    add_mesh_arg,
    add_model_args,
    add_renamed_option,
    add_sampling_args,
    add_subcommand,
    check_draft_spec,
    check_outputs,
    dataset_rows,
    draft_length_list,
    int_list,
    mesh_shardings,
    name_list,
    non_negative_int,
    num_draft,
    positive_int,
    run_config,
    say,
    writing_output,
)
from specjax.measure import profile as measure_profile
from specjax.measure.bench import encode_rows, write_json
from specjax.measure.tune import TuneConfig, tune
from specjax.schedule import Schedule
from specjax.tree import load_tree


def cmd_tune(args) -> int:
    batch_sizes = int_list(args.batch_sizes, "--batch-sizes")
    draft_lengths = draft_length_list(args.draft_lengths, "--draft-lengths")
    for name in name_list(args.trees):
        load_tree(name)
    check_draft_spec(args.draft)
    check_outputs(args)
    rows = dataset_rows(args)
    model = measure_profile.load_target(args.model, args.dtype,
                                        shardings=mesh_shardings(args)[1], quantize=args.quantize)
    tc = TuneConfig(
        batch_sizes=batch_sizes, max_draft=args.max_draft,
        draft_lengths=draft_lengths, trees=name_list(args.trees),
        calib_batch_size=args.batch_size, profile_repeats=args.profile_repeats,
        step_profile=not args.no_step_profile, check=args.check, sweep=args.sweep, dtype=args.dtype,
        measure_repeats=args.measure_repeats, calibrate_each=not args.calibrate_once,
    )
    report = tune(model, encode_rows(model, rows, not args.no_chat), args.draft,
                  run_config(args, model, args.batch_size), tc, log=say, model_name=args.model,
                  progress=True)
    report["command"] = sys.argv
    schedule = Schedule.from_dict(report["schedule"])
    for entry in schedule.entries:
        print(f"batch size <= {entry.batch_size}: draft {entry.shape.label} "
              f"(predicted {entry.extra['predicted_tokens_per_s']:.1f} tok/s)")
    if args.out:
        with writing_output(args.out):
            schedule.save(args.out, header=f"written by: {' '.join(sys.argv)}")
        say(f"wrote {args.out}")
    if args.report:
        with writing_output(args.report):
            write_json(report, args.report)
    return 0


def add_parser(sub) -> None:
    tune = add_subcommand(sub, "tune", "pick the draft length per batch size; write a schedule")
    add_model_args(tune)
    add_mesh_arg(tune)
    add_sampling_args(tune, batch_size_help="prompts per batch of the calibration runs (the "
                      "candidates are measured at each of --batch-sizes)")
    add_dataset_args(tune)
    tune.add_argument("--draft", required=True, help=DRAFTER_HELP + ", whose draft shape is tuned")
    tune.add_argument("--batch-sizes", default="1,4,16,64",
                      help="comma-separated batch sizes to pick a draft shape for")
    tune.add_argument("--max-draft", type=num_draft, default=32,
                      help="the longest chain considered (and calibrated)")
    tune.add_argument("--draft-lengths", help="comma-separated chain lengths D to consider "
                      "(default: 1..8, then 10, 12, 16, ... up to --max-draft)")
    tune.add_argument("--trees", help="comma-separated tree presets to consider too (default: none)")
    tune.add_argument("--out", help="schedule YAML for `generate --tuned` (default: the picks "
                      "are only printed)")
    tune.add_argument("--report", help="full tuning report as JSON (default: none)")
    add_renamed_option(tune, "--json", "--report", dest="report")
    tune.add_argument("--check", type=non_negative_int, default=3,
                      help="run the best N predictions for real and pick the fastest (0: skip)")
    tune.add_argument("--sweep", action="store_true", help="run every candidate for real")
    tune.add_argument("--profile-repeats", type=positive_int, default=5,
                      help="timed runs per latency point (median)")
    tune.add_argument("--measure-repeats", type=positive_int, default=3,
                      help="passes over the prompts per measured candidate (each batch's "
                           "median time counts; step costs are re-profiled before each pass)")
    tune.add_argument("--no-step-profile", action="store_true",
                      help="rank by T_target + T_draft instead of the measured whole step T_step")
    tune.add_argument("--calibrate-once", action="store_true",
                      help="calibrate from one chain of --max-draft (faster; underestimates short "
                           "chains) instead of one run per candidate")
    tune.set_defaults(func=cmd_tune)
