"""The replay behind benchmarks/ngram_ceiling.py: hand-computed cases, the real drafter's
ranking, and the real engine's step counts on a tiny model."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import load_benchmark

from specjax.api import generate_ids
from specjax.drafters.ngram import NgramDrafter, match_scores
from specjax.tree import chain


@pytest.fixture(scope="module")
def ceiling():
    return load_benchmark("ngram_ceiling")


def test_oracle_takes_the_best_continuation_of_any_occurrence(ceiling):
    context = np.array([5, 1, 2, 3, 5, 1, 2, 9, 5])
    # continuations after each earlier 5: [1, 2, 3, 5, ...] and [1, 2, 9, 5]
    assert ceiling.oracle_acceptance(context, np.array([1, 2, 9, 4])) == 3
    assert ceiling.oracle_acceptance(context, np.array([1, 2, 3, 5, 1, 6])) == 5  # up to the row end
    assert ceiling.oracle_acceptance(context, np.array([7])) == 0
    assert ceiling.oracle_acceptance(np.array([4, 5, 6]), np.array([1])) == 0  # no earlier 6


def test_replay_counts_steps_after_the_prefill_token(ceiling):
    prompt, output = [7, 1, 2, 3, 7], [1, 2, 3, 4, 8]
    # prefill emits 1; step 1 drafts [2, 3, 7] after the matched [7, 1]: accepts 2 + the target's 4;
    # step 2 finds nothing after 4 and emits 8.
    fn = lambda c, f: ceiling.tree_acceptance(c, f, 4, 1)
    assert ceiling.replay(prompt, output, fn) == (2, 2)


def test_match_ranking_agrees_with_the_drafter(ceiling):
    rng = np.random.default_rng(0)
    for _ in range(20):
        row = rng.integers(0, 4, size=40)
        num = int(rng.integers(5, 40))
        score = np.asarray(match_scores(jnp.asarray(row[None]), jnp.asarray([num]), 1, 3))[0]
        starts = ceiling.match_starts(row[:num], 1, 3)
        if score.max() < 0:
            assert starts == []
        else:
            assert starts[0] == int(np.argmax(score))


def test_chain_replay_reproduces_the_engine(ceiling, tiny_model):
    """Same steps as the real loop with the real ngram drafter; every emitted token accounted."""
    cfg, params = tiny_model
    prompts = [[3, 4, 5, 6, 3, 4, 5, 7, 3, 4], [9, 8, 9, 8, 9, 8, 2]]
    drafter = NgramDrafter(tree=chain(4))
    for prompt in prompts:
        (res,) = generate_ids(cfg, params, [prompt], max_new_tokens=40, eos_ids=[], draft=drafter)
        output = list(map(int, res.token_ids))
        steps, accepted = ceiling.replay(prompt, output, lambda c, f: ceiling.tree_acceptance(c, f, 4, 1))
        assert steps == res.spec["steps"] and steps + accepted + 1 == len(output)
        # the engine (like vLLM) also counts drafts accepted past max_new_tokens in the last step
        assert 0 <= res.spec["accepted"] - accepted < 4
