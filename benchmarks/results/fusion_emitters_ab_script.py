"""tokens/s (compile excluded) of plain, chain4 and auto n-gram at B=1 and 8 on summarization, this process's XLA_FLAGS."""
import json, os, sys, time
sys.path.insert(0, "benchmarks")
import adaptive
from specjax.models.hub import load_model
from specjax.timing import job_stats
model = load_model("smollm2-135m")
cats = adaptive.category_prompts(model.tokenizer, str(adaptive.DEFAULT_PROMPTS), 256)
out = {"flags": os.environ.get("XLA_FLAGS", "")}
for B in (1, 8):
    prompts = cats["summarization"][:B] if B > 1 else cats["summarization"][:2]
    for name, opts in (("plain", {}), ("chain4", {"draft": "ngram", "num_draft": 4}), ("auto", {"draft": "ngram"})):
        t0 = time.perf_counter()
        _, _, res = adaptive.timed(model, prompts, B, 48, opts)
        first = job_stats(res).compile_s
        rates = [adaptive.timed(model, prompts, B, 48, opts)[0] for _ in range(3)]
        rates.sort()
        out[f"B{B} {name}"] = {"tok_s": round(rates[1], 2), "compile_s": round(first, 2)}
print(json.dumps(out))
