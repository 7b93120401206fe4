"""f32 SmolLM2 decode tokens/s with the float layer kernels packed in column blocks
(`quant.BlockedKernel`, what loading does on one CPU device) or as stored (strided, `quant.LayerKernel`),
plain or n-gram with num_draft="auto", at B = 1 (2 Spec-Bench summarization prompts one by one)
or B = 8 (8 prompts, one batch), 64 new tokens, decode only (compile and prefill excluded),
2 calls after a warm-up. One mode per process; run the modes in alternating processes:

    for r in 1 2; do for B in 1 8; do for m in blocks strided; do for d in ar ngram; do
      python benchmarks/float_blocks_ab.py $B $d $m; done; done; done; done

Each prints a RESULT line: tokens/s of the 2 calls and a digest of the token ids (the two
layouts compute the same sums, so the same ids). Numbers: docs/quantization.md.
"""
import hashlib
import json
import sys

import jax

from specjax.models import quant

if sys.argv[3] == "strided":  # before loading: keep the stacks as stored
    quant.blocks = lambda path, leaf: False

import specjax
from specjax.measure.datasets import load_prompt_set, select_rows

PROMPTS = "../shared/data/spec_bench/question.jsonl"

model = specjax.load("smollm2-135m", dtype="float32")
kinds = sorted({type(leaf).__name__ for leaf in jax.tree.leaves(model.params, is_leaf=quant.is_held)})
rows = load_prompt_set(PROMPTS)
prompts = [model.tokenizer.encode_chat(r["prompt"]) for r in select_rows(rows, ["summarization"], 8)]


def rate(batch: int, draft: str | None) -> tuple[float, list]:
    opts = dict(max_new_tokens=64, batch_size=batch, draft=draft,
                num_draft="auto" if draft else None, refill=False)
    groups = [[p] for p in prompts[:2]] if batch == 1 else [prompts]
    tokens = seconds = 0.0
    ids = []
    for group in groups:
        out = specjax.generate(model, group, **opts)
        tokens += sum(o.num_new_tokens for o in out)
        ids += [list(o.token_ids) for o in out]
        seconds += out[0].times.decode_s
    return tokens / seconds, ids


batch, draft = int(sys.argv[1]), None if sys.argv[2] == "ar" else sys.argv[2]
rate(batch, draft)
rates = []
for _ in range(2):
    value, ids = rate(batch, draft)
    rates.append(round(value, 1))
print("RESULT", json.dumps({"mode": sys.argv[3], "B": batch, "draft": sys.argv[2], "kinds": kinds,
                            "tok_s": rates, "ids": hashlib.md5(str(ids).encode()).hexdigest()[:10]}))
