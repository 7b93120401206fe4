"""Logit processing vs a plain numpy reference, and sampling frequencies."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.sampling import SamplingParams, probabilities, sample


def reference_probs(logits, temperature, top_k, top_p):
    """Straightforward numpy: temperature, keep top-k, keep the smallest nucleus >= top_p."""
    x = logits.astype(np.float64) / temperature
    order = np.argsort(-x, kind="stable")
    keep = np.zeros_like(x, bool)
    k = top_k if top_k else len(x)
    kept = order[:k]
    p = np.exp(x[kept] - x[kept].max())
    p /= p.sum()
    cum = 0.0
    for idx, pi in zip(kept, p):
        keep[idx] = True
        cum += pi
        if cum >= top_p:
            break
    out = np.where(keep, np.exp(x - x.max()), 0.0)
    return out / out.sum()


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, None, None), (0.7, 5, None), (1.3, None, 0.8), (0.8, 10, 0.9), (0.5, 1, None), (1.0, 0, 0.05),
])
def test_probabilities_match_reference(temperature, top_k, top_p):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 40)).astype(np.float32) * 2
    params = SamplingParams.make(temperature, top_k, top_p)
    got = np.asarray(probabilities(jnp.asarray(logits), params))
    for row in range(logits.shape[0]):
        want = reference_probs(logits[row], temperature, top_k, 1.0 if top_p is None else top_p)
        np.testing.assert_allclose(got[row], want, atol=1e-5)


def test_greedy_is_argmax_and_one_hot():
    logits = jnp.array([[0.1, 3.0, -1.0], [5.0, 4.9, 0.0]])
    params = SamplingParams.make(0.0)
    np.testing.assert_array_equal(sample(jax.random.PRNGKey(0), logits, params), [1, 0])
    np.testing.assert_array_equal(probabilities(logits, params), [[0, 1, 0], [1, 0, 0]])


def test_sample_frequencies_follow_probabilities():
    logits = jnp.log(jnp.array([0.5, 0.3, 0.15, 0.05]))
    params = SamplingParams.make(1.0, top_k=3)
    draws = jax.vmap(lambda k: sample(k, logits, params))(jax.random.split(jax.random.PRNGKey(1), 20000))
    freq = np.bincount(np.asarray(draws), minlength=4) / 20000
    np.testing.assert_allclose(freq, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0], atol=0.015)


@pytest.mark.parametrize("bad", [dict(temperature=-1.0), dict(top_k=-2), dict(top_p=0.0), dict(top_p=1.5)])
def test_bad_sampling_params_raise(bad):
    with pytest.raises(ValueError):
        SamplingParams.make(**{"temperature": 1.0, **bad})
