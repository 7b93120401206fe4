"""Is a token's forward the same, bit for bit, decoded alone and verified among draft tokens?

    python benchmarks/row_invariance.py [--model smollm2-135m] [--quantize int8] \
        [--batches 1 8] [--rows 2 5] [--prompt 20]

B rows of `--prompt` random tokens are prefilled, then ONE forward runs the next token alone
(T = 1, as a decode step) and with T - 1 more tokens after it (as a verify of a chain); for each
T in `--rows` it prints, for the first token, the first layer whose output hidden state differs
in any bit, the count of differing elements in each of the first six layers, and how many of
its logits differ (and by how much). Greedy speculation equals plain greedy decoding exactly
when those differences never move an argmax: f32 and weight-only quantization differ in the
last bits from layer 0 on (XLA's f32 products of 1 and of T rows sum in other orders) and the
argmax survives that; a mode that rounds activations (W8A8, docs/quantization.md) turns those
bits into whole quantization steps. Set XLA_FLAGS before running to try compiler options
(e.g. `--xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_DOT`).
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models.hub import load_model
from specjax.models.llama import forward, init_cache


def compare(cfg, params, batch: int, rows: tuple[int, ...], prompt: int, seed: int = 0) -> list[str]:
    """One line per T in `rows`: where T = 1 and T = `rows[i]` first differ for token 0."""
    rng = np.random.default_rng(seed)
    layers = tuple(range(cfg.num_layers))
    run = jax.jit(lambda p, t, pos, c: forward(cfg, p, t, pos, c, hidden_layers=layers))
    tokens = jnp.asarray(rng.integers(100, cfg.vocab_size - 100, (batch, prompt)), jnp.int32)
    cache = init_cache(cfg, batch, prompt + max(rows) + 1)
    out = run(params, tokens, jnp.broadcast_to(jnp.arange(prompt), (batch, prompt)), cache)
    cache = out.cache.replace(lengths=jnp.full((batch,), prompt, jnp.int32))
    nxt = jnp.asarray(rng.integers(100, cfg.vocab_size - 100, (batch, max(rows))), jnp.int32)

    def first_token(width):
        o = run(params, nxt[:, :width], prompt + jnp.broadcast_to(jnp.arange(width), (batch, width)),
                cache)
        return [np.asarray(h[:, 0]) for h in o.layer_hidden], np.asarray(o.logits[:, 0])

    alone, alone_logits = first_token(1)
    lines = []
    for width in rows:
        hidden, logits = first_token(width)
        diffs = [int((a != b).sum()) for a, b in zip(alone, hidden)]
        first = next((i for i, d in enumerate(diffs) if d), None)
        lines.append(
            f"B={batch} T=1 vs T={width}: first differing layer {first}; differing elements in "
            f"layers 0-5 {diffs[:6]} of {alone[0].size}; logits differing "
            f"{int((alone_logits != logits).sum())} of {logits.size}, max "
            f"{float(np.abs(alone_logits - logits).max()):.3g}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--quantize", default=None)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rows", type=int, nargs="+", default=[2, 5])
    ap.add_argument("--prompt", type=int, default=20)
    args = ap.parse_args()
    model = load_model(args.model, quantize=args.quantize)
    print(f"{args.model} quantize={args.quantize} backend={jax.default_backend()} jax {jax.__version__}")
    for batch in args.batches:
        for line in compare(model.cfg, model.params, batch, tuple(args.rows), args.prompt):
            print(line)


if __name__ == "__main__":
    main()
