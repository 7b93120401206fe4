"""The CPU attention kernel (`kernels/attention_cpu`) against its jnp reference.

- random shapes: rows, new tokens (a chain or a random tree, dead queries: zeros), GQA
  groups, head sizes with and without a vector path, capacities not a multiple of 16, lengths
  0..S, every layer of the stack: equal to `verify_attention_reference` on the layer's slice;
- a row's result does not depend on the other rows (bit for bit);
- non-finite input as the reference: NaN in a query, a bad new key or value reach exactly the
  queries that see them;
- it composes: jit, vmap, grad (the reference's backward);
- bad input is an error, never a wrong answer;
- the model: `attention_impl` picks it on one CPU device for f32 and keeps XLA's path for bf16
  and when switched off; the forward through it equals the XLA path's.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tiny_config
from hypothesis import given, settings
from hypothesis import strategies as st

from specjax.kernels import attention_cpu, cpu_ffi
from specjax.kernels.reference import verify_attention_reference
from specjax.models import llama
from specjax.models.cache import init_cache
from specjax.models.paths import cache_dir

REASON = attention_cpu.available(cache_dir() / "kernels")
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"CPU kernel unavailable: {REASON}")


def inputs(seed, layers, batch, new, heads, kv_heads, head_dim, capacity, lengths=None, tree=False):
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return jnp.asarray(rng.normal(size=shape), jnp.float32)

    if lengths is None:
        lengths = rng.integers(0, capacity + 1, batch)
    if tree:  # a random mask; some queries dead (no diagonal), some see nothing else
        mask = rng.random((batch, new, new)) < 0.5
    else:
        mask = np.broadcast_to(np.tril(np.ones((new, new), bool)), (batch, new, new))
    return (normal(batch, new, heads, head_dim), normal(batch, new, kv_heads, head_dim),
            normal(batch, new, kv_heads, head_dim), normal(layers, batch, kv_heads, head_dim, capacity),
            normal(layers, batch, kv_heads, capacity, head_dim), jnp.asarray(lengths, jnp.int32),
            jnp.asarray(mask))


def run(q, k_new, v_new, k, v, layer, lengths, mask):
    return jax.jit(attention_cpu.cache_attention)(q, k_new, v_new, k, v, layer, lengths, mask)


def reference(q, k_new, v_new, k, v, layer, lengths, mask):
    """The jnp reference, a dead token's rows (one the mask does not let see itself) zeros."""
    out = verify_attention_reference(q, k_new, v_new, k[layer], v[layer], lengths, mask)
    return jnp.where(jnp.diagonal(mask, axis1=1, axis2=2)[:, :, None, None], out, 0.0)


@settings(max_examples=30, deadline=None)
@given(layers=st.integers(1, 2), batch=st.integers(1, 3), new=st.integers(1, 6),
       kv_heads=st.integers(1, 3), group=st.integers(1, 3), head_dim=st.sampled_from([8, 12, 32, 64]),
       capacity=st.integers(1, 300), tree=st.booleans(), seed=st.integers(0, 2**16))
def test_kernel_equals_reference(layers, batch, new, kv_heads, group, head_dim, capacity, tree, seed):
    args = inputs(seed, layers, batch, new, kv_heads * group, kv_heads, head_dim, capacity, tree=tree)
    for layer in range(layers):
        got, want = run(*args[:5], layer, *args[5:]), reference(*args[:5], layer, *args[5:])
        assert got.shape == want.shape and got.dtype == jnp.float32
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


def test_long_prefixes_and_edges_of_the_chunks():
    """Lengths at and around the kernel's chunk (128 keys) and its 16-key blocks, up to S."""
    lengths = [0, 1, 15, 16, 17, 127, 128, 129, 255, 256, 257, 600]
    args = inputs(3, 1, len(lengths), 3, 9, 3, 64, 600, lengths=lengths)
    np.testing.assert_allclose(run(*args[:5], 0, *args[5:]), reference(*args[:5], 0, *args[5:]),
                               rtol=2e-5, atol=2e-6)


def test_a_rows_result_does_not_depend_on_the_other_rows():
    q, k_new, v_new, k, v, lengths, mask = inputs(5, 2, 4, 5, 6, 2, 64, 400, lengths=[390, 0, 77, 256])
    together = run(q, k_new, v_new, k, v, 1, lengths, mask)
    for row in range(4):
        one = slice(row, row + 1)
        alone = run(q[one], k_new[one], v_new[one], k[:, one], v[:, one], 1, lengths[one], mask[one])
        np.testing.assert_array_equal(alone, together[one])
    other = lengths.at[0].set(12)  # another row's length changes nothing of row 2
    np.testing.assert_array_equal(run(q, k_new, v_new, k, v, 1, other, mask)[2], together[2])


def test_non_finite_input_reaches_exactly_the_queries_that_see_it():
    q, k_new, v_new, k, v, lengths, mask = inputs(9, 1, 2, 4, 4, 2, 32, 50, lengths=[20, 0])
    q = q.at[0, 1, 3].set(jnp.nan)  # row 0, token 1, query head 3 (KV head 1)
    k_new = k_new.at[1, 2, 0].set(jnp.inf)  # row 1's token 2, KV head 0
    v_new = v_new.at[0, 3, 1].set(jnp.nan)  # row 0's token 3, KV head 1
    got, want = run(q, k_new, v_new, k, v, 0, lengths, mask), reference(q, k_new, v_new, k, v, 0, lengths, mask)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert np.isnan(got[0, 1, 3]).all() and np.isnan(got[1, 2:, :2]).all() and np.isnan(got[0, 3, 2:]).all()
    assert np.isfinite(got[1, :2]).all() and np.isfinite(got[0, :3, :2]).all()
    finite = np.isfinite(want)
    np.testing.assert_allclose(np.asarray(got)[finite], np.asarray(want)[finite], rtol=2e-5, atol=2e-6)


def test_vmap_and_grad_compose():
    args = inputs(11, 2, 2, 3, 4, 2, 32, 40)
    q, k_new, v_new, k, v, lengths, mask = args
    stacked = jnp.stack([q, q * 0.5])
    got = jax.vmap(lambda x: attention_cpu.cache_attention(x, k_new, v_new, k, v, 1, lengths, mask))(stacked)
    want = jax.vmap(lambda x: reference(x, k_new, v_new, k, v, 1, lengths, mask))(stacked)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    by_layer = jax.vmap(lambda i: attention_cpu.cache_attention(q, k_new, v_new, k, v, i, lengths, mask))(jnp.arange(2))
    np.testing.assert_allclose(by_layer[1], reference(q, k_new, v_new, k, v, 1, lengths, mask), rtol=2e-5, atol=2e-6)

    def loss(fn, x, kn):
        return jnp.sum(fn(x, kn, v_new, k, v, 0, lengths, mask) ** 2)

    got = jax.grad(lambda x, kn: loss(attention_cpu.cache_attention, x, kn), (0, 1))(q, k_new)
    want = jax.grad(lambda x, kn: loss(reference, x, kn), (0, 1))(q, k_new)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_bad_input_is_an_error():
    q, k_new, v_new, k, v, lengths, mask = inputs(13, 2, 1, 2, 4, 2, 32, 16)
    with pytest.raises(Exception, match="layer index out of range"):
        run(q, k_new, v_new, k, v, 2, lengths, mask).block_until_ready()
    with pytest.raises(ValueError, match="do not fit"):
        attention_cpu.cache_attention(q, k_new, v_new, k[:, :, :1], v, 0, lengths, mask)
    with pytest.raises(ValueError, match="f32 cache"):
        attention_cpu.cache_attention(q, k_new, v_new, k.astype(jnp.bfloat16), v, 0, lengths, mask)


def test_the_model_picks_it_where_it_runs(monkeypatch):
    cfg = tiny_config()
    assert llama.attention_impl(cfg) == "cpu"
    assert llama.attention_impl(cfg.replace(dtype="bfloat16")) == "xla"
    assert llama.attention_impl(cfg.replace(attention_impl="xla")) == "xla"
    with pytest.raises(ValueError, match="attention_impl='cpu' cannot run here: a bfloat16 model"):
        llama.attention_impl(cfg.replace(dtype="bfloat16", attention_impl="cpu"))
    monkeypatch.setenv(cpu_ffi.ENV_SWITCH, "0")
    assert llama.attention_impl(cfg) == "xla"


def test_the_forward_through_it_equals_the_xla_path():
    cfg = tiny_config()
    params = llama.init_params(cfg, jax.random.PRNGKey(1))
    prompt = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 9)), jnp.int32)
    cache = init_cache(cfg, 2, 40)
    outputs = {}
    for impl in ("cpu", "xla"):
        c = cfg.replace(attention_impl=impl)
        positions = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), (2, 9))
        first = jax.jit(lambda p, t, pos, ca, c=c: llama.forward(c, p, t, pos, ca))(params, prompt, positions, cache)
        filled = first.cache.advance(jnp.asarray([9, 5], jnp.int32))
        step = jnp.asarray([[3, 4, 5], [6, 7, 8]], jnp.int32)
        pos = filled.lengths[:, None] + jnp.arange(3, dtype=jnp.int32)
        second = jax.jit(lambda p, t, pos, ca, c=c: llama.forward(c, p, t, pos, ca))(params, step, pos, filled)
        outputs[impl] = (first.logits, second.logits, second.cache.k)
    for a, b in zip(outputs["cpu"], outputs["xla"]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("alive", [0, 1, 2, 5])
def test_a_live_query_gets_what_it_gets_when_every_query_is_live(alive):
    """A verify of a chain of 8 whose nodes deeper than `alive` are dead (their diagonal off):
    the live rows bit for bit what the call with every row live gives them, the dead ones zeros."""
    args = inputs(7, 2, 3, 9, 9, 3, 64, 300, lengths=[0, 130, 260])
    chain_mask = args[-1]
    dead = jnp.arange(9) > alive
    mask = chain_mask & ~jnp.diag(dead)[None]
    every = run(*args[:5], 1, args[5], chain_mask)
    got = run(*args[:5], 1, args[5], mask)
    np.testing.assert_array_equal(got, jnp.where(dead[None, :, None, None], 0.0, every))
