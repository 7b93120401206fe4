"""Verify attention on an H200: Pallas kernel vs the XLA path vs jax's decode_attention.gqa.

    python benchmarks/gpu_verify_attention.py [--out DIR] [--budget-s 240] [--no-e2e]
    python benchmarks/gpu_verify_attention.py --smoke      # CPU, interpret mode, tiny sizes

ONE script for issue 4, in priority order, inside a time budget (< 5 minutes on the H200):
  1. ceilings measured in this run: elementwise copy (y = x + 1, read + write) and bf16 matmul;
  2. kernel vs `verify_attention_reference` on a few ragged / tree-masked shapes (rel. error);
  3. the issue's target point (B=8, 32K, G=4, T=1..64), then a small tuning sweep there;
  4. end to end: 8B-shaped layers ×4 (random bf16 weights, 4K context), kernel vs XLA path,
     each beside its physical floor max(FLOPs / matmul rate, bytes / copy bandwidth);
  5. the rest of the grid: B ∈ {1, 8, 64} × cached length ∈ {4K, 32K} × G ∈ {4, 8} ×
     T ∈ {1, 2, 4, 8, 16, 32, 64}; head_dim 128, bf16, 8 KV heads (the XLA path is skipped
     where its f32 score tensor alone passes 4 GiB).
Every timing is the median over groups of back-to-back calls (ms per call). "BW" is the
fraction of the measured copy bandwidth reached by the K/V bytes each call must read. Writes
JSON + markdown to --out (default $OUT, else benchmarks/results) and prints a short table last.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specjax.kernels.reference import verify_attention_reference
from specjax.kernels.verify_attention import verify_attention
from specjax.models.cache import init_cache
from specjax.models.config import ModelConfig
from specjax.models.llama import causal_mask, forward, init_params
from specjax.tree import k_ary

TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}


@dataclasses.dataclass(frozen=True)
class Check:
    """One correctness shape: ragged lengths in a cache of `capacity`, a k-ary draft tree."""

    lengths: tuple[int, ...]
    capacity: int
    group: int
    seq: int
    head_dim: int
    dtype: str
    opts: tuple[tuple[str, int], ...] = ()


@dataclasses.dataclass(frozen=True)
class Sizes:
    batches: tuple[int, ...]
    lengths: tuple[int, ...]
    groups: tuple[int, ...]
    seqs: tuple[int, ...]
    kv_heads: int
    head_dim: int
    target: tuple[int, int, int]  # (B, L, G) of the issue's target
    sweep: tuple[tuple[tuple[str, int], ...], ...]  # kernel option sets tried at the target
    gqa: tuple[tuple[str, int], ...]  # decode_attention.gqa options
    checks: tuple[Check, ...]
    e2e_model: dict
    e2e_batches: tuple[int, ...]
    e2e_seqs: tuple[int, ...]
    e2e_length: int
    copy_mib: int
    matmul_n: int
    xla_max_score_bytes: int
    timing_groups: int
    group_s: float


FULL = Sizes(
    batches=(8, 1, 64), lengths=(32768, 4096), groups=(4, 8), seqs=(1, 2, 4, 8, 16, 32, 64),
    kv_heads=8, head_dim=128, target=(8, 32768, 4),
    sweep=(
        (("k_splits", 4),), (("k_splits", 16),), (("k_splits", 32),), (("block_k", 32),),
        (("block_k", 128),), (("num_stages", 3),), (("num_warps", 4),), (("block_q", 64),),
    ),
    gqa=(("block_h", 16), ("block_k", 128), ("k_splits", 8)),
    checks=(
        Check((0, 1000, 4100), 4160, 4, 32, 128, "bfloat16"),
        Check((0, 1000, 4100), 4160, 4, 32, 128, "bfloat16", (("k_splits", 4), ("block_k", 128))),
        Check((777, 33), 1024, 8, 16, 64, "float32", (("block_q", 64), ("block_k", 32))),
        Check((32768, 12345), 32768, 1, 1, 128, "bfloat16"),
        Check((3000,), 4096, 16, 64, 128, "bfloat16"),
    ),
    e2e_model={
        "vocab_size": 1024, "hidden_size": 4096, "intermediate_size": 14336, "num_layers": 4,
        "num_heads": 32, "num_kv_heads": 8, "head_dim": 128, "rope_theta": 500000.0,
        "dtype": "bfloat16", "name": "8b-shaped-x4",
    },
    e2e_batches=(1, 16, 64), e2e_seqs=(1, 8, 32), e2e_length=4096,
    copy_mib=1024, matmul_n=8192, xla_max_score_bytes=4 << 30, timing_groups=5, group_s=0.03,
)

SMOKE = Sizes(
    batches=(2, 1), lengths=(64,), groups=(2, 4), seqs=(1, 4),
    kv_heads=2, head_dim=64, target=(2, 64, 2),
    sweep=((("k_splits", 2),), (("block_k", 32),)),
    gqa=(("block_h", 16), ("block_k", 16), ("k_splits", 2)),
    checks=(
        Check((0, 70, 96), 96, 4, 3, 64, "bfloat16", (("block_k", 32),)),
        Check((33, 5), 64, 3, 5, 64, "float32", (("block_k", 16), ("k_splits", 2))),
    ),
    e2e_model={
        "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_layers": 2,
        "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "dtype": "bfloat16", "name": "tiny",
    },
    e2e_batches=(1, 2), e2e_seqs=(1, 4), e2e_length=64,
    copy_mib=16, matmul_n=256, xla_max_score_bytes=1 << 30, timing_groups=2, group_s=0.0,
)


# ---------------------------------------------------------------------------------------------
# Timing and budget
# ---------------------------------------------------------------------------------------------


class Budget:
    """Wall-clock budget of the whole run; `allows(s)` says whether s more seconds fit."""

    def __init__(self, seconds: float):
        self.start, self.seconds, self.skipped = time.perf_counter(), seconds, 0

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def allows(self, seconds: float) -> bool:
        ok = self.elapsed() + seconds <= self.seconds
        self.skipped += not ok
        return ok


def time_ms(fn, *args, groups: int, group_s: float) -> float:
    """Median ms per call over `groups` groups of back-to-back calls (after a warm-up call)."""
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    calls = max(1, min(100, int(group_s / max(time.perf_counter() - start, 1e-6))))
    samples = []
    for _ in range(groups):
        start = time.perf_counter()
        jax.block_until_ready([fn(*args) for _ in range(calls)])
        samples.append((time.perf_counter() - start) / calls)
    return 1e3 * statistics.median(samples)


def guarded(record: dict, measure) -> dict:
    """Runs `measure()` -> dict of results into `record`; an exception becomes record['error']."""
    try:
        record.update(measure())
    except Exception as exc:
        record["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return record


def ceilings(sizes: Sizes) -> dict:
    """Copy bandwidth (bytes/s, read + write of y = x + 1) and bf16 matmul rate (FLOP/s)."""
    x = jnp.ones((sizes.copy_mib << 18,), jnp.float32)
    copy_ms = time_ms(jax.jit(lambda a: a + 1.0), x, groups=sizes.timing_groups, group_s=0.05)
    n = sizes.matmul_n
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.bfloat16)
    mm_ms = time_ms(jax.jit(jnp.matmul), a, a, groups=sizes.timing_groups, group_s=0.05)
    return {"copy_bytes_per_s": 2 * x.nbytes / (copy_ms * 1e-3),
            "matmul_flop_per_s": 2 * n**3 / (mm_ms * 1e-3)}


# ---------------------------------------------------------------------------------------------
# Attention inputs and implementations
# ---------------------------------------------------------------------------------------------


def tree_mask(batch: int, seq: int) -> jax.Array:
    """`[B, T, T]` verify-layout mask of a k-ary draft tree with T − 1 nodes (T = 1: root)."""
    mask = np.ones((1, 1), bool) if seq == 1 else k_ary((4, 3, 2, 2, 2), seq - 1).ancestor_mask()
    return jnp.broadcast_to(jnp.asarray(mask), (batch, seq, seq))


def normal(key, shape, dtype) -> jax.Array:
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def cache_arrays(key, batch, capacity, kv_heads, head_dim, dtype):
    """One layer of `KVCache`: k_cache `[B, KVH, Dh, S]`, v_cache `[B, KVH, S, Dh]`."""
    k1, k2 = jax.random.split(key)
    return (normal(k1, (batch, kv_heads, head_dim, capacity), dtype),
            normal(k2, (batch, kv_heads, capacity, head_dim), dtype))


def token_major(k_cache, v_cache):
    """`[B, S, KVH, Dh]` copies of one cache layer (the layout jax's decode_attention takes)."""
    return (jnp.transpose(k_cache, (0, 3, 1, 2)), jnp.transpose(v_cache, (0, 2, 1, 3)))


def new_token_arrays(key, batch, seq, group, kv_heads, head_dim, dtype):
    """q `[B, T, KVH·G, Dh]`, k_new, v_new `[B, T, KVH, Dh]`."""
    k1, k2, k3 = jax.random.split(key, 3)
    return (
        normal(k1, (batch, seq, kv_heads * group, head_dim), dtype),
        normal(k2, (batch, seq, kv_heads, head_dim), dtype),
        normal(k3, (batch, seq, kv_heads, head_dim), dtype),
    )


def kernel_fn(interpret: bool | None, opts: tuple = ()):
    """The Pallas kernel with static options, as f(q, k_new, v_new, k_cache, v_cache, lengths, mask)."""
    return functools.partial(verify_attention, interpret=interpret, **dict(opts))


XLA_FN = jax.jit(verify_attention_reference)


def gqa_fn(interpret: bool, opts: tuple):
    """jax's decode_attention.gqa at T = 1: q `[B, Hq, Dh]` against the cache, per-row lengths."""
    from jax.experimental.pallas.ops.gpu import decode_attention

    call = functools.partial(decode_attention.gqa, interpret=interpret, **dict(opts))
    return jax.jit(lambda q, k_cache, v_cache, lengths: call(q[:, 0], k_cache, v_cache, None, lengths))


def relative_error(out: jax.Array, ref: jax.Array) -> float:
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    if not np.isfinite(out).all():
        return float("nan")
    return float(np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-30))


def run_check(check: Check, interpret: bool | None, seed: int) -> dict:
    """Kernel (outputs poisoned with NaN) vs the reference at HIGHEST matmul precision."""
    key_cache, key_new = jax.random.split(jax.random.PRNGKey(seed))
    batch, dtype = len(check.lengths), jnp.dtype(check.dtype)
    k_cache, v_cache = cache_arrays(key_cache, batch, check.capacity, 2, check.head_dim, dtype)
    q, k_new, v_new = new_token_arrays(key_new, batch, check.seq, check.group, 2, check.head_dim, dtype)
    args = (q, k_new, v_new, k_cache, v_cache, jnp.asarray(check.lengths, jnp.int32),
            tree_mask(batch, check.seq))
    out = verify_attention(*args, interpret=interpret, poison=True, **dict(check.opts))
    with jax.default_matmul_precision("highest"):
        ref = XLA_FN(*args)
    err = relative_error(out, ref)
    return {"rel_error": err, "ok": bool(err <= TOLERANCE[check.dtype])}


# ---------------------------------------------------------------------------------------------
# Attention grid
# ---------------------------------------------------------------------------------------------


def kv_bytes(batch: int, length: int, kv_heads: int, head_dim: int, itemsize: int) -> int:
    """Bytes of K and V a call must read: the cached prefix of every row and KV head."""
    return 2 * batch * length * kv_heads * head_dim * itemsize


def xla_score_bytes(batch, length, group, seq, kv_heads) -> int:
    return 4 * batch * kv_heads * group * seq * (length + seq)


def attention_point(impl, fn, args, meta: dict, sizes: Sizes, copy_bw: float) -> dict:
    """Times fn(*args); returns a result row (ms, K/V bandwidth fraction)."""
    record = {"section": "attention", "impl": impl, **meta}

    def measure():
        ms = time_ms(fn, *args, groups=sizes.timing_groups, group_s=sizes.group_s)
        return {"ms": ms, "bw_frac": meta["kv_bytes"] / (ms * 1e-3) / copy_bw}

    return guarded(record, measure)


def grid_points(sizes: Sizes, batch: int, length: int, group: int, impls: tuple[str, ...]):
    """(impl, T, opts) to time at one (B, L, G), honouring the XLA memory cap."""
    for seq in sizes.seqs:
        for impl in impls:
            if impl == "gqa" and seq != 1:
                continue
            if impl == "xla" and xla_score_bytes(
                batch, length, group, seq, sizes.kv_heads
            ) > sizes.xla_max_score_bytes:
                continue
            yield impl, seq, ()


def run_attention_block(
    sizes, batch, length, group, points, interpret, copy_bw, budget, key
) -> list[dict]:
    """All points (impl, T, opts) at one (B, L, G), sharing one random cache."""
    dtype = jnp.dtype(jnp.bfloat16)
    k_cache, v_cache = cache_arrays(key, batch, length, sizes.kv_heads, sizes.head_dim, dtype)
    lengths = jnp.full((batch,), length, jnp.int32)
    rows = []
    for impl, seq, opts in points:
        if not budget.allows(4.0):
            continue
        q, k_new, v_new = new_token_arrays(
            jax.random.fold_in(key, seq), batch, seq, group, sizes.kv_heads, sizes.head_dim, dtype
        )
        meta = {"B": batch, "L": length, "G": group, "T": seq, "opts": dict(opts),
                "kv_bytes": kv_bytes(batch, length, sizes.kv_heads, sizes.head_dim, 2)}
        if impl == "gqa":
            fn, args = gqa_fn(bool(interpret), sizes.gqa), (q, *token_major(k_cache, v_cache), lengths)
        else:
            fn = kernel_fn(interpret, opts) if impl == "kernel" else XLA_FN
            args = (q, k_new, v_new, k_cache, v_cache, lengths, tree_mask(batch, seq))
        rows.append(attention_point(impl, fn, args, meta, sizes, copy_bw))
        print(format_point(rows[-1]), flush=True)
    return rows


def format_point(row: dict) -> str:
    head = f"  {row['impl']:6s} B={row['B']:<3d} L={row['L']:<6d} G={row['G']} T={row['T']:<3d}"
    if row.get("opts"):
        head += f" {row['opts']}"
    if "error" in row:
        return f"{head} ERROR {row['error']}"
    return f"{head} {row['ms']:8.3f} ms  BW {100 * row['bw_frac']:5.1f}%"


def add_ratios(rows: list[dict]) -> None:
    """ratio_vs_T1: ms / ms at T=1 of the same impl, B, L, G and options."""
    def key(r):
        return (r["impl"], r["B"], r["L"], r["G"], tuple(sorted(r["opts"].items())))

    base = {key(r): r["ms"] for r in rows if r.get("T") == 1 and "ms" in r}
    for r in rows:
        if "ms" in r and key(r) in base:
            r["ratio_vs_T1"] = r["ms"] / base[key(r)]


# ---------------------------------------------------------------------------------------------
# End to end
# ---------------------------------------------------------------------------------------------


def layer_matmul_params(cfg: ModelConfig) -> int:
    """Weights each token multiplies through, per layer (q, k, v, o, gate, up, down)."""
    hidden, q_dim, kv_dim = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return hidden * (2 * q_dim + 2 * kv_dim) + 3 * hidden * cfg.intermediate_size


def physical_floor(cfg, batch, seq, length, weight_bytes, ceil) -> dict:
    """max(FLOPs / matmul rate, bytes / copy bandwidth) of one forward, and which bound wins."""
    tokens = batch * seq
    attn_flops = 4 * tokens * cfg.num_heads * cfg.head_dim * (length + seq)
    flops = cfg.num_layers * (2 * tokens * layer_matmul_params(cfg) + attn_flops)
    kv = cfg.num_layers * kv_bytes(batch, length, cfg.num_kv_heads, cfg.head_dim, cfg.jnp_dtype.itemsize)
    compute_s = flops / ceil["matmul_flop_per_s"]
    memory_s = (weight_bytes + kv) / ceil["copy_bytes_per_s"]
    return {"floor_ms": 1e3 * max(compute_s, memory_s),
            "bound": "compute" if compute_s > memory_s else "memory",
            "flops": flops, "bytes": weight_bytes + kv, "kv_bytes": kv}


def e2e_forward(cfg: ModelConfig):
    """jit(params, tokens, positions, cache, mask) -> final hidden (the cache write is dead code)."""
    return jax.jit(lambda p, t, pos, c, m: forward(cfg, p, t, pos, c, m, compute_logits=False).hidden)


def e2e_point(record: dict, fn, args, sizes: Sizes) -> dict:
    """Times one forward into `record` (beside its floor) and prints it."""
    guarded(record, lambda: {"ms": time_ms(fn, *args, groups=sizes.timing_groups,
                                           group_s=sizes.group_s)})
    result = record.get("error") or (
        f"{record['ms']:8.3f} ms  floor {record['floor_ms']:.3f} ms ({record['bound']})"
    )
    print(f"  e2e {record['impl']:6s} B={record['B']:<3d} T={record['T']:<3d} {result}", flush=True)
    return record


def run_e2e(sizes: Sizes, ceil: dict, budget: Budget) -> list[dict]:
    base = ModelConfig(**sizes.e2e_model)
    params = init_params(base, jax.random.PRNGKey(1))
    # the decoder layers' weights (the embedding is only gathered; no LM head is computed)
    weight_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(params["params"]["layers"]))
    fns = {impl: e2e_forward(base.replace(attention_impl=impl)) for impl in ("pallas", "xla")}
    rows = []
    for batch in sizes.e2e_batches:
        layout = init_cache(base, batch, sizes.e2e_length + max(sizes.e2e_seqs))
        k1, k2 = jax.random.split(jax.random.PRNGKey(batch))
        cache = layout.replace(k=normal(k1, layout.k.shape, base.jnp_dtype),
                               v=normal(k2, layout.v.shape, base.jnp_dtype),
                               lengths=jnp.full((batch,), sizes.e2e_length, jnp.int32))
        for seq in sizes.e2e_seqs:
            tokens = jnp.ones((batch, seq), jnp.int32)
            positions = cache.lengths[:, None] + jnp.arange(seq)
            floor = physical_floor(base, batch, seq, sizes.e2e_length, weight_bytes, ceil)
            args = (params, tokens, positions, cache, causal_mask(batch, seq))
            for impl, fn in fns.items():
                if budget.allows(8.0):
                    record = {"section": "e2e", "impl": impl, "B": batch,
                              "L": sizes.e2e_length, "T": seq, **floor}
                    rows.append(e2e_point(record, fn, args, sizes))
    return rows


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def fmt(x, spec=".3f") -> str:
    return "–" if x is None else format(x, spec)


def lookup(rows, **match):
    for r in rows:
        if all(r.get(k) == v for k, v in match.items()) and "ms" in r:
            return r
    return None


def attention_table(rows: list[dict], sizes: Sizes) -> list[str]:
    """One line per (B, L, G): kernel ms per T, T_hi/T=1, BW at T=1, XLA and gqa at T=1."""
    seqs, t_hi = sizes.seqs, max(t for t in sizes.seqs if t <= 32)
    lines = ["| B | L | G | kernel ms " + " ".join(f"T={t}" for t in seqs)
             + f" | T={t_hi}/T=1 | BW T=1 | XLA T=1 → T={t_hi} | gqa T=1 |",
             "|---|---|---|---|---|---|---|---|"]
    for batch in sizes.batches:
        for length in sizes.lengths:
            for group in sizes.groups:
                pick = functools.partial(lookup, rows, section="attention", B=batch, L=length,
                                         G=group, opts={})
                kern = [pick(impl="kernel", T=t) for t in seqs]
                if not any(kern):
                    continue
                hi, xla1, xla_hi = pick(impl="kernel", T=t_hi), pick(impl="xla", T=1), pick(impl="xla", T=t_hi)
                gqa1 = pick(impl="gqa", T=1)
                lines.append(
                    f"| {batch} | {length} | {group} | "
                    + " ".join(fmt(r and r["ms"]) for r in kern)
                    + f" | {fmt(hi and hi.get('ratio_vs_T1'), '.2f')}"
                    + f" | {fmt(kern[0] and 100 * kern[0]['bw_frac'], '.0f')}%"
                    + f" | {fmt(xla1 and xla1['ms'])} → {fmt(xla_hi and xla_hi['ms'])}"
                    + f" | {fmt(gqa1 and gqa1['ms'])} |"
                )
    return lines


def target_verdict(rows: list[dict], sizes: Sizes) -> str:
    """The issue's attention target at (B, L, G) = sizes.target: T=32/T=1 ≤ 1.25, BW(T=1) ≥ 70 %."""
    batch, length, group = sizes.target
    t_hi = max(t for t in sizes.seqs if t <= 32)
    pick = functools.partial(lookup, rows, section="attention", impl="kernel", B=batch, L=length,
                             G=group, opts={})
    one, hi = pick(T=1), pick(T=t_hi)
    if not (one and hi and "ratio_vs_T1" in hi):
        return f"target B={batch} L={length} G={group}: not measured"
    ok = hi["ratio_vs_T1"] <= 1.25 and one["bw_frac"] >= 0.70
    return (f"target B={batch} L={length} G={group}: T={t_hi}/T=1 = {hi['ratio_vs_T1']:.2f} "
            f"(≤ 1.25), BW at T=1 = {100 * one['bw_frac']:.0f}% (≥ 70%): "
            + ("MET" if ok else "NOT MET"))


def e2e_table(rows: list[dict]) -> list[str]:
    lines = ["| B | T | kernel ms | XLA ms | floor ms | kernel/floor | bound | K/V share of bytes |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["section"] != "e2e" or r["impl"] != "pallas":
            continue
        xla = lookup(rows, section="e2e", impl="xla", B=r["B"], T=r["T"])
        ms = r.get("ms")
        lines.append(f"| {r['B']} | {r['T']} | {fmt(ms)} | {fmt(xla and xla['ms'])} | "
                     f"{fmt(r['floor_ms'])} | {fmt(ms and ms / r['floor_ms'], '.2f')} | {r['bound']} | "
                     f"{100 * r['kv_bytes'] / r['bytes']:.0f}% |")
    return lines


def sweep_table(rows: list[dict]) -> list[str]:
    lines = ["| T | options | ms | BW |", "|---|---|---|---|"]
    for r in rows:
        if r["section"] == "attention" and r["impl"] == "kernel" and r.get("sweep"):
            lines.append(f"| {r['T']} | {r['opts'] or 'default'} | {fmt(r.get('ms'))} | "
                         f"{fmt(r.get('bw_frac') and 100 * r['bw_frac'], '.0f')}% |")
    return lines


def check_label(check: dict) -> str:
    return (f"lengths {list(check['lengths'])}/{check['capacity']} G={check['group']} "
            f"T={check['seq']} D={check['head_dim']} {check['dtype']} {dict(check['opts'])}")


def report(results: dict, sizes: Sizes) -> str:
    ceil, rows = results["ceilings"], results["rows"]
    head = (f"{results['device']}, jax {results['jax']}; copy {ceil['copy_bytes_per_s'] / 1e12:.2f} "
            f"TB/s, bf16 matmul {ceil['matmul_flop_per_s'] / 1e12:.0f} TFLOP/s; "
            f"{results['elapsed_s']:.0f} s, {results['skipped']} points skipped (budget)")
    checks = [f"- check {check_label(c['check'])}: " + (c.get("error") or f"rel err "
              f"{c['rel_error']:.2e} " + ("ok" if c["ok"] else "FAIL")) for c in results["checks"]]
    errors = sorted({f"{r['impl']}: {r['error']}" for r in rows if "error" in r})
    return "\n".join(
        [f"# verify attention — {head}", "", *checks, "", target_verdict(rows, sizes), "",
         "## Sweep at the target point", "",
         *sweep_table(rows), "", "## End to end", "", *e2e_table(rows), "",
         "## Attention (bf16, D=128, KVH=8 unless --smoke)", "", *attention_table(rows, sizes),
         "", *(["## Errors", "", *errors] if errors else [])]
    )


def output_dir(arg: str | None) -> Path:
    path = Path(arg or os.environ.get("OUT") or Path(__file__).parent / "results")
    path.mkdir(parents=True, exist_ok=True)
    return path


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, interpret mode (CPU)")
    parser.add_argument("--out", default=None, help="output folder (default $OUT or benchmarks/results)")
    parser.add_argument("--budget-s", type=float, default=240.0, help="wall-clock budget of the run")
    parser.add_argument("--no-e2e", action="store_true", help="skip the end-to-end section")
    return parser.parse_args(argv)


def run(args) -> dict:
    sizes = SMOKE if args.smoke else FULL
    interpret = True if args.smoke else None
    budget = Budget(args.budget_s)
    ceil = ceilings(sizes)
    print(f"copy {ceil['copy_bytes_per_s'] / 1e12:.3f} TB/s, matmul "
          f"{ceil['matmul_flop_per_s'] / 1e12:.1f} TFLOP/s", flush=True)
    checks = []
    for i, check in enumerate(sizes.checks):
        checks.append(guarded({"check": dataclasses.asdict(check)}, lambda c=check, i=i: run_check(c, interpret, i)))
        print(f"  check {check_label(checks[-1]['check'])}: {checks[-1]}", flush=True)
    copy_bw, key = ceil["copy_bytes_per_s"], jax.random.PRNGKey(0)
    batch, length, group = sizes.target
    target_points = list(grid_points(sizes, batch, length, group, ("kernel", "xla", "gqa")))
    sweep_points = [("kernel", t, opts) for t in (1, max(s for s in sizes.seqs if s <= 32))
                    for opts in sizes.sweep]
    rows = run_attention_block(sizes, batch, length, group, target_points + sweep_points,
                               interpret, copy_bw, budget, key)
    for r in rows:
        r["sweep"] = bool(r["opts"])
    if not args.no_e2e:
        rows += run_e2e(sizes, ceil, budget)
    for b in sizes.batches:
        for length_ in sizes.lengths:
            for g in sizes.groups:
                if (b, length_, g) != sizes.target and budget.allows(4.0):
                    points = list(grid_points(sizes, b, length_, g, ("kernel", "xla", "gqa")))
                    rows += run_attention_block(sizes, b, length_, g, points, interpret,
                                                copy_bw, budget, key)
    add_ratios([r for r in rows if r["section"] == "attention"])
    device = jax.devices()[0]
    return {"device": getattr(device, "device_kind", str(device)), "jax": jax.__version__,
            "smoke": args.smoke, "ceilings": ceil, "checks": checks, "rows": rows,
            "elapsed_s": budget.elapsed(), "skipped": budget.skipped}


def main(argv=None) -> int:
    args = parse_args(argv)
    results = run(args)
    sizes = SMOKE if args.smoke else FULL
    text = report(results, sizes)
    out = output_dir(args.out)
    stem = "gpu_verify_attention" + ("_smoke" if args.smoke else "")
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1, default=str))
    (out / f"{stem}.md").write_text(text + "\n")
    print("\n" + text)
    failed = [c for c in results["checks"] if not c.get("ok")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
