"""End-to-end losslessness: the whole speculative program with a tiny random target and a
different tiny random draft model samples exactly like plain AR sampling.

Vocabulary 8, temperature 0.8, top-k 6, top-p 0.9; the joint distribution of the first three
generated tokens over 20,480 samples is compared with the exact AR joint (enumerated with the
target's forward) by a chi-square test (cells with expected count < 5 pooled). Threshold: a
lossless setup must give p > 1e-3; the deliberately broken rule (the drafter samples from its
q but tells acceptance q is uniform) must give p < 1e-6, so the test can fail. (Claiming a
one-hot q for a sampled chain token would NOT be broken: "accept x with p(x), else sample p
without x" is lossless whatever proposed x; it only accepts less.) The generate calls run
through the refilling loop (`specjax.refill`, the API's default); one test refills each slot
many times.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import chi_square, tiny_config

from specjax.accept import accept_sampling
from specjax.api import generate_ids
from specjax.drafters.draft_model import DraftModelDrafter
from specjax.models.cache import init_cache
from specjax.models.llama import forward, init_params
from specjax.sampling import SamplingParams, probabilities
from specjax.tree import chain, k_ary

VOCAB = 8
PROMPT = [3, 1, 4]
TEMPERATURE, TOP_K, TOP_P = 0.8, 6, 0.9
ROWS, SEEDS = 4096, 5
P_PASS, P_FAIL = 1e-3, 1e-6

pytestmark = pytest.mark.slow


@dataclasses.dataclass(frozen=True)
class UniformClaimDrafter(DraftModelDrafter):
    """Broken on purpose: samples from its q but tells acceptance q is uniform."""

    def accept(self, params, key, target_logits, draft, sampling):
        uniform = jnp.full_like(draft.probs, 1.0 / draft.probs.shape[-1])
        return accept_sampling(key, target_logits, draft.replace(probs=uniform), self.tree, sampling)


@functools.cache
def models():
    target_cfg = tiny_config(vocab_size=VOCAB, num_layers=1, eos_token_ids=())
    draft_cfg = tiny_config(vocab_size=VOCAB, num_layers=1, hidden_size=16, intermediate_size=32,
                            eos_token_ids=(), name="tiny-draft")
    # Sharper logits than the 0.02 init: far from uniform, yet ~80 sequences stay likely.
    scale = lambda p: jax.tree.map(lambda x: x * 3.0, p)
    return (target_cfg, scale(init_params(target_cfg, jax.random.PRNGKey(1))),
            draft_cfg, scale(init_params(draft_cfg, jax.random.PRNGKey(2))))


def exact_ar_joint(cfg, params, sampling) -> np.ndarray:
    """`[V, V, V]` exact probability of each first-three-token sequence under plain sampling."""

    def next_probs(prefixes):  # [n, L] -> [n, V]
        n, length = prefixes.shape
        out = forward(cfg, params, jnp.asarray(prefixes, jnp.int32),
                      jnp.broadcast_to(jnp.arange(length), (n, length)), init_cache(cfg, n, length))
        return np.asarray(probabilities(out.logits[:, -1], sampling), np.float64)

    grid = np.array(np.meshgrid(*[np.arange(VOCAB)] * 2, indexing="ij")).reshape(2, -1).T
    p1 = next_probs(np.array([PROMPT]))[0]
    p2 = next_probs(np.array([PROMPT + [a] for a in range(VOCAB)]))
    p3 = next_probs(np.array([PROMPT + list(ab) for ab in grid])).reshape(VOCAB, VOCAB, VOCAB)
    return p1[:, None, None] * p2[:, :, None] * p3


def sampled_triples(drafter_cls, tree, batch_size: int = ROWS) -> np.ndarray:
    target_cfg, target_params, draft_cfg, draft_params = models()
    drafter = drafter_cls(tree=tree, cfg=draft_cfg)
    samples = []
    for seed in range(SEEDS):
        results = generate_ids(
            target_cfg, target_params, [PROMPT] * ROWS, max_new_tokens=3, temperature=TEMPERATURE,
            top_k=TOP_K, top_p=TOP_P, seed=seed, eos_ids=[], batch_size=batch_size,
            draft=drafter, drafter_params=draft_params,
        )
        samples += [r.token_ids for r in results]
    return np.asarray(samples)


@functools.cache
def joint():
    target_cfg, target_params, _, _ = models()
    return exact_ar_joint(target_cfg, target_params, SamplingParams.make(TEMPERATURE, TOP_K, TOP_P))


@pytest.mark.parametrize("tree", [chain(2), k_ary((2, 2))], ids=["chain", "tree"])
def test_speculative_sampling_matches_ar(tree):
    stat, dof, p = chi_square(sampled_triples(DraftModelDrafter, tree), joint())
    assert p > P_PASS, f"chi2={stat:.1f} dof={dof} p={p:.3g}"


def test_speculative_sampling_matches_ar_through_refilled_slots():
    """The same test with ROWS / 8 slots refilled as rows end (`specjax.refill`): 7 of 8
    prompts start in a slot another row has left."""
    stat, dof, p = chi_square(sampled_triples(DraftModelDrafter, chain(2), ROWS // 8), joint())
    assert p > P_PASS, f"chi2={stat:.1f} dof={dof} p={p:.3g}"


def test_broken_rule_fails_the_same_test():
    stat, dof, p = chi_square(sampled_triples(UniformClaimDrafter, chain(2)), joint())
    assert p < P_FAIL, f"the broken rule passed: chi2={stat:.1f} dof={dof} p={p:.3g}"
