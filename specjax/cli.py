"""Command line: `specjax generate ...` (and the subcommands registered by later modules)."""
from __future__ import annotations

import argparse
import codecs
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from specjax.cli_options import (
    InputError,
    check_output_path,
    non_empty_text,
    non_negative_float,
    num_draft,
    positive_int,
    probability,
    seed,
)

#: the chain length of --draft without --num-draft / --tree
DEFAULT_NUM_DRAFT = 4


# ---------------------------------------------------------------------------------------------
# Prompt files
# ---------------------------------------------------------------------------------------------


def prompt_row(record, where: str) -> dict:
    """Normalises one JSONL record to {"id", "category", "prompt"}.

    Accepts {"prompt": ...} (optional "id", "category") and Spec-Bench / MT-bench rows
    {"question_id", "category", "turns": [...]} (first turn).
    """
    if not isinstance(record, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "prompt" in record:
        prompt = record["prompt"]
    elif "turns" in record:
        turns = record["turns"]
        if not isinstance(turns, list) or not turns:
            raise InputError(f"{where}: 'turns' must be a non-empty list")
        prompt = turns[0]
    else:
        raise InputError(f"{where}: needs a 'prompt' or a 'turns' field")
    if not isinstance(prompt, str) or not prompt.strip():
        raise InputError(f"{where}: the prompt is empty")
    row_id = record.get("id", record.get("question_id", record.get("task_id")))
    if row_id is not None and (isinstance(row_id, bool) or not isinstance(row_id, (str, int))):
        raise InputError(f"{where}: the id must be a string or an integer, got {row_id!r}")
    return {"id": row_id, "category": record.get("category"), "prompt": prompt}


def read_prompts(path: str | os.PathLike) -> list[dict]:
    """Rows of a JSONL prompt file; ids default to the 0-based line number."""
    rows = []
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise InputError(f"cannot read prompts file {path}: {e.strerror}") from None
    for number, raw in enumerate(data.removeprefix(codecs.BOM_UTF8).split(b"\n"), 1):
        where = f"{path}:{number}"
        line = decoded_line(raw, where)
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{where}: not valid JSON ({e.msg})") from None
        row = prompt_row(record, where)
        row["id"] = number - 1 if row["id"] is None else row["id"]
        row["where"] = where
        rows.append(row)
    if not rows:
        raise InputError(f"{path}: no prompts")
    return rows


def decoded_line(raw: bytes, where: str) -> str:
    """One line of a text file as str; an InputError names `where` when it is not UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{where}: not UTF-8 text (byte {e.start + 1} of the line)") from None


def check_unique_ids(rows: Sequence[dict]) -> None:
    """--resume tells rows apart by id: an InputError names the first id that two rows share."""
    first_seen: dict = {}
    for row in rows:
        if row["id"] in first_seen:
            raise InputError(f"{row['where']}: id {row['id']!r} is also the id of "
                             f"{first_seen[row['id']]}; --resume needs unique ids")
        first_seen[row["id"]] = row["where"]


def output_row(row: dict, gen) -> dict:
    out = {
        "id": row["id"],
        "category": row.get("category"),
        "prompt": row["prompt"],
        "completion": gen.completion,
        "token_ids": gen.token_ids,
        "num_new_tokens": gen.num_new_tokens,
        "stop_reason": gen.stop_reason,
        "time_s": round(gen.time_s, 4),
    }
    if gen.spec is not None:
        out["spec"] = gen.spec
    return out


# ---------------------------------------------------------------------------------------------
# generate
# ---------------------------------------------------------------------------------------------


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="preset name, .gguf file or HF folder")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])


def add_draft_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft", default=None,
                   help="ngram | ngram:NMIN-NMAX | suffix | layerskip:K | model:NAME_OR_PATH | "
                        "eagle3|mtp|medusa|dflash|dspark:DIR (trained or upstream HF folder)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--num-draft", type=num_draft, default=None,
                       help=f"chain of D draft tokens (default {DEFAULT_NUM_DRAFT})")
    group.add_argument("--tree", default=None, help="tree preset name or YAML file")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--temperature", type=non_negative_float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=positive_int, default=None)
    p.add_argument("--top-p", type=probability, default=None, help="in (0, 1]")
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument("--batch-size", type=positive_int, default=8)
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    p.add_argument("--stop", action="append", type=non_empty_text, default=None,
                   help="stop string (repeatable)")


def check_draft_spec(spec: str, option: str = "--draft") -> None:
    """An InputError unless `spec` starts with a registered drafter name (checked before any
    model loads; the drafter's own argument is checked when it is built)."""
    from specjax.drafters.registry import check_spec

    try:
        check_spec(spec)
    except ValueError as e:
        raise InputError(f"{option} {spec!r}: {e}") from None


def draft_shape(args):
    """The draft tree of --tree / --num-draft (a chain of DEFAULT_NUM_DRAFT when neither is given),
    or None without --draft; loaded before any model so a bad value fails first."""
    from specjax.tree import chain, load_tree

    if not args.draft:
        if args.num_draft is not None or args.tree:
            raise InputError("--num-draft/--tree need --draft")
        return None
    check_draft_spec(args.draft)
    if args.tree:
        return load_tree(args.tree)
    return chain(DEFAULT_NUM_DRAFT if args.num_draft is None else args.num_draft)


def make_draft(args, tree, model):
    """(drafter, drafter params) for --draft with the draft tree `tree`, or (None, None)."""
    if tree is None:
        return None, None
    from specjax.drafters.registry import make_drafter

    return make_drafter(args.draft, tree=tree, target=model, dtype=args.dtype)


def generate_rows(args) -> list[dict]:
    """The prompt rows of --prompt or --prompts."""
    if args.prompt is None:
        return read_prompts(args.prompts)
    if not args.prompt.strip():
        raise InputError("--prompt is empty")
    return [{"id": 0, "category": None, "prompt": args.prompt, "where": "--prompt"}]


def load_tuned(args):
    """The --tuned schedule (or None), read and checked before any model loads."""
    if not args.tuned:
        return None
    from specjax.schedule import load_schedule

    schedule = load_schedule(args.tuned)
    if not args.draft:
        if not schedule.draft:
            raise InputError(f"--tuned {args.tuned}: the schedule names no drafter; pass --draft")
        check_draft_spec(schedule.draft, f"--tuned {args.tuned}: draft")
    return schedule


def rows_to_generate(rows: list[dict], args) -> list[dict]:
    """The rows still to generate: with --resume, those whose id is not yet a finished row of
    --out, after repairing --out (a torn tail or corrupt lines: reported, dropped, regenerated)."""
    from specjax.output_file import damage_report, repair_output, scan_output, trim_torn_tail

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


def id_list(ids: Sequence, limit: int = 20) -> str:
    shown = ", ".join(map(repr, ids[:limit]))
    return shown + (f" and {len(ids) - limit} more" if len(ids) > limit else "")


def cmd_generate(args) -> int:
    from specjax.api import iter_generate
    from specjax.metrics import job_summary
    from specjax.models.hub import load_model
    from specjax.output_file import append_rows, open_output

    rows = generate_rows(args)
    tree = draft_shape(args)
    schedule = load_tuned(args)
    if args.out:
        check_output_path(args.out, "--out")
    todo = rows_to_generate(rows, args)
    if not todo:
        return 0
    model = load_model(args.model, dtype=args.dtype)
    drafter, drafter_params = make_draft(args, tree, model)
    out_fd = open_output(args.out) if args.out else None
    total_tokens, spec_rows, error_ids = 0, [], []
    start = time.perf_counter()
    try:
        bar = tqdm(total=len(todo), desc="generate", unit="prompt", file=sys.stderr, disable=None)
        batches = iter_generate(
            model, [r["prompt"] for r in todo], max_new_tokens=args.max_new_tokens,
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
            stop=args.stop, chat=not args.no_chat, batch_size=args.batch_size, draft=drafter,
            drafter_params=drafter_params, labels=[r["where"] for r in todo],
            prompt_ids=[r["id"] for r in todo],
            schedule=schedule,
        )
        for first, gens in batches:
            records = [output_row(row, gen) for row, gen in zip(todo[first:], gens)]
            if out_fd is None:
                for gen in gens:
                    print(gen.completion)
            else:
                append_rows(out_fd, records, args.out)
            total_tokens += sum(gen.num_new_tokens for gen in gens)
            spec_rows += [gen.spec for gen in gens if gen.spec is not None]
            error_ids += [r["id"] for r in records if r["stop_reason"] == "error"]
            elapsed = time.perf_counter() - start
            bar.update(len(gens))
            bar.set_postfix(tok_s=f"{total_tokens / elapsed:.1f}")
        bar.close()
    finally:
        if out_fd is not None:
            os.close(out_fd)
    elapsed = time.perf_counter() - start
    print(f"{len(todo)} prompts, {total_tokens} new tokens in {elapsed:.2f} s "
          f"({total_tokens / elapsed:.1f} tokens/s, compile included)", file=sys.stderr)
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


# ---------------------------------------------------------------------------------------------
# entry point
# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specjax", description="Speculative decoding in JAX.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate completions (optionally speculative)")
    add_model_args(gen)
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="one prompt text")
    source.add_argument("--prompts", help="JSONL file: {'prompt'} or {'question_id','category','turns'} rows")
    gen.add_argument("--out", help="output JSONL, appended as each batch finishes")
    gen.add_argument("--resume", action="store_true", help="skip ids already in --out")
    add_sampling_args(gen)
    add_draft_args(gen)
    gen.add_argument("--tuned", help="draft schedule YAML from `specjax tune` (the batch size "
                     "picks the draft shape; its drafter is used when --draft is not given)")
    gen.set_defaults(func=cmd_generate)
    from specjax.cli_measure import add_subcommands
    from specjax.cli_train import add_subcommands as add_train_subcommands

    add_subcommands(sub)
    add_train_subcommands(sub)
    return parser


def fail(message: str) -> int:
    """Prints `message` as one `specjax: error:` line; returns the exit status of a user error."""
    print(f"specjax: error: {' '.join(message.split())}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Runs a subcommand. Every expected failure (InputError, PromptError and the other
    ValueErrors of the checks, an OSError on a named file) ends as one error line and exit
    status 2; anything else is a bug and keeps its traceback."""
    args = build_parser().parse_args(argv)
    if getattr(args, "resume", False) and not args.out:
        return fail("--resume needs --out")
    try:
        return args.func(args)
    except ValueError as e:
        return fail(str(e))
    except OSError as e:
        if e.filename is None:
            raise
        return fail(f"{e.filename}: {e.strerror or e}")


if __name__ == "__main__":
    sys.exit(main())
