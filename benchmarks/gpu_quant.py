"""Quantized targets on an accelerator (issue 17's GPU part): weight-only int8 / fp8 / int4
against bf16 on a shape-only Llama-3-8B target, one decode step against the bandwidth floor.

    python benchmarks/gpu_quant.py [--layers 4] [--out DIR]       # the GPU suite's part 5
    python benchmarks/gpu_quant.py --smoke                         # CPU, tiny shapes, seconds

For each mode (`bfloat16`, `int8`, `fp8`, `int4`; `float32` and the CPU modes in --smoke):

1. whether this backend runs it: `quant.check_quantize`'s one-line error is recorded and the
   next mode runs (never a silent fallback to another precision);
2. the weight copies in the layer loop (the item-4 profile): in the compiled decode step (one
   token per row through `models.llama.forward`), the instructions whose result has a layer
   kernel's shape `[K, N]` (any dtype), e.g. a `dynamic-slice` of the stacked params or a
   dequantized copy, that the matmuls then read: their count and the bytes they write a step
   (x layers: they sit in the layer loop);
3. the decode step time at B = 1 and 16 over a cache of `--context` tokens (a jitted step, the
   cache donated and fed back, compile excluded, median of `--repeats`), and the floor: the
   bytes the step must read (weights as stored, the float LM head left out where an int8 one
   replaces it, + the KV cache) over this device's streaming bandwidth (best `jnp.sum` over a
   `--bandwidth-gb` buffer); floor / measured = the fraction of the floor reached.

Writes gpu_quant.json (gpu_quant_smoke.json) to --out (default $OUT, else benchmarks/results)
and prints one line a (mode, B) last.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_floor import jnp_bandwidth, kv_bytes, stored_bytes

from specjax.measure.profile import load_target
from specjax.models.cache import init_cache
from specjax.models.llama import forward
from specjax.models.quant import check_quantize

FULL = {"model": "random:llama3-8b", "dtype": "bfloat16", "modes": ("bfloat16", "int8", "fp8", "int4"),
        "batch_sizes": (1, 16), "context": 1024, "repeats": 20, "bandwidth_gb": 4.0}
SMOKE = {"model": "random:tiny", "dtype": "float32", "modes": ("float32", "int8", "int4", "fp8"),
         "batch_sizes": (1, 4), "context": 64, "repeats": 3, "bandwidth_gb": 0.25}
FLOAT_MODES = ("float32", "bfloat16")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny CPU-sized run")
    p.add_argument("--layers", type=int, default=4, help="decoder layers of the 8B shape")
    p.add_argument("--modes", nargs="+", help="override: float32 / bfloat16 / int8 / int4 / fp8")
    p.add_argument("--context", type=int, help="override: cached tokens a row")
    p.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    return p.parse_args(argv)


def kernel_shapes(params) -> set[tuple[int, int]]:
    """The `[K, N]` of every stacked layer kernel (`params/layers/.../kernel`, `[L, K, N]`: a
    float kernel, or a QArray's values; not its scales)."""
    shapes = set()
    for path, leaf in jax.tree_util.tree_flatten_with_path(params["params"]["layers"])[0]:
        keys = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        if ("kernel" in keys and "scale" not in keys and getattr(leaf, "ndim", 0) == 3
                and min(leaf.shape[1:]) > 1):
            shapes.add(tuple(leaf.shape[1:]))
    return shapes


#: an HLO instruction's result: `%name = dtype[d0,d1]{layout} opcode(` (layout `{1,0:E(4)}`:
#: 4-bit elements packed two a byte)
_RESULT = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = (\w+)\[([\d,]*)\](\{[^}]*\})? ([\w\-]+)\(")
#: a computation's first line: `%name (params) -> type {` or `ENTRY %name ...`
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{\s*$")
_PASSIVE = {"parameter", "get-tuple-element", "bitcast", "tuple", "constant"}
_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s8": 1, "u8": 1, "s4": 1, "u4": 1, "f8e4m3fn": 1, "f8e5m2": 1}


def weight_copies(hlo_text: str, shapes: set[tuple[int, int]]) -> dict:
    """The instructions of the compiled program's loop bodies (the layer loop: `while`'s
    `body=`) that write an array of a layer kernel's shape (either orientation; those inside a
    fusion's body write nothing of their own): a copy the matmul reads instead of the stacked
    weights. {"count", "bytes", "ops": {opcode or fusion name: count}} (bytes: one of each, per
    loop iteration)."""
    wanted = shapes | {(n, k) for k, n in shapes}
    fused = set(re.findall(r" fusion\(.*?calls=%?([\w.\-]+)", hlo_text))  # fusions' bodies
    bodies = set(re.findall(r" while\(.*?body=%?([\w.\-]+)", hlo_text))
    ops: dict[str, int] = {}
    count = nbytes = 0
    computation = None
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            computation = header.group(1)
            continue
        m = _RESULT.match(line)
        if not m or m.group(5) in _PASSIVE or computation in fused or computation not in bodies:
            continue
        dims = tuple(int(d) for d in m.group(3).split(",") if d)
        if len(dims) == 2 and dims in wanted:
            kind = m.group(5) if m.group(5) != "fusion" else re.sub(r"[.\d]+$", "", m.group(1))
            ops[kind] = ops.get(kind, 0) + 1
            count += 1
            packed = "E(4)" in (m.group(4) or "")
            nbytes += dims[0] * dims[1] * _BYTES.get(m.group(2), 4) // (2 if packed else 1)
    return {"count": count, "bytes": nbytes, "ops": ops}


def step_time(model, batch: int, context: int, repeats: int) -> tuple[float, str]:
    """Median seconds of one decode step (1 token a row over `context` cached tokens) and the
    compiled step's HLO text."""
    cfg = model.cfg
    cache = init_cache(cfg, batch, context + 8)
    cache = cache.replace(lengths=jnp.full((batch,), context, jnp.int32))
    tokens = jnp.ones((batch, 1), jnp.int32)
    positions = jnp.full((batch, 1), context, jnp.int32)

    def step(params, cache):
        out = forward(cfg, params, tokens, positions, cache)
        return out.logits, out.cache.replace(lengths=cache.lengths)  # the same context each call

    compiled = jax.jit(step, donate_argnums=1).lower(model.params, cache).compile()
    logits, cache = compiled(model.params, cache)
    jax.block_until_ready(logits)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        logits, cache = compiled(model.params, cache)
        jax.block_until_ready(logits)
        times.append(time.perf_counter() - start)
    if not bool(jnp.isfinite(logits).all()):
        raise FloatingPointError("the step's logits are not finite")
    return statistics.median(times), compiled.as_text()


def run_mode(s: dict, mode: str, layers: int, bandwidth_gb_s: float, say) -> list[dict]:
    quantize = None if mode in FLOAT_MODES else mode
    dtype = mode if mode in FLOAT_MODES else s["dtype"]
    try:
        check_quantize(quantize)
    except ValueError as err:
        say(f"{mode}: not run: {err}")
        return [{"mode": mode, "supported": False, "error": str(err)}]
    spec = f"{s['model']}:{layers}" if s["model"] != "random:tiny" else s["model"]
    model = load_target(spec, dtype, quantize=quantize)
    weights = stored_bytes(model.params)
    rows = []
    for batch in s["batch_sizes"]:
        seconds, text = step_time(model, batch, s["context"], s["repeats"])
        copies = weight_copies(text, kernel_shapes(model.params))
        floor_s = (weights + batch * kv_bytes(model.cfg, s["context"])) / (bandwidth_gb_s * 1e9)
        row = {"mode": mode, "supported": True, "batch_size": batch, "step_ms": seconds * 1e3,
               "floor_ms": floor_s * 1e3, "fraction_of_floor": floor_s / seconds,
               "weight_bytes": weights, "layers": model.cfg.num_layers,
               "weight_copies_per_layer": copies["count"], "copy_bytes_per_layer": copies["bytes"],
               "copy_ops": copies["ops"]}
        say(f"{mode} B={batch}: {row['step_ms']:.3f} ms a step (floor {row['floor_ms']:.3f}, "
            f"{row['fraction_of_floor']:.0%}); weight copies a layer: {copies['count']} "
            f"({copies['bytes'] / 1e6:.1f} MB: {copies['ops']})")
        rows.append(row)
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    s = dict(SMOKE if args.smoke else FULL)
    if args.modes:
        s["modes"] = tuple(args.modes)
    if args.context:
        s["context"] = args.context
    t0 = time.perf_counter()
    say = lambda msg: print(f"[{time.perf_counter() - t0:6.1f} s] {msg}", file=sys.stderr, flush=True)
    bandwidth = jnp_bandwidth(int(s["bandwidth_gb"] * 1e9), repeats=5)
    device = jax.devices()[0]
    say(f"{jax.default_backend()} {device.device_kind}: streaming {bandwidth:.1f} GB/s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "gpu_quant_smoke.json" if args.smoke else "gpu_quant.json"
    results = []
    for mode in s["modes"]:  # the file is rewritten after each mode: a timeout keeps the done ones
        results += run_mode(s, mode, args.layers, bandwidth, say)
        report = {"settings": {**s, "layers": args.layers}, "device": device.device_kind,
                  "backend": jax.default_backend(), "jax": jax.__version__,
                  "bandwidth_gb_s": bandwidth, "results": results, "wall_s": time.perf_counter() - t0}
        (out / name).write_text(json.dumps(report, indent=2) + "\n")
    for r in results:
        if not r["supported"]:
            print(f"{r['mode']:>9}: not supported here: {r['error']}")
            continue
        print(f"{r['mode']:>9} B={r['batch_size']:<3} {r['step_ms']:8.3f} ms  floor {r['floor_ms']:7.3f} ms  "
              f"{r['fraction_of_floor']:5.0%} of the floor  weight copies a layer {r['weight_copies_per_layer']} "
              f"({r['copy_bytes_per_layer'] / 1e6:.1f} MB)")
    print(f"wrote {out / name} ({report['wall_s']:.0f} s)")
    print("# " + "; ".join(f"{r['mode']} B={r['batch_size']} {r['fraction_of_floor']:.0%} of the floor, "
                           f"{r['weight_copies_per_layer']} copies a layer" if r["supported"]
                           else f"{r['mode']} not supported" for r in results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
