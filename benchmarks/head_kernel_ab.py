"""f32 SmolLM2 decode tokens/s, plain vs n-gram with num_draft="auto", at B = 1 (2 Spec-Bench
summarization prompts, one by one) and B = 8 (8 prompts, one batch), 64 new tokens, decode only
(compile and prefill excluded), medians of 2 calls after a warm-up, in one process.

Used for an A/B of two revisions in alternating processes (check each revision's `kernels`,
`models` and `specjax` out in turn and run this): the numbers of the LM-head kernel are in
benchmarks/results/head_kernel_ab.md.

    python benchmarks/head_kernel_ab.py [--prompts PATH]
"""
import json
import sys

import numpy as np

import specjax
from specjax.measure.datasets import load_prompt_set, select_rows

model = specjax.load("smollm2-135m", dtype="float32")
rows = load_prompt_set(sys.argv[sys.argv.index("--prompts") + 1] if "--prompts" in sys.argv
                       else "../shared/data/spec_bench/question.jsonl")
prompts = [model.tokenizer.encode_chat(r["prompt"]) for r in select_rows(rows, ["summarization"], 8)]
def rate(B, draft):
    opts = dict(max_new_tokens=64, batch_size=B, draft=draft, num_draft="auto" if draft else None, refill=False)
    groups = [[p] for p in prompts[:2]] if B == 1 else [prompts]
    tok = sec = 0.0
    for g in groups:
        out = specjax.generate(model, g, **opts)
        tok += sum(o.num_new_tokens for o in out)
        sec += out[0].times.decode_s
    return tok / sec
res = {}
for B in (1, 8):
    for d in (None, "ngram"):
        rate(B, d)
        res[f"B{B}_{d or 'ar'}"] = [rate(B, d) for _ in range(2)]
print("RESULT", json.dumps({k: round(float(np.median(v)), 2) for k, v in res.items()}))
