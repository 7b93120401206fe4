"""The layer loop as a scan, vs per layer as separate buffers (no weight slicing at all).

(An unrolled scan, `nn.scan(unroll=L)` behind a `ModelConfig.layer_loop` knob, was measured
with this script at commit 82c87d2 and removed as a loss: docs/quantization.md has the numbers.)

`--program step`: one decode step alone (forward over 1 token per row, B rows, a cache of S
entries): compile seconds, step milliseconds, the HLO's slice / copy counts.
`--program decode`: the real AR decoding program (`specjax.generate`, prefill + the
`lax.while_loop` over steps) on B prompts: compile seconds and decode tokens/s (scan only).

    SPECJAX_COMPILE_CACHE=0 .venv/bin/python benchmarks/layer_loop.py --program step --batch 8
    SPECJAX_COMPILE_CACHE=0 .venv/bin/python benchmarks/layer_loop.py --program decode --batch 8 \
        --quantize none int8 --loops scan
"""
from __future__ import annotations

import argparse
import json
import re
import time

import jax
import jax.numpy as jnp

import specjax
from specjax.models.cache import init_cache
from specjax.models.hub import load_model
from specjax.models.llama import DecoderLayer, LlamaModel, forward, rope_tables
from specjax.timing import job_stats


def step_fn(cfg):
    """tokens [B, 1], positions [B, 1], cache -> logits [B, 1, V] (one jitted forward)."""
    return jax.jit(lambda params, tokens, positions, cache: forward(cfg, params, tokens, positions, cache).logits)


def split_fn(cfg):
    """The same step over per-layer params (a list of L separate trees): no stacked weights."""
    def run(params, layers, tokens, positions, cache):
        model = LlamaModel(cfg)
        x = model.apply(params, tokens, method=LlamaModel.embed)
        cos, sin = rope_tables(cfg, positions)
        mask = jnp.ones((tokens.shape[0], 1, 1), bool)
        for i, layer in enumerate(layers):
            x, _ = DecoderLayer(cfg).apply({"params": layer}, x, cache.k[i], cache.v[i], cos, sin,
                                           cache.lengths, mask)
        hidden = model.apply(params, x, method=lambda m, h: m.norm(h))
        return model.apply(params, hidden, method=LlamaModel.logits)
    return jax.jit(run)


def hlo_stats(compiled_text: str) -> dict:
    """Counts of ops that move weights in the optimized HLO."""
    return {op: len(re.findall(rf"= [a-z0-9\[\],{{}}: ]*{op}\(", compiled_text))
            for op in ("dynamic-slice", "copy", "slice", "while")}


def timed(fn, args, repeats: int) -> tuple[float, float, dict]:
    t0 = time.perf_counter()
    compiled = fn.lower(*args).compile()
    compile_s = time.perf_counter() - t0
    stats = hlo_stats(compiled.as_text())
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    return compile_s, sorted(times)[len(times) // 2] * 1e3, stats


def decode_program(model, batch: int, max_new: int) -> dict:
    """compile s, decode tokens/s of plain greedy decoding of `batch` fixed prompts."""
    prompts = [[1 + (7 * i + j) % 500 for j in range(24 + i)] for i in range(batch)]
    out = specjax.generate(model, prompts, max_new_tokens=max_new, batch_size=batch,
                           eos_ids=[], refill=False)
    stats = job_stats(out)
    return {"compile_s": round(stats.compile_s, 2), "decode_s": round(stats.decode_s, 2),
            "tokens_per_s": round(stats.new_tokens / stats.decode_s, 2),
            "step_ms": round(1e3 * stats.decode_s / max_new, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--capacity", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--quantize", nargs="+", default=["none"])
    ap.add_argument("--loops", nargs="+", choices=["scan", "split"], default=["scan", "split"])
    ap.add_argument("--program", choices=["step", "decode"], default="step")
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for mode in args.quantize:
        model = load_model(args.model, quantize=None if mode == "none" else mode)
        b = args.batch
        tokens = jnp.ones((b, 1), jnp.int32)
        positions = jnp.full((b, 1), args.capacity // 2, jnp.int32)
        for loop in args.loops:
            cfg = model.cfg
            if args.program == "decode":
                if loop != "scan":
                    continue
                row = {"quantize": mode, "loop": loop, "batch": b, "max_new": args.max_new,
                       **decode_program(model, b, args.max_new)}
                print(json.dumps(row), flush=True)
                rows.append(row)
                continue
            cache = init_cache(cfg, b, args.capacity)
            cache = cache.replace(lengths=jnp.full((b,), args.capacity // 2, jnp.int32))
            if loop == "split":
                stacked = model.params["params"]["layers"]
                layers = [jax.tree.map(lambda x, i=i: jnp.array(x[i]), stacked)
                          for i in range(cfg.num_layers)]
                fn, call = split_fn(cfg), (model.params, layers, tokens, positions, cache)
            else:
                fn, call = step_fn(cfg), (model.params, tokens, positions, cache)
            compile_s, step_ms, stats = timed(fn, call, args.repeats)
            row = {"quantize": mode, "loop": loop, "batch": b, "capacity": args.capacity,
                   "compile_s": round(compile_s, 2), "step_ms": round(step_ms, 2), "hlo": stats}
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "python benchmarks/layer_loop.py " + " ".join(
                f"--{k} {' '.join(v) if isinstance(v, list) else v}" for k, v in vars(args).items()
                if v is not None), "device": str(jax.devices()[0]), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
