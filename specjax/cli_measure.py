"""Measurement subcommands of the CLI: `specjax bench`, `specjax profile`, `specjax tune`.

Registered by `specjax.cli.build_parser`; heavy imports happen inside the commands.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys

from specjax.cli import (
    InputError,
    add_draft_args,
    add_model_args,
    add_sampling_args,
    check_draft_spec,
    draft_shape,
)
from specjax.cli_options import check_output_path, non_negative_int, num_draft, positive_int

DATASET_HELP = ("prompt set: a JSONL file (Spec-Bench/MT-bench rows or {'prompt'} rows), "
                "mtbench | humaneval | gsm8k (when their packages are installed), "
                "or synthetic[:N[:LEN]]")


#: output options of the measurement commands: dest -> (option, is a folder)
OUTPUT_OPTIONS = {"json_out": ("--json", False), "out": ("--out", False), "plots": ("--plots", True)}


def _ints(text: str | None, option: str) -> tuple[int, ...] | None:
    """Comma-separated integers >= 1 (None when not given); an InputError names `option`."""
    if not text:
        return None
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise InputError(f"{option}: expected comma-separated integers >= 1, got {text!r}")
    return values


def _draft_lengths(text: str | None, option: str) -> tuple[int, ...] | None:
    """_ints, each a draft length in [1, MAX_DRAFT_NODES]."""
    from specjax.tree import check_num_draft

    values = _ints(text, option)
    return values and tuple(check_num_draft(d, option) for d in values)


def _check_outputs(args) -> None:
    """Each output option the command was given must be writable before the work starts."""
    for dest, (option, folder) in OUTPUT_OPTIONS.items():
        if getattr(args, dest, None):
            check_output_path(getattr(args, dest), option, folder=folder)


@contextlib.contextmanager
def _writing(path: str):
    """Turns an OSError while writing the output `path` (a full disk, ...) into an InputError
    naming it."""
    try:
        yield
    except OSError as e:
        raise InputError(f"cannot write {path}: {e.strerror or e}") from None


def _names(text: str | None) -> tuple[str, ...]:
    return tuple(x for x in (text or "").split(",") if x)


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _rows(args):
    """The --dataset rows kept by --categories / --per-category; an InputError when none are."""
    from specjax.datasets import load_prompt_set, select_rows

    rows = select_rows(load_prompt_set(args.dataset), _names(args.categories) or None, args.per_category)
    if not rows:
        raise InputError(f"--dataset {args.dataset}: no prompts to run")
    return rows


def _run_config(args, model, batch_size: int):
    from specjax.bench import RunConfig
    from specjax.drafters.forced import is_forced

    tok = model.tokenizer
    stops = tok.stop_sequences(args.stop) if tok is not None and args.stop else ()
    return RunConfig(
        max_new_tokens=args.max_new_tokens, batch_size=batch_size, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop_token_seqs=tuple(stops),
        ignore_eos=args.ignore_eos or is_forced(args.draft),
    )


def _add_dataset_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset", required=True, help=DATASET_HELP)
    p.add_argument("--categories", help="comma-separated categories to keep (default: all)")
    p.add_argument("--per-category", type=positive_int, default=None,
                   help="first N prompts of each category")
    p.add_argument("--ignore-eos", action="store_true",
                   help="rows run to --max-new-tokens (implied by --draft forced:...)")


# ---------------------------------------------------------------------------------------------


def cmd_bench(args) -> int:
    from specjax.bench import make_any_drafter, run_bench, summary_lines, write_json, write_plots
    from specjax.drafters.forced import is_forced
    from specjax.profile import load_target

    if not args.draft:
        raise InputError("bench needs --draft (the baseline is plain decoding)")
    tree = draft_shape(args)
    _check_outputs(args)
    rows = _rows(args)
    model = load_target(args.model, args.dtype)
    drafter, params = make_any_drafter(args.draft, tree, model, args.dtype)
    report = run_bench(
        model, rows, drafter, params, _run_config(args, model, args.batch_size),
        chat=not args.no_chat, repeats=args.repeats, ideal=args.ideal or is_forced(args.draft),
        config={"model": args.model, "draft": args.draft, "dataset": args.dataset,
                "per_category": args.per_category, "dtype": args.dtype},
        command=sys.argv, log=_say,
    )
    for line in summary_lines(report):
        print(line)
    if args.json_out:
        with _writing(args.json_out):
            write_json(report, args.json_out)
    if args.plots:
        with _writing(args.plots):
            for path in write_plots(report, args.plots):
                _say(f"wrote {path}")
    return 0


def cmd_profile(args) -> int:
    from specjax.bench import make_any_drafter
    from specjax.profile import load_target, profile_latency
    from specjax.tree import chain

    tokens = _ints(args.tokens, "--tokens") or tuple(range(1, args.max_tokens + 1))
    batch_sizes = _ints(args.batch_sizes, "--batch-sizes")
    draft_lengths = _draft_lengths(args.draft_lengths, "--draft-lengths") or (1, 2, 4, 8)
    if args.draft:
        check_draft_spec(args.draft)
    _check_outputs(args)
    model = load_target(args.model, args.dtype)
    drafters = {}
    if args.draft:
        for d in draft_lengths:
            drafters[str(d)] = make_any_drafter(args.draft, chain(d), model, args.dtype)
    prof = profile_latency(
        model, batch_sizes, tokens, drafters, context=args.context,
        repeats=args.repeats, steps=not args.no_step_profile, log=_say,
    )
    text = json.dumps(prof.to_dict(), indent=2)
    if args.json_out:
        from pathlib import Path

        with _writing(args.json_out):
            Path(args.json_out).write_text(text + "\n", encoding="utf-8")
    else:
        print(text)
    return 0


def cmd_tune(args) -> int:
    from specjax.bench import encode_rows, write_json
    from specjax.profile import load_target
    from specjax.schedule import Schedule
    from specjax.tree import load_tree
    from specjax.tune import TuneConfig, tune

    batch_sizes = _ints(args.batch_sizes, "--batch-sizes")
    draft_lengths = _draft_lengths(args.draft_lengths, "--draft-lengths")
    for name in _names(args.trees):
        load_tree(name)
    check_draft_spec(args.draft)
    _check_outputs(args)
    rows = _rows(args)
    model = load_target(args.model, args.dtype)
    tc = TuneConfig(
        batch_sizes=batch_sizes, max_draft=args.max_draft,
        draft_lengths=draft_lengths, trees=_names(args.trees),
        calib_batch_size=args.batch_size, profile_repeats=args.profile_repeats,
        step_profile=not args.no_step_profile, check=args.check, sweep=args.sweep, dtype=args.dtype,
        measure_repeats=args.measure_repeats, calibrate_each=not args.calibrate_once,
    )
    report = tune(model, encode_rows(model, rows, not args.no_chat), args.draft,
                  _run_config(args, model, args.batch_size), tc, log=_say, model_name=args.model)
    report["command"] = sys.argv
    schedule = Schedule.from_dict(report["schedule"])
    for b in schedule.buckets:
        print(f"batch size <= {b.batch_size}: draft {b.label} "
              f"(predicted {b.extra['predicted_tokens_per_s']:.1f} tok/s)")
    if args.out:
        with _writing(args.out):
            schedule.save(args.out, header=f"written by: {' '.join(sys.argv)}")
        _say(f"wrote {args.out}")
    if args.json_out:
        with _writing(args.json_out):
            write_json(report, args.json_out)
    return 0


def add_subcommands(sub) -> None:
    """Adds bench, profile and tune to the `specjax` subparsers."""
    bench = sub.add_parser("bench", help="speculative vs plain decoding per category (JSON, plots)")
    add_model_args(bench)
    add_draft_args(bench)
    add_sampling_args(bench)
    _add_dataset_args(bench)
    bench.add_argument("--json", dest="json_out", help="write the report (schema: specjax.bench v1)")
    bench.add_argument("--plots", help="folder for PNG plots (needs the `plots` extra)")
    bench.add_argument("--repeats", type=positive_int, default=1, help="timed passes over the prompts")
    bench.add_argument("--ideal", action="store_true",
                       help="profile step costs for the ideal speedup and system efficiency "
                            "(always on for --draft forced:...)")
    bench.set_defaults(func=cmd_bench)

    prof = sub.add_parser("profile", help="latency curves T_target(B, T), T_draft(B, D), T_step")
    add_model_args(prof)
    prof.add_argument("--batch-sizes", default="1,4")
    prof.add_argument("--max-tokens", type=positive_int, default=16, help="T = 1..T_max")
    prof.add_argument("--tokens", help="explicit comma-separated T values")
    prof.add_argument("--draft", help="drafter spec to time (ngram, forced:0.8, ...)")
    prof.add_argument("--draft-lengths", help="comma-separated D values (default 1,2,4,8)")
    prof.add_argument("--context", type=positive_int, default=256, help="tokens already in the cache")
    prof.add_argument("--repeats", type=positive_int, default=5)
    prof.add_argument("--no-step-profile", action="store_true", help="skip T_step")
    prof.add_argument("--json", dest="json_out")
    prof.set_defaults(func=cmd_profile)

    tune = sub.add_parser("tune", help="pick the draft length per batch size; write a schedule")
    add_model_args(tune)
    add_sampling_args(tune)
    _add_dataset_args(tune)
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
