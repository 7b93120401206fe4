"""Every drafter vs plain decoding (and Hugging Face prompt lookup) per Spec-Bench category.

    python benchmarks/spec_vs_ar.py [--per-category 10] [--max-new-tokens 128]
        [--drafts ngram suffix layerskip:8] [--num-draft 4] [--no-hf] [--out benchmarks/results/spec_vs_ar.json]

SmolLM2-135M-Instruct, f32, greedy, batch 1, CPU. All modes run the same prompts in the same
process after a warm-up that compiles every program; per category the modes take turns in a
rotating order, so drift of a shared machine hits them alike. Tokens/s counts emitted tokens
(EOS ends a row, as in real use) over wall time including prefill. Hugging Face prompt lookup
(`generate(prompt_lookup_num_tokens=D)`) runs when the `hf` extra is installed.
Targets (issue 3): ngram on summarization >= 2.0x specjax AR and >= 1.2x HF prompt lookup.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

import jax

from specjax.measure.bench import (
    ModeRecord,
    RunConfig,
    encode_by_category,
    make_any_drafter,
    merged,
    mode_stats,
    rotated,
    timed_run,
    warm_up,
)
from specjax.measure.datasets import load_prompt_set, select_rows
from specjax.metrics import job_summary
from specjax.models.hub import load_model
from specjax.tree import chain

DEFAULT_PROMPTS = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "spec_bench" / "question.jsonl"


def hf_prompt_lookup(model, groups, max_new_tokens: int, num_draft: int) -> dict | None:
    """Per category {"new_tokens", "time_s"} of transformers' prompt lookup, B=1; None without torch."""
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None
    torch.set_num_threads(os.cpu_count() or 1)
    path = Path(model.source)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, torch_dtype=torch.float32).eval()
    eos = list(model.tokenizer.eos_token_ids)

    def run(ids, n):
        x = torch.tensor([ids])
        start = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                              prompt_lookup_num_tokens=num_draft, eos_token_id=eos, pad_token_id=eos[0])
        return out.shape[1] - x.shape[1], time.perf_counter() - start

    run(next(iter(groups.values()))[0], 8)  # warm-up
    stats = {}
    for name, prompts in groups.items():
        done = [run(ids, max_new_tokens) for ids in prompts]
        stats[name] = {"new_tokens": sum(d[0] for d in done), "time_s": sum(d[1] for d in done)}
    return stats


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dataset", default=str(DEFAULT_PROMPTS))
    p.add_argument("--per-category", type=int, default=10)
    p.add_argument("--categories", nargs="*", default=None)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--drafts", nargs="+", default=["ngram", "suffix", "layerskip:8"])
    p.add_argument("--num-draft", type=int, default=4)
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--out", default="benchmarks/results/spec_vs_ar.json")
    args = p.parse_args(argv)
    jax.config.update("jax_default_matmul_precision", "highest")

    model = load_model(args.model, dtype="float32")
    rows = select_rows(load_prompt_set(args.dataset), categories=args.categories, per_category=args.per_category)
    groups = encode_by_category(model, rows)
    run = RunConfig(max_new_tokens=args.max_new_tokens, batch_size=1)
    tree = chain(args.num_draft)
    modes = {"ar": (None, None)} | {d: make_any_drafter(d, tree, model) for d in args.drafts}
    warm_up(model, list(groups.values()), run, list(modes.values()))

    records = {m: {c: ModeRecord() for c in groups} for m in modes}
    order = list(modes)
    for turn, (category, ids) in enumerate(groups.items()):
        for mode in rotated(order, turn):
            records[mode][category].add(timed_run(model, ids, run, *modes[mode]))
        print(f"{category}: " + ", ".join(
            f"{m} {mode_stats(records[m][category])['tokens_per_s']:.1f}" for m in order) + " tok/s",
            file=sys.stderr)
    hf = None if args.no_hf else hf_prompt_lookup(model, groups, args.max_new_tokens, args.num_draft)

    report = {"device": jax.devices()[0].device_kind, "cpu_count": os.cpu_count(), "jax": jax.__version__,
              "date": time.strftime("%Y-%m-%d"), "command": ["python", "benchmarks/spec_vs_ar.py", *(argv or sys.argv[1:])],
              "max_new_tokens": args.max_new_tokens, "num_draft": args.num_draft, "categories": {}}
    for category in [*groups, "overall"]:
        pick = functools.partial(
            lambda m, c: records[m][c] if c != "overall" else merged(list(records[m].values())),
            c=category)
        ar = mode_stats(pick("ar"))["tokens_per_s"]
        entry = {"ar_tokens_per_s": ar, "drafters": {}}
        for d in args.drafts:
            rec = pick(d)
            acc = job_summary(rec.spec_rows)
            tps = mode_stats(rec)["tokens_per_s"]
            entry["drafters"][d] = {"tokens_per_s": tps, "speedup_vs_ar": tps / ar,
                                    "acceptance_length": acc["acceptance_length"],
                                    "conditional_acceptance": acc["conditional_acceptance"],
                                    "joint_acceptance": acc["joint_acceptance"]}
        if hf:
            sel = hf.values() if category == "overall" else [hf[category]]
            entry["hf_prompt_lookup_tokens_per_s"] = sum(s["new_tokens"] for s in sel) / sum(s["time_s"] for s in sel)
        report["categories"][category] = entry

    header = f"{'category':<15}{'AR tok/s':>9}" + "".join(f"{d[:12] + ' AL/x':>20}" for d in args.drafts)
    print(header + (f"{'HF PLD tok/s':>14}" if hf else ""))
    for category, e in report["categories"].items():
        cells = "".join(f"{e['drafters'][d]['acceptance_length']:>10.2f}/{e['drafters'][d]['speedup_vs_ar']:>8.2f}x"
                        for d in args.drafts)
        hf_cell = f"{e['hf_prompt_lookup_tokens_per_s']:>14.1f}" if hf else ""
        print(f"{category:<15}{e['ar_tokens_per_s']:>9.1f}{cells}{hf_cell}")
    if "ngram" in args.drafts and "summarization" in report["categories"]:
        s = report["categories"]["summarization"]
        line = f"ngram on summarization: {s['drafters']['ngram']['speedup_vs_ar']:.2f}x AR (target >= 2.0)"
        if hf:
            ratio = s["drafters"]["ngram"]["tokens_per_s"] / s["hf_prompt_lookup_tokens_per_s"]
            line += f", {ratio:.2f}x HF prompt lookup (target >= 1.2)"
        print(line)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
