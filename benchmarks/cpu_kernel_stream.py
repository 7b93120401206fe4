"""The CPU kernels reading from DRAM: SmolLM2-shaped calls, 30 layers, over copies of the
weights / KV cache cycled so that they do not stay in the (large, shared) L3.

    python benchmarks/cpu_kernel_stream.py matmul int8   # or int4 (two a byte), int4-bytes (one)
    python benchmarks/cpu_kernel_stream.py attention     # B = 1, 3 KV heads x 64

matmul: ms per 30 layers of the four int8 / int4 layer matmuls (576 x 960, 576 x 576,
576 x 3072, 1536 x 576) at M = 1, 2, 3, 5 rows, and GB/s of weight bytes read, values and
scales (min of 5 passes over the copies). int4 holds its values two a byte as `pack_params`
does (`qmatmul_cpu.pack_int4`); int4-bytes one a byte, as before 2026-12-07. attention: us per
`cache_attention` call at 752 keys (T = 1 and 3 new tokens) and 97 keys. One-off measurements
of kernel changes, not targets: docs/quantization.md quotes them.
"""
from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import specjax.models.quant as quant
from specjax.kernels import attention_cpu, qmatmul_cpu
from specjax.models.paths import cache_dir

LAYERS = 30
MATMULS = ((576, 960), (576, 576), (576, 3072), (1536, 576))


def timed(run, copies, repeats: int = 5) -> list[float]:
    """Seconds per copy of each pass over `copies` (run(copy) -> array)."""
    for c in copies:
        run(c).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for c in copies:
            out = run(c)
        out.block_until_ready()
        times.append((time.perf_counter() - start) / len(copies))
    return times


def matmul(mode: str, num_copies: int = 6) -> None:
    def kernel(seed, k, n):
        w = jax.random.normal(jax.random.PRNGKey(seed), (LAYERS, k, n), jnp.float32)
        q = quant.quantize_kernel(w, quant.SPECS[mode.removesuffix("-bytes")])
        pack = qmatmul_cpu.pack_int4 if mode == "int4" else qmatmul_cpu.pack
        return pack(q.qvalue), q.scale

    copies = [[kernel(10 * c + i, k, n) for i, (k, n) in enumerate(MATMULS)] for c in range(num_copies)]
    nbytes = sum(a.nbytes for pair in copies[0] for a in pair)
    for m in (1, 2, 3, 5):
        @jax.jit
        def layers(x, ws):
            def body(i, h):
                a = qmatmul_cpu.qmatmul(h, *ws[0], i)[:, :576]
                b = qmatmul_cpu.qmatmul(a, *ws[1], i)
                c = qmatmul_cpu.qmatmul(b, *ws[2], i)[:, :1536]
                return qmatmul_cpu.qmatmul(c * 1e-2, *ws[3], i) * 1e-2 + h
            return jax.lax.fori_loop(0, LAYERS, body, x)

        x = jax.random.normal(jax.random.PRNGKey(1), (m, 576))
        times = timed(lambda ws, x=x, f=layers: f(x, ws), copies)
        print(f"{mode} M={m}: min {min(times) * 1e3:6.3f} ms, median {np.median(times) * 1e3:6.3f} ms "
              f"per {LAYERS} layers, {nbytes / min(times) / 1e9:5.1f} GB/s", flush=True)


def attention(num_copies: int = 12) -> None:
    kv_heads, q_heads, head_dim = 3, 9, 64
    for batch, new, length, width in ((1, 1, 752, 1078), (1, 3, 752, 1078), (1, 1, 97, 246)):
        keys = jax.random.split(jax.random.PRNGKey(0), 5)
        q = jax.random.normal(keys[0], (batch, new, q_heads, head_dim))
        k_new = jax.random.normal(keys[1], (batch, new, kv_heads, head_dim))
        v_new = jax.random.normal(keys[2], (batch, new, kv_heads, head_dim))
        copies = [(jax.random.normal(jax.random.fold_in(keys[3], c), (LAYERS, batch, kv_heads, head_dim, width)),
                   jax.random.normal(jax.random.fold_in(keys[4], c), (LAYERS, batch, kv_heads, width, head_dim)))
                  for c in range(num_copies)]
        lengths = jnp.full((batch,), length, jnp.int32)
        mask = jnp.tril(jnp.ones((new, new), bool))[None].repeat(batch, 0)

        @jax.jit
        def layers(k, v, q=q, k_new=k_new, v_new=v_new, lengths=lengths, mask=mask):
            def body(i, acc):
                return acc + attention_cpu.cache_attention(q + acc * 0, k_new, v_new, k, v, i, lengths, mask)
            return jax.lax.fori_loop(0, LAYERS, body, jnp.zeros_like(q))

        times = [t / LAYERS for t in timed(lambda kv, f=layers: f(*kv), copies)]
        nbytes = batch * 2 * length * kv_heads * head_dim * 4
        print(f"attention B={batch} T={new} keys={length}: min {min(times) * 1e6:6.2f} us, median "
              f"{np.median(times) * 1e6:6.2f} us a call, {nbytes / min(times) / 1e9:5.1f} GB/s", flush=True)


def main() -> None:
    reason = quant.cpu_kernel_reason() or attention_cpu.available(cache_dir() / "kernels")
    if reason is not None:
        sys.exit(f"cpu_kernel_stream: the CPU kernels are not available: {reason}")
    if sys.argv[1:2] == ["matmul"]:
        matmul(sys.argv[2] if len(sys.argv) > 2 else "int8")
    elif sys.argv[1:2] == ["attention"]:
        attention()
    else:
        sys.exit("usage: cpu_kernel_stream.py matmul [int8|int4|int4-bytes] | attention")


if __name__ == "__main__":
    main()
