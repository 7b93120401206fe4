"""The one-program generate loop: equivalence with a naive loop, stopping rules, buckets."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from specjax.api import PromptError, generate_ids
from specjax.loop import ar_finish_program, ar_start_program
from specjax.models.cache import init_cache
from specjax.models.llama import forward
from specjax.refill import refill_program


def naive_greedy(cfg, params, prompt, steps):
    """Full recompute every step, no cache reuse: the simplest possible reference."""
    width = 64

    @jax.jit
    def next_token(tokens, length):  # tokens [1, width] right-padded; the last real one at length-1
        out = forward(cfg, params, tokens, jnp.arange(width)[None], init_cache(cfg, 1, width))
        return jnp.argmax(out.logits[0, length - 1])

    seq = list(prompt)
    for _ in range(steps):
        padded = jnp.asarray([seq + [0] * (width - len(seq))], jnp.int32)
        seq.append(int(next_token(padded, len(seq))))
    return seq[len(prompt):]


def test_greedy_matches_naive_loop_ragged_batch(tiny_model):
    cfg, params = tiny_model
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15], [20]]
    results = generate_ids(cfg, params, prompts, max_new_tokens=12, eos_ids=[])
    for prompt, res in zip(prompts, results):
        assert res.token_ids == naive_greedy(cfg, params, prompt, 12)
        assert res.stop_reason == "length"


def test_eos_and_stop_sequences_end_rows_exactly(tiny_model):
    cfg, params = tiny_model
    prompts = [[5, 6, 7], [9, 10, 11, 12]]
    free = generate_ids(cfg, params, prompts, max_new_tokens=10, eos_ids=[])
    row0, row1 = free[0].token_ids, free[1].token_ids
    eos = generate_ids(cfg, params, prompts, max_new_tokens=10, eos_ids=[row0[3]])
    assert eos[0].token_ids == row0[: row0.index(row0[3]) + 1]
    assert eos[0].stop_reason == "eos"
    stop = generate_ids(cfg, params, prompts, max_new_tokens=10, eos_ids=[], stop_token_seqs=[row1[4:6]])
    first = next(i for i in range(len(row1) - 1) if row1[i : i + 2] == row1[4:6])
    assert stop[1].token_ids == row1[: first + 2] and stop[1].stop_reason == "stop"
    # a stop sequence straddling the prompt/completion boundary does not count
    straddle = generate_ids(cfg, params, [prompts[0]], max_new_tokens=3, eos_ids=[], stop_token_seqs=[[7, row0[0]]])
    assert straddle[0].token_ids == row0[:3]


def test_sampling_is_seeded_and_varies(tiny_model):
    cfg, params = tiny_model
    a = generate_ids(cfg, params, [[3, 4]], max_new_tokens=8, temperature=1.0, seed=1, eos_ids=[])
    b = generate_ids(cfg, params, [[3, 4]], max_new_tokens=8, temperature=1.0, seed=1, eos_ids=[])
    c = generate_ids(cfg, params, [[3, 4]], max_new_tokens=8, temperature=1.0, seed=2, eos_ids=[])
    assert a[0].token_ids == b[0].token_ids != c[0].token_ids


@pytest.mark.parametrize("refill", [True, False], ids=["refill", "static"])
def test_same_bucket_does_not_recompile(tiny_model, refill):
    cfg, params = tiny_model
    programs = (refill_program,) if refill else (ar_start_program, ar_finish_program)
    sizes = lambda: [program._cache_size() for program in programs]
    generate_ids(cfg, params, [[1, 2, 3], [4]], max_new_tokens=5, batch_size=2, eos_ids=[], refill=refill)
    compiled = sizes()
    generate_ids(cfg, params, [[4, 5, 6, 7, 8], [9]], max_new_tokens=7, batch_size=2, eos_ids=[], refill=refill)
    assert sizes() == compiled
    # greedy or not is static (a greedy program holds no sampling code): one sampling program,
    # shared by every temperature / top-k / top-p
    generate_ids(cfg, params, [[4, 5, 6, 7, 8], [9]], max_new_tokens=7, batch_size=2, eos_ids=[],
                 temperature=0.7, top_k=5, refill=refill)
    compiled = [n + 1 for n in compiled]
    assert sizes() == compiled
    generate_ids(cfg, params, [[4, 5], [9]], max_new_tokens=7, batch_size=2, eos_ids=[],
                 temperature=1.3, top_p=0.9, refill=refill)
    assert sizes() == compiled
    generate_ids(cfg, params, [list(range(2, 40)), [5]], max_new_tokens=5, batch_size=2, eos_ids=[], refill=refill)
    assert sizes() == [n + 1 for n in compiled]


def test_batches_larger_than_batch_size(tiny_model):
    cfg, params = tiny_model
    prompts = [[i + 2, i + 3] for i in range(5)]
    together = generate_ids(cfg, params, prompts, max_new_tokens=4, eos_ids=[])
    split = generate_ids(cfg, params, prompts, max_new_tokens=4, eos_ids=[], batch_size=2)
    assert [r.token_ids for r in together] == [r.token_ids for r in split]


@pytest.mark.parametrize("prompts,match", [
    ([[]], "empty"), ([[1, 999]], "outside the vocabulary"), ([[1] * 60], "max_len"),
])
def test_bad_prompts_name_the_row(tiny_model, prompts, match):
    cfg, params = tiny_model
    with pytest.raises(PromptError, match=match):
        generate_ids(cfg, params, prompts, max_new_tokens=8, max_len=64)
