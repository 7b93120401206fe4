"""Command line: `specjax generate ...` (and the subcommands registered by later modules)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm


class InputError(ValueError):
    """A bad input file or row; the message names it."""


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
    return {"id": row_id, "category": record.get("category"), "prompt": prompt}


def read_prompts(path: str | os.PathLike) -> list[dict]:
    """Rows of a JSONL prompt file; ids default to the 0-based line number."""
    rows = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise InputError(f"cannot read prompts file {path}: {e.strerror}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
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


def done_ids(out_path: str | os.PathLike | None) -> set:
    """Ids already written to an output JSONL (for --resume); a torn last line is ignored."""
    if not out_path or not Path(out_path).exists():
        return set()
    ids = set()
    for line in Path(out_path).read_text(encoding="utf-8").splitlines():
        try:
            ids.add(json.loads(line)["id"])
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    return ids


def drop_torn_tail(out_path: str | os.PathLike) -> None:
    """Cuts a partial last line (a job killed mid-write) so appended rows start on a fresh line."""
    path = Path(out_path)
    if not path.exists() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    if not data.endswith(b"\n"):
        with open(path, "r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)


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
    group.add_argument("--num-draft", type=int, default=None, help="chain of D draft tokens")
    group.add_argument("--tree", default=None, help="tree preset name or YAML file")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def make_draft(args, model):
    """(drafter, drafter params) from --draft/--num-draft/--tree, or (None, None)."""
    if not args.draft:
        if args.num_draft or args.tree:
            raise InputError("--num-draft/--tree need --draft")
        return None, None
    from specjax.drafters.registry import make_drafter
    from specjax.tree import chain, load_tree

    tree = load_tree(args.tree) if args.tree else chain(args.num_draft or 4)
    return make_drafter(args.draft, tree=tree, target=model, dtype=args.dtype)


def cmd_generate(args) -> int:
    from specjax.api import iter_generate
    from specjax.metrics import job_summary
    from specjax.models.hub import load_model

    if args.prompt is not None:
        rows = [{"id": 0, "category": None, "prompt": args.prompt, "where": "--prompt"}]
        if not args.prompt.strip():
            raise InputError("--prompt is empty")
    else:
        rows = read_prompts(args.prompts)
    skip = done_ids(args.out) if args.resume else set()
    todo = [r for r in rows if r["id"] not in skip]
    if skip:
        print(f"resume: {len(rows) - len(todo)} of {len(rows)} rows already in {args.out}", file=sys.stderr)
    if not todo:
        return 0
    model = load_model(args.model, dtype=args.dtype)
    drafter, drafter_params = make_draft(args, model)
    if args.out:
        drop_torn_tail(args.out)
    out_file = open(args.out, "a", encoding="utf-8") if args.out else None
    total_tokens, spec_rows = 0, []
    start = time.perf_counter()
    try:
        bar = tqdm(total=len(todo), desc="generate", unit="prompt", file=sys.stderr, disable=None)
        batches = iter_generate(
            model, [r["prompt"] for r in todo], max_new_tokens=args.max_new_tokens,
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
            stop=args.stop, chat=not args.no_chat, batch_size=args.batch_size, draft=drafter,
            drafter_params=drafter_params, labels=[r["where"] for r in todo],
            schedule=args.tuned,
        )
        for first, gens in batches:
            for row, gen in zip(todo[first:], gens):
                record = output_row(row, gen)
                total_tokens += gen.num_new_tokens
                if gen.spec is not None:
                    spec_rows.append(gen.spec)
                if out_file:
                    out_file.write(json.dumps(record, ensure_ascii=False) + "\n")
                else:
                    print(gen.completion)
            if out_file:
                out_file.flush()
                os.fsync(out_file.fileno())
            elapsed = time.perf_counter() - start
            bar.update(len(gens))
            bar.set_postfix(tok_s=f"{total_tokens / elapsed:.1f}")
        bar.close()
    finally:
        if out_file:
            out_file.close()
    elapsed = time.perf_counter() - start
    print(f"{len(todo)} prompts, {total_tokens} new tokens in {elapsed:.2f} s "
          f"({total_tokens / elapsed:.1f} tokens/s, compile included)", file=sys.stderr)
    if spec_rows:
        summary = job_summary(spec_rows)
        print("spec: " + json.dumps({k: summary[k] for k in (
            "acceptance_length", "acceptance_rate", "steps", "drafted", "accepted",
            "conditional_acceptance")}), file=sys.stderr)
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


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "resume", False) and not args.out:
        print("specjax: error: --resume needs --out", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except (InputError, ValueError) as e:
        print(f"specjax: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
