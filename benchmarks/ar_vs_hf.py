"""Plain greedy decoding speed: specjax vs Hugging Face transformers, same prompts, same run.

    python benchmarks/ar_vs_hf.py [--prompts ../shared/data/spec_bench/question.jsonl]
        [--num-prompts 4] [--max-new-tokens 128] [--repeats 3] [--json out.json]

SmolLM2-135M-Instruct, f32, greedy, EOS ignored so every run emits exactly max_new_tokens.
Reports median tokens/s over repeats (compile excluded: one warm-up first) for specjax B=1,
Hugging Face B=1 (if the `hf` extra is installed) and specjax B=8, and the ratios
specjax/HF (target >= 1.2) and B=8/B=1 (target >= 4).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

from specjax.api import generate_ids
from specjax.models.hub import load_model
from specjax.prompt_io import read_prompts

DEFAULT_PROMPTS = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "spec_bench" / "question.jsonl"


def specjax_tokens_per_s(model, prompt_ids, max_new, batch_size, repeats) -> list[float]:
    """Tokens/s of each timed repeat (after one warm-up call with the same shapes)."""

    def run():
        start = time.perf_counter()
        results = generate_ids(
            model.cfg, model.params, prompt_ids, max_new_tokens=max_new, eos_ids=[],
            batch_size=batch_size,
        )
        elapsed = time.perf_counter() - start
        return sum(len(r.token_ids) for r in results) / elapsed

    run()
    return [run() for _ in range(repeats)]


def hf_tokens_per_s(gguf_path: Path, prompt_ids, max_new, repeats) -> list[float] | None:
    """Tokens/s of transformers' greedy generate at B=1, prompt by prompt; None without torch."""
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None
    torch.set_num_threads(os.cpu_count() or 1)
    hf = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, torch_dtype=torch.float32
    ).eval()

    def run():
        tokens, elapsed = 0, 0.0
        for ids in prompt_ids:
            x = torch.tensor([ids])
            start = time.perf_counter()
            with torch.no_grad():
                out = hf.generate(
                    x, attention_mask=torch.ones_like(x), max_new_tokens=max_new,
                    min_new_tokens=max_new, do_sample=False, pad_token_id=0,
                )
            elapsed += time.perf_counter() - start
            tokens += out.shape[1] - x.shape[1]
        return tokens / elapsed

    run()
    return [run() for _ in range(repeats)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompts", default=str(DEFAULT_PROMPTS))
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    jax.config.update("jax_default_matmul_precision", "highest")

    model = load_model(args.model, dtype="float32")
    rows = read_prompts(args.prompts)[: max(args.num_prompts, args.batch)]
    ids = [model.tokenizer.encode_chat(r["prompt"]) for r in rows]
    single = ids[: args.num_prompts]

    b1 = specjax_tokens_per_s(model, single, args.max_new_tokens, 1, args.repeats)
    b8 = specjax_tokens_per_s(model, ids[: args.batch], args.max_new_tokens, args.batch, args.repeats)
    hf = hf_tokens_per_s(Path(model.source), single, args.max_new_tokens, args.repeats)

    med = statistics.median
    result = {
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "cpu_count": os.cpu_count(),
        "max_new_tokens": args.max_new_tokens,
        "num_prompts_b1": len(single),
        "specjax_b1_tok_s": b1,
        "specjax_b8_tok_s": b8,
        "hf_b1_tok_s": hf,
        "ratio_specjax_vs_hf_b1": med(b1) / med(hf) if hf else None,
        "ratio_b8_vs_b1": med(b8) / med(b1),
    }
    print(f"{'run':<22}{'median tok/s':>14}  runs")
    print(f"{'specjax B=1':<22}{med(b1):>14.1f}  {np.round(b1, 1).tolist()}")
    if hf:
        print(f"{'HF transformers B=1':<22}{med(hf):>14.1f}  {np.round(hf, 1).tolist()}")
    print(f"{'specjax B=' + str(args.batch):<22}{med(b8):>14.1f}  {np.round(b8, 1).tolist()}")
    if hf:
        print(f"specjax/HF at B=1: {result['ratio_specjax_vs_hf_b1']:.2f}x (target >= 1.2)")
    else:
        print("HF transformers not installed (pip install -e '.[hf]'): no HF comparison", file=sys.stderr)
    print(f"B={args.batch} / B=1 throughput: {result['ratio_b8_vs_b1']:.2f}x (target >= 4)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
