"""Pallas verify-attention kernel (interpret mode on CPU) against the jnp reference.

Error metric: max |kernel − reference| / max |reference| over the whole output (elementwise
relative error is meaningless for outputs near 0). A NaN anywhere fails (NaN never compares
below a tolerance), and the kernel's outputs start as NaN (`poison=True`), so an element no
program writes fails too; cached keys/values past each row's length are NaN, so a block read
past the length or an unmasked tail fails.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    KERNEL_TOLERANCE,
    assert_kernel_matches_reference,
    random_inputs,
    random_tree_mask,
    relative_error,
    tiny_config,
)

from specjax.kernels import verify_attention as va
from specjax.kernels.reference import verify_attention_reference
from specjax.models.cache import init_cache
from specjax.models.llama import forward, init_params

TOLERANCE = KERNEL_TOLERANCE


def assert_matches_reference(inputs, dtype, **kernel_args):
    """The kernel, its outputs starting as NaN (`poison=True`), against the reference (see
    helpers)."""
    assert_kernel_matches_reference(va.verify_attention, inputs, dtype, poison=True, **kernel_args)


# (G, T, head_dim, capacity, lengths, dtype, kernel args): ragged lengths including 0, the
# full capacity and lengths not divisible by block_k; several splits and row blocks.
CASES = [
    (1, 1, 64, 40, [0, 37], jnp.float32, {"block_k": 32}),
    (3, 3, 64, 300, [0, 300, 129], jnp.float32, {"block_k": 64, "k_splits": 3}),
    (4, 16, 128, 200, [5, 200], jnp.float32, {"block_k": 32, "k_splits": 2, "block_q": 32}),
    (8, 33, 64, 150, [150, 0, 97], jnp.bfloat16, {"block_k": 32, "k_splits": 4}),
    (4, 3, 128, 300, [300, 1, 190], jnp.bfloat16, {"block_k": 64}),
    (16, 64, 64, 70, [0, 70], jnp.float32, {"block_k": 32}),  # the largest G and T: 1024 rows
    (2, 2, 64, 33000, [32999], jnp.float32, {"block_k": 1024, "k_splits": 4}),  # a 32K context
]


@pytest.mark.parametrize(
    "group, seq, head_dim, capacity, lengths, dtype, kernel_args",
    CASES,
    ids=[f"G{c[0]}-T{c[1]}-D{c[2]}-{jnp.dtype(c[5]).name}-{c[6]}" for c in CASES],
)
def test_kernel_matches_reference(group, seq, head_dim, capacity, lengths, dtype, kernel_args):
    rng = np.random.default_rng(group * 100 + seq)
    inputs = random_inputs(
        rng, batch=len(lengths), seq=seq, group=group, kv_heads=2, head_dim=head_dim,
        capacity=capacity, dtype=dtype, lengths=lengths,
    )
    assert_matches_reference(inputs, dtype, **kernel_args)


def test_padded_tree_nodes_and_empty_rows():
    """Tree nodes masked out entirely (padding): prefix only, or zeros when the row is empty."""
    rng = np.random.default_rng(7)
    inputs = list(random_inputs(
        rng, batch=2, seq=5, group=2, kv_heads=2, head_dim=64, capacity=70,
        dtype=jnp.float32, lengths=[0, 45],
    ))
    tree_mask = np.array(inputs[6])
    tree_mask[:, 3:] = False  # nodes 3, 4 are padding: they attend to nothing new
    inputs[6] = jnp.asarray(tree_mask)
    assert_matches_reference(inputs, jnp.float32, block_k=16, k_splits=2)
    out = va.verify_attention(*inputs, block_k=16, k_splits=2)
    np.testing.assert_array_equal(np.asarray(out[0, 3:]), 0.0)  # row 0 has no cached tokens


def test_every_partial_written():
    """Every element of every split's tile (padded rows included) is written: no NaN left."""
    rng = np.random.default_rng(3)
    q, k_new, v_new, k_cache, v_cache, lengths, tree_mask = random_inputs(
        rng, batch=2, seq=3, group=3, kv_heads=2, head_dim=64, capacity=100,
        dtype=jnp.float32, lengths=[0, 77],
    )
    tiling = va.plan_tiling(2, 3, 3, 2, 100, block_k=32, k_splits=3)
    outputs = va.verify_partials(
        va.pack_queries(q, 2, tiling.rows),
        va.pad_axis(k_new, 1, tiling.new_block),
        va.pad_axis(v_new, 1, tiling.new_block),
        k_cache, v_cache, lengths,
        va.expand_tree_mask(tree_mask, 3, tiling.rows, tiling.new_block),
        tiling=tiling, scale=64 ** -0.5, interpret=True, poison=True,
    )
    for x in outputs:
        assert np.isfinite(np.asarray(x)).all()


def test_default_tiling_heuristics():
    """Defaults: all rows in one tile up to 128, splits that fill the GPU within the caps."""
    one = va.plan_tiling(8, 32, 4, 8, 32768)  # 128 rows: one tile; 64 programs: split
    assert (one.block_q, one.row_blocks, one.new_block) == (128, 1, 32)
    assert one.k_splits > 1
    big = va.plan_tiling(64, 8, 4, 8, 4096)  # 512 programs nearly fill the GPU
    assert big.k_splits <= 2
    lone = va.plan_tiling(1, 32, 4, 8, 32768)  # partial traffic caps the splits of a tall tile
    assert lone.k_splits <= 32768 // (10 * 128)
    tall = va.plan_tiling(1, 64, 16, 8, 4096)  # 1024 rows: 8 tiles of 128
    assert (tall.block_q, tall.row_blocks) == (128, 8)


def test_jit_and_lengths_beyond_capacity_are_clamped():
    rng = np.random.default_rng(11)
    inputs = random_inputs(
        rng, batch=2, seq=2, group=4, kv_heads=1, head_dim=64, capacity=48,
        dtype=jnp.float32, lengths=[48, 20],
    )
    jitted = jax.jit(lambda *a: va.verify_attention(*a, block_k=16))
    out = jitted(*inputs[:5], jnp.array([500, 20], jnp.int32), inputs[6])
    ref = verify_attention_reference(*inputs)
    assert relative_error(out, ref) <= 1e-5


def test_model_forward_pallas_matches_xla():
    """Tiny model (head_dim 8: the zero-padded head_dim path), tree verify on ragged rows."""
    cfg_xla = tiny_config(attention_impl="xla")
    cfg_pallas = tiny_config(attention_impl="pallas")
    params = init_params(cfg_xla, jax.random.PRNGKey(0))
    rng = np.random.default_rng(5)
    prompt = jnp.asarray(rng.integers(2, 64, size=(2, 7)), jnp.int32)
    tree = jnp.asarray(rng.integers(2, 64, size=(2, 4)), jnp.int32)
    tree_mask = jnp.asarray(random_tree_mask(rng, 2, 4))
    cache = init_cache(cfg_xla, 2, 32)
    cache = forward(cfg_xla, params, prompt, jnp.broadcast_to(jnp.arange(7), (2, 7)), cache).cache
    cache = cache.advance(jnp.array([7, 5]))
    positions = cache.lengths[:, None] + jnp.arange(4)
    xla, pallas = (
        forward(cfg, params, tree, positions, cache, tree_mask) for cfg in (cfg_xla, cfg_pallas)
    )
    np.testing.assert_allclose(pallas.logits, xla.logits, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(pallas.cache.k, xla.cache.k, atol=1e-6, rtol=1e-6)


def test_auto_dispatch_keeps_xla_for_padded_head_dims(monkeypatch):
    from specjax.kernels import dispatch

    monkeypatch.setattr(dispatch.jax, "default_backend", lambda: "gpu")
    assert [dispatch.resolve_impl("auto", d) for d in (64, 128, 80, 8)] == [
        "pallas", "pallas", "xla", "xla"
    ]
    assert dispatch.resolve_impl("pallas", 80) == "pallas"


@pytest.mark.parametrize(
    "batch, seq, group, head_dim, capacity, dtype, kernel_args",
    [
        (8, 32, 4, 128, 32768, jnp.bfloat16, {}),  # the target: 128 rows in one tile
        (1, 64, 16, 128, 4096, jnp.bfloat16, {"k_splits": 4}),  # 1024 rows: 8 row blocks
        (2, 3, 3, 64, 1000, jnp.float32, {"block_q": 16, "block_k": 32, "poison": True}),
    ],
)
def test_lowers_to_triton_for_gpu(batch, seq, group, head_dim, capacity, dtype, kernel_args):
    """The GPU path (interpret=False) lowers to Triton IR on this CPU machine: catches Triton
    lowering errors (non-power-of-two tensors, unsupported ops) without a GPU."""

    def spec(*shape, dt=dtype):
        return jax.ShapeDtypeStruct(shape, dt)

    args = (
        spec(batch, seq, 8 * group, head_dim), spec(batch, seq, 8, head_dim),
        spec(batch, seq, 8, head_dim), spec(batch, 8, head_dim, capacity),
        spec(batch, 8, capacity, head_dim), spec(batch, dt=jnp.int32),
        spec(batch, seq, seq, dt=jnp.bool_),
    )
    fn = jax.jit(lambda *a: va.verify_attention(*a, interpret=False, **kernel_args))
    try:
        lowered = fn.trace(*args).lower(lowering_platforms=("cuda",))
    except Exception as exc:
        if "cuda" in str(exc).lower() and "platform" in str(exc).lower():
            pytest.skip(f"no CUDA lowering in this jaxlib: {exc}")
        raise
    assert "__gpu$xla.gpu.triton" in lowered.as_text()  # the Triton custom call
