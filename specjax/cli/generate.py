"""`specjax generate`: completions for a prompt or a JSONL prompt file (optionally speculative)."""
from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence

import numpy as np

from specjax import api
from specjax.cli.options import (
    InputError,
    add_draft_args,
    add_mesh_arg,
    add_model_args,
    add_process_args,
    add_sampling_args,
    add_subcommand,
    check_output_path,
    draft_auto,
    draft_shape,
    int_at_least,
    load_tuned,
    make_draft,
    mesh_shardings,
    process_spec_of,
)
from specjax.distributed import part_path, process_share, processes_any
from specjax.metrics import job_summary
from specjax.models import hub
from specjax.progress import progress_bar
from specjax.prompt_io import (
    append_rows,
    check_unique_ids,
    damage_report,
    open_output,
    output_row,
    read_prompts,
    repair_output,
    scan_output,
    trim_torn_tail,
)
from specjax.sharding import spans_processes
from specjax.timing import JobStats, job_stats


def skip_row(message: str) -> None:
    """--skip-bad-rows: a bad row is logged (its file:line and the problem) and left out."""
    print(f"specjax: skipped {message}", file=sys.stderr)


def generate_rows(args) -> list[dict]:
    """The prompt rows of --prompt or --prompts (with --skip-bad-rows, the good ones)."""
    if args.prompt is None:
        if args.skip_bad_rows:
            return unique_rows(read_prompts(args.prompts, on_bad=skip_row))
        return read_prompts(args.prompts)
    if not args.prompt.strip():
        raise InputError("--prompt is empty")
    return [{"id": 0, "category": None, "prompt": args.prompt, "where": "--prompt"}]

def rows_to_generate(rows: list[dict], args) -> list[dict]:
    """The rows still to generate: with --resume, those whose id is not yet a finished row of
    --out, after repairing --out (a torn tail or corrupt lines: reported, dropped, regenerated)."""

    if not args.resume:
        if args.out:
            trim_torn_tail(args.out)
        return rows
    check_unique_ids(rows)
    scan = scan_output(args.out)
    if scan.damaged:
        print(damage_report(args.out, scan), file=sys.stderr)
        saved = repair_output(args.out, scan)
        print(f"resume: the dropped bytes are saved in {saved}", file=sys.stderr)
    todo = [r for r in rows if r["id"] not in scan.ids]
    if len(todo) < len(rows):
        print(f"resume: {len(rows) - len(todo)} of {len(rows)} rows already in {args.out}", file=sys.stderr)
    return todo

def unique_rows(rows: list[dict]) -> list[dict]:
    """--skip-bad-rows: rows whose id an earlier row has are logged and left out."""
    first_seen: dict = {}
    kept = []
    for row in rows:
        if row["id"] in first_seen:
            skip_row(f"{row['where']}: id {row['id']!r} is also the id of {first_seen[row['id']]}")
            continue
        first_seen[row["id"]] = row["where"]
        kept.append(row)
    return kept


def row_limits(rows: list[dict], args) -> int | list[int]:
    """--max-new-tokens, or each row's own max_new_tokens where a row gives one."""
    if not any("max_new_tokens" in r for r in rows):
        return args.max_new_tokens
    return [r.get("max_new_tokens", args.max_new_tokens) for r in rows]


def fitting_rows(rows: list[dict], model, drafter, schedule, args) -> list[dict]:
    """--skip-bad-rows: the rows the model can run (`api.text_prompt_problems`); the others
    (empty once tokenized, too long for the model's context with their max_new_tokens and
    the draft) are logged and left out."""
    trees = [drafter.tree] if drafter is not None else []
    if schedule is not None:
        trees += [entry.shape.tree_spec for entry in schedule.entries]
    margin = max([api.draft_margin(t) for t in trees] or [0])
    problems = api.text_prompt_problems(model, [r["prompt"] for r in rows],
                                        max_new_tokens=row_limits(rows, args),
                                        chat=not args.no_chat, margin=margin)
    for row, problem in zip(rows, problems):
        if problem is not None:
            skip_row(f"{row['where']}: the prompt {problem}")
    return [r for r, problem in zip(rows, problems) if problem is None]


def id_list(ids: Sequence, limit: int = 20) -> str:
    shown = ", ".join(map(repr, ids[:limit]))
    return shown + (f" and {len(ids) - limit} more" if len(ids) > limit else "")

def rows_wanted_anywhere(rows: list[dict], todo: list[dict]) -> list[dict]:
    """The rows (in `rows`' order) that this process or another still has to generate: every
    process of a job on one mesh must run the same batches."""
    todo_ids = {r["id"] for r in todo}
    wanted = np.array([r["id"] in todo_ids for r in rows])
    return [r for r, w in zip(rows, processes_any(wanted)) if w]


def cmd_generate_on_ray(args) -> int:
    """--ray N: the job on a pool of N Ray Data actors (`specjax.ray`), rows in the prompt
    file's order."""
    if args.prompts is None or args.out is None or args.resume:
        raise InputError("--ray runs a --prompts file into a new --out (no --resume)")
    draft_shape(args)  # --draft / --num-draft / --tree / --tuned checked before Ray starts
    load_tuned(args)
    check_output_path(args.out, "--out")
    import specjax.ray  # the optional ray extra, only this option needs it

    count = specjax.ray.run_job(
        args.prompts, args.out, actors=args.ray, block_rows=args.batch_size, model=args.model,
        dtype=args.dtype, mesh=args.mesh, quantize=args.quantize,
        max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=args.stop,
        chat=not args.no_chat, batch_size=args.batch_size, draft=args.draft,
        num_draft=None if args.tree else args.num_draft, tree=args.tree, schedule=args.tuned)
    print(f"{count} rows from {args.ray} Ray actors -> {args.out}", file=sys.stderr)
    return 0


def cmd_generate(args) -> int:
    if args.ray:
        return cmd_generate_on_ray(args)
    processes = process_spec_of(args)
    if processes.is_multi and not args.out:
        raise InputError("several processes need --out (each writes its own part of it)")
    rows = generate_rows(args)
    tree = draft_shape(args)
    schedule = load_tuned(args)
    mesh, shardings = mesh_shardings(args)
    one_program = spans_processes(mesh)  # else each process runs its share on its own devices
    owned = rows
    if processes.is_multi:
        owned = process_share(rows, processes)
        args.out = str(part_path(args.out, processes))
    if args.out:
        check_output_path(args.out, "--out")
    todo = rows_to_generate(owned, args)
    if one_program:  # every process runs every batch: the rows any process still needs
        todo = rows_wanted_anywhere(rows, todo)
    if not todo:
        return 0
    owned_ids = {r["id"] for r in owned}
    model = hub.load_model(args.model, dtype=args.dtype, shardings=shardings,
                           quantize=args.quantize)
    drafter, drafter_params = make_draft(args, tree, model)
    if args.skip_bad_rows:
        todo = fitting_rows(todo, model, drafter, schedule, args)
        if not todo:
            return 0
    out_fd = open_output(args.out) if args.out else None
    stats, spec_rows, error_ids = JobStats(), [], []
    try:
        bar = progress_bar(total=len(todo), desc="generate", unit="prompt")
        batches = api.iter_generate(
            model, [r["prompt"] for r in todo], max_new_tokens=row_limits(todo, args),
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
            stop=args.stop, chat=not args.no_chat, batch_size=args.batch_size, draft=drafter,
            drafter_params=drafter_params, labels=[r["where"] for r in todo],
            prompt_ids=[r["id"] for r in todo],
            schedule=schedule, mesh=mesh, refill=not args.no_refill,
            ordered=out_fd is None,  # a file takes each chunk's rows as they end (ids tell them apart)
            num_draft="auto" if draft_auto(args) else None,
        )
        for first, gens in batches:
            records = [output_row(row, gen) for row, gen in zip(todo[first:], gens)
                       if row["id"] in owned_ids]
            if out_fd is None:
                for gen in gens:
                    print(gen.completion)
            else:
                append_rows(out_fd, records, args.out)
            stats += job_stats(gens)  # the whole batch's, on a mesh across processes
            spec_rows += [gen.spec for gen in gens if gen.spec is not None]
            error_ids += [r["id"] for r in records if r["stop_reason"] == "error"]
            bar.update(len(gens))
            bar.set_postfix(tok_s=f"{stats.tokens_per_s:.1f}")
        bar.close()
    finally:
        if out_fd is not None:
            os.close(out_fd)
    print(f"{len(todo)} prompt{'s' * (len(todo) != 1)}: {stats.line()}", file=sys.stderr)
    if spec_rows:
        summary = job_summary(spec_rows)
        print("spec: " + json.dumps({k: summary[k] for k in (
            "acceptance_length", "acceptance_rate", "steps", "drafted", "accepted",
            "conditional_acceptance")}), file=sys.stderr)
    if error_ids:
        print(f'specjax: error: {len(error_ids)} row(s) ended with stop_reason "error" (the target\'s '
              f"logits were not finite): ids {id_list(error_ids)}", file=sys.stderr)
        return 1
    return 0


def add_parser(sub) -> None:
    gen = add_subcommand(sub, "generate", "generate completions (optionally speculative)")
    add_model_args(gen)
    add_mesh_arg(gen)
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="one prompt text")
    source.add_argument("--prompts", help="JSONL file: {'prompt'} or {'question_id','category','turns'} rows")
    gen.add_argument("--out", help="output JSONL, one row per prompt, appended as each chunk "
                     "(or batch, with --no-refill) finishes (default: completions printed on stdout)")
    gen.add_argument("--resume", action="store_true",
                     help="skip ids already in --out (a torn or corrupt line is regenerated)")
    gen.add_argument("--skip-bad-rows", action="store_true",
                     help="leave out a bad --prompts row (not JSON, no prompt, a duplicate id, "
                     "empty or too long for the model once tokenized) with its line and reason "
                     "on stderr (default: the first bad row stops the job before any work)")
    gen.add_argument("--no-refill", action="store_true",
                     help="static batches, each run to its slowest row (default: continuous "
                     "batching: chunks of up to 8 x --batch-size prompts, a batch slot taking "
                     "the next prompt as soon as its row ends, inside one program per chunk)")
    add_sampling_args(gen)
    add_draft_args(gen)
    add_process_args(gen)
    gen.add_argument("--ray", type=int_at_least(1), default=None, metavar="ACTORS",
                     help="run the --prompts job on Ray Data: ACTORS actors, each loading the "
                          "model once (a local Ray instance unless one is running; needs the "
                          "'ray' extra) (default: this process)")
    gen.add_argument("--tuned", help="draft schedule YAML from `specjax tune --out` (the batch "
                     "size picks the draft shape; its drafter is used when --draft is not given; "
                     "default: none)")
    gen.set_defaults(func=cmd_generate)
