"""Quality of weight-only quantized targets against f32, per Spec-Bench category.

For each quantization mode and category: the greedy agreement of the quantized target's
64-token continuation with f32's (`prefix`: mean fraction of f32's tokens matched before the
first difference; `exact`: fraction of prompts continued identically), the mean
KL(f32 || quantized) of the next-token distributions along f32's own continuation (teacher
forced), and each drafter's acceptance length against the quantized target.

    .venv/bin/python benchmarks/quant_quality.py --per-category 1 --modes int8 int4 fp8 \
        --drafts ngram suffix layerskip:15 --out benchmarks/results/quant_quality_smollm2.json
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np

import specjax
from specjax.measure.datasets import load_prompt_set, select_rows
from specjax.models.cache import init_cache
from specjax.models.llama import forward
from specjax.models.quant import quantize_params

SPEC_BENCH = "../shared/data/spec_bench/question.jsonl"


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def log_probs(cfg, params, tokens: np.ndarray) -> jax.Array:
    """log softmax of the logits `[T, V]` of one sequence `tokens [T]` (padded to a multiple of
    64 so few programs compile; causal, so the padding changes nothing before it)."""
    length = len(tokens)
    padded = -(-length // 64) * 64
    ids = jnp.asarray(np.pad(tokens, (0, padded - length)), jnp.int32)[None]
    return _teacher_forced(cfg, params, ids)[0, :length]


@functools.partial(jax.jit, static_argnums=0)
def _teacher_forced(cfg, params, ids):
    positions = jnp.arange(ids.shape[1], dtype=jnp.int32)[None]
    logits = forward(cfg, params, ids, positions, init_cache(cfg, 1, ids.shape[1])).logits
    return jax.nn.log_softmax(logits, axis=-1)


def mean_kl(cfg, exact_params, approx_params, prompt: list[int], continuation: list[int]) -> float:
    """Mean KL(exact || approx) of the next-token distributions predicting `continuation`."""
    tokens = np.asarray(prompt + continuation)
    p = log_probs(cfg, exact_params, tokens)[len(prompt) - 1: len(tokens) - 1]
    q = log_probs(cfg, approx_params, tokens)[len(prompt) - 1: len(tokens) - 1]
    return float(jnp.mean(jnp.sum(jnp.exp(p) * (p - q), axis=-1)))


def generate(model, prompts, args, draft=None):
    return specjax.generate(model, prompts, max_new_tokens=args.max_new, batch_size=args.batch_size,
                            draft=draft, num_draft=args.num_draft if draft else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", default=SPEC_BENCH)
    ap.add_argument("--categories", nargs="*", default=None, help="default: every category")
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--modes", nargs="+", default=["int8", "int4", "fp8"])
    ap.add_argument("--drafts", nargs="*", default=["ngram", "suffix", "layerskip:15"])
    ap.add_argument("--num-draft", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    t0 = time.perf_counter()
    rows = select_rows(load_prompt_set(args.prompts), args.categories, args.per_category)
    f32 = specjax.load(args.model, dtype="float32")
    prompts = [f32.tokenizer.encode_chat(r["prompt"]) for r in rows]
    reference = [g.token_ids for g in generate(f32, prompts, args)]
    per_cat: dict = defaultdict(dict)
    for mode in args.modes:
        model = dataclasses.replace(f32, params=quantize_params(f32.params, mode))
        outputs = [g.token_ids for g in generate(model, prompts, args)]
        drafted = {d: generate(model, prompts, args, draft=d) for d in args.drafts}
        cats = defaultdict(lambda: defaultdict(list))
        for i, row in enumerate(rows):
            stats = cats[row["category"]]
            ref, out = reference[i], outputs[i]
            stats["prefix"].append(common_prefix(ref, out) / max(len(ref), 1))
            stats["exact"].append(float(ref == out))
            stats["kl"].append(mean_kl(f32.cfg, f32.params, model.params, prompts[i], ref))
            for d, gens in drafted.items():
                assert gens[i].token_ids == out, f"{d}: speculative output differs from plain ({mode})"
                stats[f"acceptance_length/{d}"].append(gens[i].spec["acceptance_length"])
        for cat, stats in cats.items():
            per_cat[cat][mode] = {k: round(float(np.mean(v)), 4) for k, v in stats.items()}
            print(cat, mode, per_cat[cat][mode], flush=True)
    report = {"command": " ".join([sys.executable.split("/")[-1], *sys.argv]),
              "model": args.model, "prompts": args.prompts, "rows": len(rows),
              "max_new": args.max_new, "num_draft": args.num_draft, "device": str(jax.devices()[0]),
              "seconds": round(time.perf_counter() - t0, 1), "per_category": per_cat}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
