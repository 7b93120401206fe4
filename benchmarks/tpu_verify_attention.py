"""Verify attention on a TPU: the Mosaic kernel (kernels/verify_attention_tpu.py) vs the XLA path.

    python benchmarks/tpu_verify_attention.py [--out DIR] [--budget-s 240]   # on a TPU
    python benchmarks/tpu_verify_attention.py --smoke     # CPU, interpret mode, tiny sizes
    python benchmarks/tpu_verify_attention.py --predict   # the PREDICTED v5e / v6e table, no run

ONE script for issue 18, in priority order, inside a time budget:
  1. the copy ceiling measured in this run (y = x + 1 over 1 GiB, read + write) and bf16 matmul;
  2. kernel vs `verify_attention_reference` on ragged / tree-masked shapes (rel. error);
  3. the issue's point: B=8, 32K cached tokens, G=4 (8 KV heads, head_dim 128, bf16 — one
     Llama-3-8B layer), T=1 vs T=32, kernel and XLA, then T ∈ {2, 4, 8, 16, 64} and a
     block_k / chunk_k sweep at T=1 and 32 while the budget lasts.
"BW" is the fraction of the measured copy bandwidth reached by the K/V bytes each call must
read (2·B·L·KVH·Dh·2 bytes); "HBM" the fraction of the chip's published HBM bandwidth where
the chip is known. Writes JSON + markdown to --out (default $OUT, else benchmarks/results).

`--predict` writes tpu_verify_attention_predicted.md: a roofline PREDICTION for TPU v5e and
v6e from their published HBM bandwidth and bf16 peak, not a measurement.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_verify_attention as gva  # shared timing, inputs, budget, ceilings

from specjax.kernels.verify_attention_tpu import verify_attention

#: published per-chip figures (Google Cloud TPU documentation): HBM bytes/s, bf16 FLOP/s, MXU
CHIPS = {
    "TPU v5e": {"kinds": ("TPU v5 lite", "TPU v5e"), "hbm": 819e9, "bf16": 197e12, "mxu": 128},
    "TPU v6e": {"kinds": ("TPU v6 lite", "TPU v6e"), "hbm": 1640e9, "bf16": 918e12, "mxu": 256},
}
COPY_SHARE = 0.85  # assumed copy ceiling / published bandwidth, for the prediction only


@dataclasses.dataclass(frozen=True)
class Sizes:
    batch: int
    length: int
    group: int
    kv_heads: int
    head_dim: int
    seqs: tuple[int, ...]  # T=1 and T=32 first, then the rest
    sweep: tuple[tuple[tuple[str, int], ...], ...]  # kernel option sets at T=1 and T=32
    checks: tuple[gva.Check, ...]
    copy_mib: int
    matmul_n: int
    timing_groups: int
    group_s: float


FULL = Sizes(
    batch=8, length=32768, group=4, kv_heads=8, head_dim=128, seqs=(1, 32, 2, 4, 8, 16, 64),
    sweep=((("block_k", 1024),), (("block_k", 4096),), (("chunk_k", 256),),
           (("chunk_k", 1024),), (("block_k", 4096), ("chunk_k", 1024))),
    checks=(
        gva.Check((0, 1000, 4100), 4160, 4, 32, 128, "bfloat16"),
        gva.Check((777, 33), 1024, 8, 16, 64, "float32", (("block_k", 512), ("chunk_k", 128))),
        gva.Check((32768, 12345), 32768, 1, 1, 128, "bfloat16"),
        gva.Check((3000,), 4096, 16, 64, 128, "bfloat16"),
    ),
    copy_mib=1024, matmul_n=8192, timing_groups=5, group_s=0.03,
)

SMOKE = Sizes(
    batch=2, length=512, group=2, kv_heads=2, head_dim=128, seqs=(1, 4),
    sweep=((("block_k", 128),),),
    checks=(gva.Check((0, 200, 300), 300, 4, 3, 128, "bfloat16", (("block_k", 128),)),),
    copy_mib=16, matmul_n=256, timing_groups=2, group_s=0.0,
)


def chip_of(device_kind: str) -> str | None:
    return next((name for name, c in CHIPS.items() if device_kind in c["kinds"]), None)


def kernel_fn(interpret: bool | None, opts: tuple = ()):
    return functools.partial(verify_attention, interpret=interpret, **dict(opts))


def run_check(check: gva.Check, interpret, seed: int) -> dict:
    """Kernel vs the reference at HIGHEST matmul precision on one ragged, tree-masked shape."""
    key_cache, key_new = jax.random.split(jax.random.PRNGKey(seed))
    batch, dtype = len(check.lengths), jnp.dtype(check.dtype)
    k_cache, v_cache = gva.cache_arrays(key_cache, batch, check.capacity, 2, check.head_dim, dtype)
    q, k_new, v_new = gva.new_token_arrays(key_new, batch, check.seq, check.group, 2,
                                           check.head_dim, dtype)
    args = (q, k_new, v_new, k_cache, v_cache, jnp.asarray(check.lengths, jnp.int32),
            gva.tree_mask(batch, check.seq))
    out = verify_attention(*args, interpret=interpret, **dict(check.opts))
    with jax.default_matmul_precision("highest"):
        ref = gva.XLA_FN(*args)
    err = gva.relative_error(out, ref)
    return {"rel_error": err, "ok": bool(err <= gva.TOLERANCE[check.dtype])}


def points(sizes: Sizes):
    """(impl, T, opts) in priority order: T=1 and 32 (kernel, XLA), the other T, the sweep."""
    first, rest = sizes.seqs[:2], sizes.seqs[2:]
    yield from ((impl, t, ()) for t in first for impl in ("kernel", "xla"))
    yield from (("kernel", t, ()) for t in rest)
    yield from (("kernel", t, opts) for opts in sizes.sweep for t in first)


def run_points(sizes: Sizes, interpret, copy_bw: float, hbm: float | None, budget) -> list[dict]:
    """Times every point at the target (B, L, G), sharing one random full cache."""
    dtype = jnp.dtype(jnp.bfloat16)
    key = jax.random.PRNGKey(0)
    batch, length = sizes.batch, sizes.length
    k_cache, v_cache = gva.cache_arrays(key, batch, length, sizes.kv_heads, sizes.head_dim, dtype)
    lengths = jnp.full((batch,), length, jnp.int32)
    timing = dataclasses.replace(gva.SMOKE, timing_groups=sizes.timing_groups, group_s=sizes.group_s)
    rows = []
    for impl, seq, opts in points(sizes):
        if not budget.allows(4.0):
            continue
        q, k_new, v_new = gva.new_token_arrays(jax.random.fold_in(key, seq), batch, seq,
                                               sizes.group, sizes.kv_heads, sizes.head_dim, dtype)
        meta = {"B": batch, "L": length, "G": sizes.group, "T": seq, "opts": dict(opts),
                "kv_bytes": gva.kv_bytes(batch, length, sizes.kv_heads, sizes.head_dim, 2)}
        fn = kernel_fn(interpret, opts) if impl == "kernel" else gva.XLA_FN
        args = (q, k_new, v_new, k_cache, v_cache, lengths, gva.tree_mask(batch, seq))
        row = gva.attention_point(impl, fn, args, meta, timing, copy_bw)
        if hbm and "ms" in row:
            row["hbm_frac"] = row["kv_bytes"] / (row["ms"] * 1e-3) / hbm
        rows.append(row)
        print(gva.format_point(row), flush=True)
    gva.add_ratios(rows)
    return rows


def report(results: dict) -> str:
    smoke = " (smoke: CPU interpret mode, not a timing)" if results["smoke"] else ""
    ceil = results["ceilings"]
    lines = [f"# TPU verify attention — {results['device']}, jax {results['jax']}{smoke}", "",
             f"Copy ceiling {ceil['copy_bytes_per_s'] / 1e9:.1f} GB/s, bf16 matmul "
             f"{ceil['matmul_flop_per_s'] / 1e12:.1f} TFLOP/s; {results['elapsed_s']:.0f} s, "
             f"{results['skipped']} points skipped (budget).", "", "## Checks", ""]
    lines += [f"- {gva.check_label(c['check'])}: "
              f"{c.get('error') or ('ok' if c['ok'] else 'FAIL')} (rel. error {c.get('rel_error')})"
              for c in results["checks"]]
    lines += ["", "## Attention (bf16, KVH=8, Dh=128 unless --smoke)", "",
              "| impl | B | L | G | T | opts | ms | ×T=1 | BW (copy) | HBM (published) |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results["rows"]:
        head = f"| {r['impl']} | {r['B']} | {r['L']} | {r['G']} | {r['T']} | {r['opts'] or ''} |"
        if "ms" not in r:
            lines.append(f"{head} {r.get('error')} | | | |")
            continue
        hbm = f"{100 * r['hbm_frac']:.1f}%" if "hbm_frac" in r else "–"
        lines.append(f"{head} {r['ms']:.3f} | {gva.fmt(r.get('ratio_vs_T1'), '.2f')} | "
                     f"{100 * r['bw_frac']:.1f}% | {hbm} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Prediction (no TPU needed)
# ---------------------------------------------------------------------------------------------


def predict_row(chip: dict, batch: int, length: int, group: int, kv_heads: int, head_dim: int,
                seq: int) -> dict:
    """Roofline of one call: K/V bytes / HBM bandwidth vs the MXU time of its two matmuls.

    K and V are the matmuls' stationary operands, loaded into the MXU tile by tile, so a pass
    costs at least `mxu` query rows' time: rows are padded to whole passes (T=1's 16 rows cost
    what 128 do on a v5e).
    """
    kv = gva.kv_bytes(batch, length, kv_heads, head_dim, 2)
    other = 2 * 2 * batch * seq * kv_heads * (group + 1) * head_dim  # q, out, new K/V (bf16)
    rows = -(-group * seq // 16) * 16
    mxu_rows = -(-rows // chip["mxu"]) * chip["mxu"]
    flops = 2 * 2 * batch * kv_heads * mxu_rows * length * head_dim
    memory_ms, mxu_ms = 1e3 * (kv + other) / chip["hbm"], 1e3 * flops / chip["bf16"]
    return {"T": seq, "kv_bytes": kv, "memory_ms": memory_ms, "mxu_ms": mxu_ms,
            "floor_ms": max(memory_ms, mxu_ms)}


def predicted_table(batch=8, length=32768, group=4, kv_heads=8, head_dim=128) -> str:
    """The PREDICTED markdown table for v5e and v6e at T=1 and T=32."""
    kv_gib = gva.kv_bytes(batch, length, kv_heads, head_dim, 2) / 2**30
    lines = [
        "# TPU verify attention — PREDICTED (roofline from published figures, not measured)",
        "",
        f"One Llama-3-8B-shaped layer: B={batch}, {length} cached tokens per row, {kv_heads} KV "
        f"heads × G={group} ({kv_heads * group} query heads), head_dim {head_dim}, bf16 cache; K/V "
        f"bytes read per call = 2·B·L·KVH·Dh·2 = {kv_gib:.2f} GiB. Published per chip: v5e "
        "819 GB/s HBM, 197 TFLOP/s bf16, 128×128 MXUs; v6e 1640 GB/s, 918 TFLOP/s, 256×256 MXUs.",
        "",
        "| chip | T | HBM floor ms | MXU floor ms | predicted ms (max) | T / T=1 | "
        f"predicted at {COPY_SHARE:.0%} of HBM, ms |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    shares = []
    for name, chip in CHIPS.items():
        base = None
        for seq in (1, 32):
            r = predict_row(chip, batch, length, group, kv_heads, head_dim, seq)
            base = base or r["floor_ms"]
            lines.append(
                f"| {name} | {seq} | {r['memory_ms']:.3f} | {r['mxu_ms']:.3f} | "
                f"{r['floor_ms']:.3f} | {r['floor_ms'] / base:.2f} | "
                f"{max(r['memory_ms'] / COPY_SHARE, r['mxu_ms']):.3f} |"
            )
        shares.append(f"{100 * r['mxu_ms'] / r['memory_ms']:.0f} % ({name})")
    lines += [
        "",
        f"Reading: the one-tile design reads each K/V block once for all G·T = {group * 32} query "
        "rows, so T=32 stays HBM-bound on both chips and is predicted to cost what T=1 costs; "
        f"the MXU time at T=32 is {' and '.join(shares)} of the HBM time (K/V are the MXU's "
        "stationary operands: a pass costs at least 128 rows on v5e, 256 on v6e, so T=1 pays "
        f"as much MXU time as T=32). {COPY_SHARE:.0%} of published bandwidth as the copy "
        "ceiling is an assumption (`benchmarks/tpu_verify_attention.py` measures the real one). "
        "Not modelled: the softmax's VPU/EUP work (~10 f32 element ops per score, "
        f"{batch * kv_heads * group * 32 * length:.1e} scores at T=32), which the MXU and DMA "
        "overlap only partly, and the ~0.35 µs fixed cost per grid step "
        f"({batch * kv_heads * length // 2048} steps of 2048 keys, hidden while a 1 MiB K+V "
        "block's copy takes longer: 1.3 µs on v5e, 0.64 µs on v6e).",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, interpret mode (CPU)")
    parser.add_argument("--predict", action="store_true",
                        help="write tpu_verify_attention_predicted.md (no run)")
    parser.add_argument("--out", default=None, help="output folder (default $OUT or benchmarks/results)")
    parser.add_argument("--budget-s", type=float, default=240.0, help="wall-clock budget of the run")
    return parser.parse_args(argv)


def run(args) -> dict:
    sizes = SMOKE if args.smoke else FULL
    interpret = True if args.smoke else None
    if not args.smoke and jax.default_backend() != "tpu":
        raise SystemExit(f"no TPU here ({jax.default_backend()}): use --smoke or --predict")
    budget = gva.Budget(args.budget_s)
    ceil = gva.ceilings(sizes)
    device = jax.devices()[0]
    kind = getattr(device, "device_kind", str(device))
    chip = chip_of(kind)
    print(f"{kind}: copy {ceil['copy_bytes_per_s'] / 1e9:.1f} GB/s, matmul "
          f"{ceil['matmul_flop_per_s'] / 1e12:.1f} TFLOP/s", flush=True)
    checks = []
    for i, check in enumerate(sizes.checks):
        checks.append(gva.guarded({"check": dataclasses.asdict(check)},
                                  lambda c=check, i=i: run_check(c, interpret, i)))
        print(f"  check {gva.check_label(checks[-1]['check'])}: {checks[-1]}", flush=True)
    rows = run_points(sizes, interpret, ceil["copy_bytes_per_s"],
                      CHIPS[chip]["hbm"] if chip else None, budget)
    return {"device": kind, "jax": jax.__version__, "smoke": args.smoke, "ceilings": ceil,
            "checks": checks, "rows": rows, "elapsed_s": budget.elapsed(),
            "skipped": budget.skipped}


def main(argv=None) -> int:
    args = parse_args(argv)
    out = gva.output_dir(args.out)
    if args.predict:
        path = out / "tpu_verify_attention_predicted.md"
        path.write_text(predicted_table() + "\n")
        print(path.read_text())
        return 0
    results = run(args)
    text = report(results)
    stem = "tpu_verify_attention" + ("_smoke" if args.smoke else "")
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1, default=str))
    (out / f"{stem}.md").write_text(text + "\n")
    print("\n" + text)
    return 1 if any(not c.get("ok") for c in results["checks"]) else 0


if __name__ == "__main__":
    sys.exit(main())
