"""SmolLM2 (Q4_1 GGUF) in specjax vs Hugging Face transformers on the same file, in f32.

(a) Against the stored fixture (tests/fixtures/smollm2_hf_reference.npz, written by
    benchmarks/make_hf_reference.py), no torch needed: logits on transformers' top-16 at every
    position, argmax at every position, a 64-token greedy continuation with the KV cache.
(b) Live, when torch + transformers are importable: full-vocabulary logits.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.models.cache import init_cache
from specjax.models.llama import forward

pytestmark = pytest.mark.real

FIXTURE = Path(__file__).parent / "fixtures" / "smollm2_hf_reference.npz"
LOGIT_ATOL = 1e-3


@pytest.fixture(scope="module")
def reference() -> dict:
    with np.load(FIXTURE) as data:
        return {k: data[k] for k in data.files}


def _prompts(ref) -> list[list[int]]:
    return [row[:n].tolist() for row, n in zip(ref["prompt_ids"], ref["prompt_lens"])]


def _padded(seqs: list[list[int]]) -> np.ndarray:
    """Right-padded `[B, T]` int32 (pad 0: padded positions are never read back)."""
    out = np.zeros((len(seqs), max(map(len, seqs))), np.int32)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = s
    return out


@functools.partial(jax.jit, static_argnums=0)
def _forward(cfg, params, tokens, positions, cache, logit_indices=None):
    """Logits `[B, K, V]` and the cache after writing tokens `[B, T]` at `positions`.

    The cache comes in as an argument: an all-zero cache built inside jit is a constant that
    XLA tries (slowly) to fold through the attention.
    """
    out = forward(cfg, params, tokens, positions, cache, logit_indices=logit_indices)
    return out.logits, out.cache


def full_logits(model, seqs: list[list[int]]) -> np.ndarray:
    """`[B, T, V]` logits of one forward over right-padded sequences."""
    tokens = _padded(seqs)
    positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
    cache = init_cache(model.cfg, tokens.shape[0], tokens.shape[1])
    logits, _ = _forward(model.cfg, model.params, tokens, positions, cache)
    return np.asarray(logits)


def greedy(model, prompts: list[list[int]], steps: int) -> np.ndarray:
    """`[B, steps]` argmax continuation: batched prefill, then one cached decode step at a time."""
    lengths = np.array([len(p) for p in prompts], np.int32)
    tokens = _padded(prompts)
    cache = init_cache(model.cfg, len(prompts), tokens.shape[1] + steps)
    positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
    last = jnp.asarray(lengths - 1)[:, None]
    logits, cache = _forward(model.cfg, model.params, tokens, positions, cache, last)
    cache = cache.advance(jnp.asarray(lengths))
    out = []
    for _ in range(steps):
        token = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)  # [B]
        out.append(np.asarray(token))
        logits, cache = _forward(
            model.cfg, model.params, token[:, None], cache.lengths[:, None], cache
        )
        cache = cache.advance(jnp.ones_like(cache.lengths))
    return np.stack(out, axis=1)


def test_prompt_tokens_match_transformers(smollm2, reference):
    tok = smollm2.tokenizer
    for messages, expected in zip(json.loads(str(reference["messages"])), _prompts(reference)):
        assert tok.encode(tok.apply_chat_template(messages)) == expected


def test_logits_match_reference_topk(smollm2, reference):
    seqs = [p + c.tolist() for p, c in zip(_prompts(reference), reference["continuations"])]
    logits = full_logits(smollm2, seqs)
    worst_abs, worst_rel = 0.0, 0.0
    for i, seq in enumerate(seqs):
        ids = reference["topk_ids"][i, : len(seq)]
        want = reference["topk_values"][i, : len(seq)]
        got = np.take_along_axis(logits[i, : len(seq)], ids, axis=-1)
        err = np.abs(got - want)
        worst_abs = max(worst_abs, float(err.max()))
        worst_rel = max(worst_rel, float((err / np.maximum(np.abs(want), 1.0)).max()))
        np.testing.assert_array_equal(logits[i, : len(seq)].argmax(-1), ids[:, 0])
    print(
        f"\nSmolLM2 f32 vs transformers (top-16, all positions): "
        f"max-abs {worst_abs:.2e}, max-rel {worst_rel:.2e}"
    )
    assert worst_abs <= LOGIT_ATOL


def test_greedy_matches_reference(smollm2, reference):
    want = reference["continuations"]
    got = greedy(smollm2, _prompts(reference), want.shape[1])
    np.testing.assert_array_equal(got, want)


def test_live_full_vocab_logits(smollm2, reference):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    source = Path(smollm2.source)
    hf = AutoModelForCausalLM.from_pretrained(
        str(source.parent), gguf_file=source.name, dtype=torch.float32
    )
    prompts = _prompts(reference)
    ours = full_logits(smollm2, prompts)
    worst = 0.0
    with torch.no_grad():
        for i, p in enumerate(prompts):
            theirs = hf(input_ids=torch.tensor([p])).logits[0].float().numpy()
            worst = max(worst, float(np.abs(ours[i, : len(p)] - theirs).max()))
    print(f"\nSmolLM2 f32 vs live transformers (full vocab, prompt positions): max-abs {worst:.2e}")
    assert worst <= LOGIT_ATOL
