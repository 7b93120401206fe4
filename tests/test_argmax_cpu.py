"""The CPU argmax kernel (`kernels/argmax_cpu`) against `jnp.argmax`.

- random rows of any length (not a multiple of the kernel's 8 lanes too) and leading shape:
  the same indices; ties give the first; a row with a NaN gives its first NaN; rows of -inf,
  +inf, and of zeros of both signs as jnp does;
- it composes: jit, vmap (more rows of one call), grad through it (an index: no gradient);
- `sampling.greedy_tokens`, what greedy decoding calls, runs the kernel on one CPU device.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specjax.kernels import argmax_cpu
from specjax.models.paths import cache_dir
from specjax.sampling import greedy_tokens

REASON = argmax_cpu.available(cache_dir() / "kernels")
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"CPU kernel unavailable: {REASON}")


def kernel(x):
    return jax.jit(argmax_cpu.argmax)(x)


@settings(max_examples=40, deadline=None)
@given(lead=st.lists(st.integers(1, 4), min_size=0, max_size=2), v=st.integers(1, 300),
       levels=st.integers(2, 1000), seed=st.integers(0, 2**16))
def test_kernel_equals_jnp_argmax(lead, v, levels, seed):
    """Values drawn from `levels` steps, so rows hold ties at their maximum."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.integers(0, levels, (*lead, v)) / levels - 0.5, jnp.float32)
    np.testing.assert_array_equal(kernel(x), jnp.argmax(x, axis=-1))


def test_non_finite_rows_as_jnp():
    """NaN anywhere (first, last, twice), +inf, -inf throughout, signed zeros, a long row."""
    v = 49152
    rows = np.random.default_rng(0).normal(size=(10, v)).astype(np.float32)
    rows[0, 5] = rows[0, 700] = np.nan
    rows[1, -1] = np.nan
    rows[2, 3] = np.inf
    rows[2, 9000] = np.inf
    rows[3, :] = -np.inf
    rows[4, :] = 0.0
    rows[4, 10] = -0.0
    rows[5, :] = -0.0
    rows[5, 20] = 0.0
    rows[6, v - 3] = 1e30
    rows[7, :] = np.nan
    x = jnp.asarray(rows)
    np.testing.assert_array_equal(kernel(x), jnp.argmax(x, axis=-1))


def test_it_composes_with_vmap_and_grad():
    x = jax.random.normal(jax.random.PRNGKey(0), (3, 4, 5, 67))
    np.testing.assert_array_equal(jax.vmap(argmax_cpu.argmax)(x), jnp.argmax(x, axis=-1))
    np.testing.assert_array_equal(jax.vmap(jax.vmap(argmax_cpu.argmax), in_axes=1, out_axes=1)(x),
                                  jnp.argmax(x, axis=-1))

    def loss(a):
        picked = argmax_cpu.argmax(a)
        return jnp.sum(jnp.take_along_axis(a, picked[..., None], axis=-1))

    want = jax.grad(lambda a: jnp.sum(jnp.take_along_axis(a, jnp.argmax(a, -1)[..., None], -1)))(x)
    np.testing.assert_array_equal(jax.grad(loss)(x), want)
    with pytest.raises(ValueError, match="non-empty last axis"):
        argmax_cpu.argmax(jnp.zeros((2, 0)))


def test_greedy_decoding_runs_the_kernel():
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 3, 100))
    assert "specjax_argmax_rows" in jax.jit(greedy_tokens).lower(x).as_text()
    np.testing.assert_array_equal(jax.jit(greedy_tokens)(x), jnp.argmax(x, axis=-1))
