"""The layer loop as a scan, vs per layer as separate buffers (no weight slicing at all).

(An unrolled scan, `nn.scan(unroll=L)` behind a `ModelConfig.layer_loop` knob, was measured
with this script at commit 82c87d2 and removed as a loss: docs/quantization.md has the numbers.)

`--program step`: one decode step alone (forward over 1 token per row, B rows, a cache of S
entries): compile seconds, step milliseconds, the HLO's slice / copy counts.
`--program decode`: the real decoding programs (`specjax.generate_ids`: refilled slots,
prefill + the `lax.while_loop` over steps) on B prompts, plain and/or with drafters (a chain
of 4): compile seconds, decode tokens/s (median of 3 runs) and whether both loops emit the
same tokens; "split" swaps `models.llama.forward` for `split_forward` over per-layer params.

    SPECJAX_COMPILE_CACHE=0 .venv/bin/python benchmarks/layer_loop.py --program step --batch 8
    SPECJAX_COMPILE_CACHE=0 .venv/bin/python benchmarks/layer_loop.py --program decode --batch 1 \
        --quantize none int8 --drafts none ngram
"""
from __future__ import annotations

import argparse
import json
import re
import time

import jax
import jax.numpy as jnp

import specjax
import specjax.models.llama as llama
from specjax.models.cache import init_cache, write
from specjax.models.hub import load_model
from specjax.models.llama import (
    DecoderLayer,
    ForwardOutput,
    LlamaModel,
    causal_mask,
    forward,
    rope_tables,
)
from specjax.timing import job_stats


def step_fn(cfg):
    """tokens [B, 1], positions [B, 1], cache -> logits [B, 1, V] (one jitted forward)."""
    return jax.jit(lambda params, tokens, positions, cache: forward(cfg, params, tokens, positions, cache).logits)


def split_layers(params):
    """The params with the stacked layers `[L, ...]` as a tuple of L trees, each leaf its own
    buffer (quantized QArray leaves included)."""
    inner = params["params"]
    count = jax.tree.leaves(inner["layers"])[0].shape[0]
    layers = tuple(jax.tree.map(lambda x, i=i: jnp.array(x[i]), inner["layers"]) for i in range(count))
    return {**params, "params": {**inner, "layers": layers}}


def split_forward(cfg, params, tokens, positions, cache, tree_mask=None, *, hidden_layers=(),
                  logit_indices=None, compute_logits=True):
    """`models.llama.forward` over `split_layers` params: the layers unrolled in Python, each
    matmul reading its layer's own weight buffer (stacked params go to the real forward)."""
    if not isinstance(params["params"]["layers"], tuple):
        return forward(cfg, params, tokens, positions, cache, tree_mask, hidden_layers=hidden_layers,
                       logit_indices=logit_indices, compute_logits=compute_logits)
    batch, seq = tokens.shape
    mask = causal_mask(batch, seq) if tree_mask is None else tree_mask
    model = LlamaModel(cfg)
    x = model.apply(params, tokens, method=LlamaModel.embed)
    cos, sin = rope_tables(cfg, positions)
    layer = DecoderLayer(cfg, collect_hidden=bool(hidden_layers))
    ks, vs, hs = [], [], []
    for i, layer_params in enumerate(params["params"]["layers"]):
        x, (k, v, h) = layer.apply({"params": layer_params}, x, cache.k[i], cache.v[i], cos, sin,
                                   cache.lengths, mask)
        ks, vs, hs = ks + [k], vs + [v], hs + [h]
    hidden = model.apply(params, x, method=lambda m, h: m.norm(h))
    logits = None
    if compute_logits:
        selected = hidden if logit_indices is None else jnp.take_along_axis(
            hidden, logit_indices[..., None], axis=1)
        logits = model.apply(params, selected, method=LlamaModel.logits)
    return ForwardOutput(logits=logits, hidden=hidden, layer_hidden=tuple(hs[i] for i in hidden_layers),
                         cache=write(cache, jnp.stack(ks), jnp.stack(vs)))


def split_fn(cfg):
    """The step over `split_layers` params."""
    return jax.jit(lambda params, tokens, positions, cache: split_forward(
        cfg, params, tokens, positions, cache).logits)


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


def decode_program(model, batch: int, max_new: int, loop: str, draft: str | None,
                   repeats: int) -> dict:
    """compile s, decode tokens/s (median of `repeats` runs after the compiling one) of greedy
    decoding of `batch` fixed prompts (draft: a chain of 4 of that drafter), and the tokens.
    loop "split": the real programs with `models.llama.forward` swapped for `split_forward`
    and the params split per layer."""
    prompts = [[1 + (7 * i + j) % 500 for j in range(60 + i)] for i in range(batch)]
    params = split_layers(model.params) if loop == "split" else model.params
    options = {} if draft is None else {"draft": draft, "num_draft": 4}
    real_forward = llama.forward
    llama.forward = split_forward if loop == "split" else real_forward
    try:
        runs = [specjax.generate_ids(model.cfg, params, prompts, max_new_tokens=max_new,
                                     batch_size=batch, eos_ids=[], **options)
                for _ in range(1 + repeats)]
    finally:
        llama.forward = real_forward
    stats = [job_stats(out) for out in runs]
    rates = sorted(s.new_tokens / s.decode_s for s in stats[1:])
    return {"draft": draft, "compile_s": round(stats[0].compile_s, 2),
            "tokens_per_s": round(rates[len(rates) // 2], 2),
            "tokens": [r.token_ids for r in runs[0]]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--capacity", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--quantize", nargs="+", default=["none"])
    ap.add_argument("--loops", nargs="+", choices=["scan", "split"], default=["scan", "split"])
    ap.add_argument("--program", choices=["step", "decode"], default="step")
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--drafts", nargs="+", default=["none"], help="decode: none (plain) and/or drafter specs")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    tokens_of: dict = {}  # (quantize, draft) -> the first loop's tokens
    for mode in args.quantize:
        model = load_model(args.model, quantize=None if mode == "none" else mode)
        b = args.batch
        tokens = jnp.ones((b, 1), jnp.int32)
        positions = jnp.full((b, 1), args.capacity // 2, jnp.int32)
        for loop in args.loops:
            cfg = model.cfg
            if args.program == "decode":
                for draft in (None if d == "none" else d for d in args.drafts):
                    row = {"quantize": mode, "loop": loop, "batch": b, "max_new": args.max_new,
                           **decode_program(model, b, args.max_new, loop, draft, 3)}
                    tokens = row.pop("tokens")
                    same = tokens_of.setdefault((mode, draft), tokens) == tokens
                    row["same_tokens_as_first_loop"] = same
                    print(json.dumps(row), flush=True)
                    rows.append(row)
                continue
            cache = init_cache(cfg, b, args.capacity)
            cache = cache.replace(lengths=jnp.full((b,), args.capacity // 2, jnp.int32))
            if loop == "split":
                fn, call = split_fn(cfg), (split_layers(model.params), tokens, positions, cache)
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
