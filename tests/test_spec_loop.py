"""The speculative program: no host round-trips, no recompiles inside a bucket, and the step
functions composing under a user's own jit / vmap."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tiny_config

from specjax.accept import accept_greedy
from specjax.api import _pad_batch, generate_ids
from specjax.drafters.ngram import NgramDrafter
from specjax.loop import (
    StopCriteria,
    init_state,
    prefill,
    spec_finish_program,
    spec_generate_program,
    spec_start_program,
    spec_step,
)
from specjax.metrics import SpecMetrics
from specjax.models.cache import init_cache
from specjax.models.llama import init_params
from specjax.refill import refill_program
from specjax.sampling import SamplingParams
from specjax.tree import chain, k_ary
from specjax.types import Draft

PROMPTS = [[3, 4, 5, 6, 3, 4, 5, 6, 3], [7, 8, 9, 7, 8]]


@pytest.fixture(scope="module")
def model():
    cfg = tiny_config(vocab_size=16)
    return cfg, init_params(cfg, jax.random.PRNGKey(0))


def _program_args(cfg, prompts, max_new, width, batch=2):
    tokens, lengths = _pad_batch(prompts, batch, 16)
    args = (tokens, lengths, np.full((batch,), max_new, np.int32))
    args = jax.device_put(args)
    return args + (init_cache(cfg, batch, width), jax.device_put(jax.random.PRNGKey(0)),
                   SamplingParams.make(0.0), StopCriteria.make([], []))


def test_spec_program_runs_without_host_transfers(model):
    cfg, params = model
    drafter = NgramDrafter(tree=chain(3))
    width = 16 + 16 + 4
    spec_generate_program(cfg, params, drafter, None, *_program_args(cfg, PROMPTS, 12, width), width=width)
    args = _program_args(cfg, PROMPTS, 12, width)
    with jax.transfer_guard("disallow"):
        state, metrics, _ = spec_generate_program(cfg, params, drafter, None, *args, width=width)
        jax.block_until_ready(state.tokens)
    assert np.all(np.asarray(state.num_tokens) - np.asarray(state.prompt_lens) == 12)


@pytest.mark.parametrize("refill", [True, False], ids=["refill", "static"])
def test_spec_program_compiles_once_per_bucket(model, refill):
    cfg, params = model
    drafter = NgramDrafter(tree=k_ary((2, 1)))
    run = lambda prompts, n: generate_ids(cfg, params, prompts, max_new_tokens=n, eos_ids=[],
                                          draft=drafter, batch_size=2, refill=refill)
    programs = (refill_program,) if refill else (spec_start_program, spec_finish_program)
    sizes = lambda: [program._cache_size() for program in programs]
    run(PROMPTS, 9)
    size = sizes()
    run([[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]], 14)
    assert sizes() == size


def test_step_functions_compose_under_user_jit(model):
    cfg, params = model
    drafter = NgramDrafter(tree=chain(3))
    sampling, criteria = SamplingParams.make(0.0), StopCriteria.make([], [])
    width = 16 + 16 + 4
    tokens, lengths = _pad_batch(PROMPTS, 2, 16)
    state = init_state(jnp.asarray(tokens), jnp.asarray(lengths), jnp.full((2,), 10), init_cache(cfg, 2, width),
                       jax.random.PRNGKey(0), width)
    state, _ = jax.jit(lambda s: prefill(cfg, params, s, 16, sampling, criteria))(state)
    step = jax.jit(lambda s, m: spec_step(cfg, params, drafter, None, s, (), m, sampling, criteria))
    metrics = SpecMetrics.zeros(2, 3)
    while not bool(jnp.all(state.done)):
        state, _, metrics = step(state, metrics)
    want = generate_ids(cfg, params, PROMPTS, max_new_tokens=10, eos_ids=[])
    for i, w in enumerate(want):
        assert np.asarray(state.tokens[i, lengths[i] : state.num_tokens[i]]).tolist() == w.token_ids


def test_accept_vmaps_over_a_leading_axis():
    tree = k_ary((2, 2))
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(3, 2, tree.num_nodes + 1, 5)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, 5, size=(3, 2, tree.num_nodes)), jnp.int32)
    valid = jnp.ones_like(tokens, bool)
    batched = jax.vmap(lambda lg, tk, vd: accept_greedy(lg, Draft(tk, vd), tree))(logits, tokens, valid)
    for i in range(3):
        single = accept_greedy(logits[i], Draft(tokens[i], valid[i]), tree)
        np.testing.assert_array_equal(batched.num_accepted[i], single.num_accepted)
        np.testing.assert_array_equal(batched.next_token[i], single.next_token)
