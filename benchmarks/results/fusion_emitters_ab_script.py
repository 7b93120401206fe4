"""The one-off A/B of `fusion_emitters_ab.jsonl`: tokens/s (compile excluded) and compile seconds
of plain, n-gram chain4 and n-gram auto at B = 1 and 8 on Spec-Bench summarization (f32, 48 new
tokens, medians of 3 after one untimed run), under this process's XLA_FLAGS.

    SPECJAX_COMPILE_CACHE=0 XLA_FLAGS=--xla_cpu_use_fusion_emitters=true \
        python benchmarks/results/fusion_emitters_ab_script.py
"""
import json
import os
import sys

sys.path.insert(0, "benchmarks")
import adaptive

from specjax.models.hub import load_model
from specjax.timing import job_stats

MODES = (("plain", {}), ("chain4", {"draft": "ngram", "num_draft": 4}), ("auto", {"draft": "ngram"}))


def main() -> None:
    model = load_model("smollm2-135m")
    cats = adaptive.category_prompts(model.tokenizer, str(adaptive.DEFAULT_PROMPTS), 256)
    out = {"flags": os.environ.get("XLA_FLAGS", "")}
    for batch in (1, 8):
        prompts = cats["summarization"][:max(batch, 2)]
        for name, options in MODES:
            _, _, results = adaptive.timed(model, prompts, batch, 48, options)
            rates = sorted(adaptive.timed(model, prompts, batch, 48, options)[0] for _ in range(3))
            out[f"B{batch} {name}"] = {"tok_s": round(rates[1], 2),
                                       "compile_s": round(job_stats(results).compile_s, 2)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
