"""`specjax tune`: pick the draft shape per batch size from measured costs; write a schedule."""
from __future__ import annotations

import sys

from specjax.cli.options import (
    add_dataset_args,
    add_model_args,
    add_sampling_args,
    check_draft_spec,
    check_outputs,
    dataset_rows,
    draft_length_list,
    int_list,
    name_list,
    non_negative_int,
    num_draft,
    positive_int,
    run_config,
    say,
    writing_output,
)


def cmd_tune(args) -> int:
    from specjax.measure.bench import encode_rows, write_json
    from specjax.measure.profile import load_target
    from specjax.measure.tune import TuneConfig, tune
    from specjax.schedule import Schedule
    from specjax.tree import load_tree

    batch_sizes = int_list(args.batch_sizes, "--batch-sizes")
    draft_lengths = draft_length_list(args.draft_lengths, "--draft-lengths")
    for name in name_list(args.trees):
        load_tree(name)
    check_draft_spec(args.draft)
    check_outputs(args)
    rows = dataset_rows(args)
    model = load_target(args.model, args.dtype)
    tc = TuneConfig(
        batch_sizes=batch_sizes, max_draft=args.max_draft,
        draft_lengths=draft_lengths, trees=name_list(args.trees),
        calib_batch_size=args.batch_size, profile_repeats=args.profile_repeats,
        step_profile=not args.no_step_profile, check=args.check, sweep=args.sweep, dtype=args.dtype,
        measure_repeats=args.measure_repeats, calibrate_each=not args.calibrate_once,
    )
    report = tune(model, encode_rows(model, rows, not args.no_chat), args.draft,
                  run_config(args, model, args.batch_size), tc, log=say, model_name=args.model)
    report["command"] = sys.argv
    schedule = Schedule.from_dict(report["schedule"])
    for b in schedule.buckets:
        print(f"batch size <= {b.batch_size}: draft {b.label} "
              f"(predicted {b.extra['predicted_tokens_per_s']:.1f} tok/s)")
    if args.out:
        with writing_output(args.out):
            schedule.save(args.out, header=f"written by: {' '.join(sys.argv)}")
        say(f"wrote {args.out}")
    if args.json_out:
        with writing_output(args.json_out):
            write_json(report, args.json_out)
    return 0


def add_parser(sub) -> None:
    tune = sub.add_parser("tune", help="pick the draft length per batch size; write a schedule")
    add_model_args(tune)
    add_sampling_args(tune)
    add_dataset_args(tune)
    tune.add_argument("--draft", required=True, help="drafter spec (ngram, suffix, forced:..., ...)")
    tune.add_argument("--batch-sizes", default="1,4,16,64")
    tune.add_argument("--max-draft", type=num_draft, default=32)
    tune.add_argument("--draft-lengths", help="comma-separated D to consider (default: a grid)")
    tune.add_argument("--trees", help="comma-separated tree presets to consider too")
    tune.add_argument("--out", help="schedule YAML for `generate --tuned`")
    tune.add_argument("--json", dest="json_out", help="full tuning report")
    tune.add_argument("--check", type=non_negative_int, default=3, help="run the best N for real (0: skip)")
    tune.add_argument("--sweep", action="store_true", help="run every candidate for real")
    tune.add_argument("--profile-repeats", type=positive_int, default=5)
    tune.add_argument("--measure-repeats", type=positive_int, default=3,
                      help="passes over the prompts per measured candidate (each batch's "
                           "median time counts; step costs are re-profiled before each pass)")
    tune.add_argument("--no-step-profile", action="store_true")
    tune.add_argument("--calibrate-once", action="store_true",
                      help="calibrate from one chain of --max-draft (faster; underestimates short "
                           "chains) instead of one run per candidate")
    tune.set_defaults(func=cmd_tune)
