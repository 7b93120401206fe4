"""Mosaic TPU verify-attention kernel: interpret mode on CPU against the jnp reference, and its
lowering for the `tpu` platform (the Mosaic custom call) on this CPU machine.

Error metric as tests/test_verify_attention.py: max |kernel − reference| / max |reference|; a
NaN anywhere fails. The kernel's cached keys/values past each row's length are NaN
(`poison_padding`; the reference gets the clean ones), so a block the kernel reads past the
length, or a tail it fails to mask, fails the test; and a
capacity that is not a multiple of block_k leaves a partial last block, which Pallas interpret
mode fills with NaN as undefined memory.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    KERNEL_TOLERANCE,
    assert_kernel_matches_reference,
    poison_padding,
    random_inputs,
    random_tree_mask,
    relative_error,
    tiny_config,
)
from jax.experimental.pallas import tpu as pltpu

from specjax.kernels import verify_attention_tpu as vt
from specjax.kernels.reference import verify_attention_reference
from specjax.models.cache import init_cache
from specjax.models.llama import forward, init_params

TOLERANCE = KERNEL_TOLERANCE


def assert_matches_reference(inputs, dtype, **kernel_args):
    """The kernel (interpret mode unless told) against the reference (see helpers)."""
    kernel_args.setdefault("interpret", True)
    assert_kernel_matches_reference(vt.verify_attention, inputs, dtype, **kernel_args)


# (G, T, head_dim, capacity, lengths, dtype, kernel args): the GPU kernel's cases, with TPU
# block sizes (multiples of 128): ragged lengths including 0 and the full capacity, lengths
# and capacities not divisible by block_k (partial last blocks), several row blocks.
CASES = [
    (1, 1, 64, 40, [0, 37], jnp.float32, {}),  # cache shorter than 128: zero-padded
    (3, 3, 64, 300, [0, 300, 129], jnp.float32, {"block_k": 128}),
    (2, 4, 128, 1100, [1100, 700, 260], jnp.float32, {"block_k": 512, "chunk_k": 128}),
    (4, 16, 128, 200, [5, 200], jnp.float32, {"block_k": 128, "block_q": 32}),
    (8, 33, 64, 150, [150, 0, 97], jnp.bfloat16, {"block_k": 128}),
    (4, 3, 128, 1000, [999, 1, 190], jnp.bfloat16, {}),
    (2, 5, 80, 260, [3, 259], jnp.float32, {"block_k": 128}),  # head_dim padded to 128
    (16, 64, 64, 70, [0, 70], jnp.float32, {}),  # the largest G and T: 1024 rows, one tile
    (2, 2, 64, 33000, [32999], jnp.float32, {}),  # a 32K context, default blocks
]


@pytest.mark.parametrize(
    "group, seq, head_dim, capacity, lengths, dtype, kernel_args",
    CASES,
    ids=[f"G{c[0]}-T{c[1]}-D{c[2]}-S{c[3]}-{jnp.dtype(c[5]).name}-{c[6]}" for c in CASES],
)
def test_kernel_matches_reference(group, seq, head_dim, capacity, lengths, dtype, kernel_args):
    rng = np.random.default_rng(group * 100 + seq)
    inputs = random_inputs(
        rng, batch=len(lengths), seq=seq, group=group, kv_heads=2, head_dim=head_dim,
        capacity=capacity, dtype=dtype, lengths=lengths,
    )
    assert_matches_reference(inputs, dtype, **dict(kernel_args))


def test_tpu_interpreter_matches_reference():
    """The TPU-specific interpreter (`pltpu.InterpretParams`: simulated DMAs and semaphores of
    the pipeline) agrees too, bf16, ragged with an empty row and a partial last block."""
    rng = np.random.default_rng(21)
    inputs = random_inputs(
        rng, batch=3, seq=4, group=4, kv_heads=2, head_dim=128, capacity=400,
        dtype=jnp.bfloat16, lengths=[0, 400, 131],
    )
    assert_matches_reference(inputs, jnp.bfloat16, block_k=128, interpret=pltpu.InterpretParams())


def test_padded_tree_nodes_and_empty_rows():
    """Tree nodes masked out entirely (padding): prefix only, or zeros when the row is empty."""
    rng = np.random.default_rng(7)
    inputs = list(random_inputs(
        rng, batch=2, seq=5, group=2, kv_heads=2, head_dim=64, capacity=300,
        dtype=jnp.float32, lengths=[0, 145],
    ))
    tree_mask = np.array(inputs[6])
    tree_mask[:, 3:] = False  # nodes 3, 4 are padding: they attend to nothing new
    inputs[6] = jnp.asarray(tree_mask)
    assert_matches_reference(inputs, jnp.float32, block_k=128)
    out = vt.verify_attention(*poison_padding(inputs), block_k=128, interpret=True)
    np.testing.assert_array_equal(np.asarray(out[0, 3:]), 0.0)  # row 0 has no cached tokens


def test_nonfinite_new_token_reaches_only_its_descendants():
    """A NaN in one new token's key: the queries that may see it get NaN, the others stay
    exact (the reference's contract)."""
    rng = np.random.default_rng(9)
    q, k_new, v_new, k_cache, v_cache, lengths, _ = random_inputs(
        rng, batch=1, seq=3, group=2, kv_heads=1, head_dim=64, capacity=128,
        dtype=jnp.float32, lengths=[50],
    )
    chain = jnp.asarray(np.tril(np.ones((1, 3, 3), bool)))
    k_new = k_new.at[0, 1, 0, 5].set(jnp.nan)  # token 1: seen by tokens 1 and 2
    args = (q, k_new, v_new, k_cache, v_cache, lengths, chain)
    out, ref = vt.verify_attention(*args, interpret=True), verify_attention_reference(*args)
    assert np.isnan(np.asarray(out[0, 1:])).all() and np.isnan(np.asarray(ref[0, 1:])).all()
    np.testing.assert_allclose(out[0, 0], ref[0, 0], rtol=1e-5, atol=1e-6)


def test_tiling_plans():
    one = vt.plan_tpu_tiling(32, 4, 32768)  # the target: 128 rows in one tile
    assert (one.block_q, one.row_blocks, one.new_block) == (128, 1, 128)
    assert (one.block_k, one.chunk_k, one.kv_blocks) == (2048, 512, 16)
    tall = vt.plan_tpu_tiling(64, 16, 4096, block_q=256)
    assert (tall.block_q, tall.row_blocks, tall.rows) == (256, 4, 1024)
    short = vt.plan_tpu_tiling(3, 3, 300)  # never past the cache
    assert (short.block_k, short.chunk_k, short.kv_blocks) == (256, 256, 2)
    odd = vt.plan_tpu_tiling(1, 1, 5000, block_k=1280, chunk_k=512)  # block: whole chunks
    assert (odd.block_k, odd.chunk_k) == (1024, 512)
    with pytest.raises(ValueError, match="block_k must be a positive multiple of 128"):
        vt.plan_tpu_tiling(1, 1, 1024, block_k=64)
    with pytest.raises(ValueError, match="chunk_k must be"):
        vt.plan_tpu_tiling(1, 1, 1024, chunk_k=100)


def test_kv_blocks_past_a_length_are_never_fetched():
    """The K/V index maps: steps past a row's last block repeat it (the pipeline then skips the
    copy), so a row reads ceil(length / block_k) blocks, one for an empty row."""
    steps = jnp.arange(8)
    for length, last in ((0, 0), (1, 0), (128, 0), (129, 1), (1000, 7), (5000, 7)):
        index = np.asarray(vt.kv_block_index(steps, jnp.int32(length), 128))
        np.testing.assert_array_equal(index, np.minimum(np.arange(8), last))


def test_lengths_beyond_capacity_are_clamped_under_jit():
    rng = np.random.default_rng(11)
    inputs = random_inputs(
        rng, batch=2, seq=2, group=4, kv_heads=1, head_dim=64, capacity=256,
        dtype=jnp.float32, lengths=[256, 20],
    )
    jitted = jax.jit(lambda *a: vt.verify_attention(*a, block_k=128, interpret=True))
    out = jitted(*inputs[:5], jnp.array([5000, 20], jnp.int32), inputs[6])
    assert relative_error(out, verify_attention_reference(*inputs)) <= 1e-5


def test_model_forward_pallas_tpu_matches_xla():
    """Tiny model (head_dim 8: padded to 128), tree verify on ragged rows, through dispatch."""
    cfg_xla, cfg_tpu = (tiny_config(attention_impl=impl) for impl in ("xla", "pallas_tpu"))
    params = init_params(cfg_xla, jax.random.PRNGKey(0))
    rng = np.random.default_rng(5)
    prompt = jnp.asarray(rng.integers(2, 64, size=(2, 7)), jnp.int32)
    tree = jnp.asarray(rng.integers(2, 64, size=(2, 4)), jnp.int32)
    tree_mask = jnp.asarray(random_tree_mask(rng, 2, 4))
    cache = init_cache(cfg_xla, 2, 32)
    cache = forward(cfg_xla, params, prompt, jnp.broadcast_to(jnp.arange(7), (2, 7)), cache).cache
    cache = cache.advance(jnp.array([7, 5]))
    positions = cache.lengths[:, None] + jnp.arange(4)
    xla, tpu = (forward(cfg, params, tree, positions, cache, tree_mask) for cfg in (cfg_xla, cfg_tpu))
    np.testing.assert_allclose(tpu.logits, xla.logits, atol=1e-5, rtol=1e-5)


def test_dispatch_per_backend(monkeypatch):
    from specjax.kernels import dispatch

    for backend, auto, pallas in (("tpu", "pallas_tpu", "pallas_tpu"), ("gpu", "pallas", "pallas"),
                                  ("cpu", "xla", "pallas")):
        monkeypatch.setattr(dispatch.jax, "default_backend", lambda b=backend: b)
        assert dispatch.resolve_impl("auto", 128) == auto
        assert dispatch.resolve_impl("pallas", 80) == pallas
        assert dispatch.resolve_impl("pallas_tpu", 8) == "pallas_tpu"
    monkeypatch.setattr(dispatch.jax, "default_backend", lambda: "tpu")
    assert [dispatch.resolve_impl("auto", d) for d in (64, 128, 256, 80, 8)] == [
        "pallas_tpu", "pallas_tpu", "pallas_tpu", "xla", "xla"
    ]
    with pytest.raises(ValueError, match="attention_impl must be one of"):
        dispatch.resolve_impl("triton")


def lowering_args(batch, seq, group, head_dim, capacity, dtype, kv_heads=8):
    def spec(*shape, dt=dtype):
        return jax.ShapeDtypeStruct(shape, dt)

    return (
        spec(batch, seq, kv_heads * group, head_dim), spec(batch, seq, kv_heads, head_dim),
        spec(batch, seq, kv_heads, head_dim), spec(batch, kv_heads, head_dim, capacity),
        spec(batch, kv_heads, capacity, head_dim), spec(batch, dt=jnp.int32),
        spec(batch, seq, seq, dt=jnp.bool_),
    )


@pytest.mark.parametrize(
    "batch, seq, group, head_dim, capacity, dtype, kernel_args",
    [
        (8, 32, 4, 128, 32768, jnp.bfloat16, {}),  # the target: 128 rows in one tile
        (8, 1, 4, 128, 32768, jnp.bfloat16, {}),  # plain decode, T = 1
        (1, 64, 16, 128, 4096, jnp.bfloat16, {"block_q": 256}),  # 1024 rows: 4 row blocks
        (2, 3, 3, 64, 1000, jnp.float32, {"block_k": 128}),  # f32, partial last block
        (2, 5, 2, 80, 60, jnp.float32, {}),  # padded head_dim and capacity
    ],
)
def test_lowers_to_mosaic_for_tpu(batch, seq, group, head_dim, capacity, dtype, kernel_args):
    """The TPU path (interpret=False) lowers for the `tpu` platform on this CPU machine: the
    Pallas -> Mosaic lowering (block shapes against the (8, 128) tiling, every op in the kernel
    and its index maps) runs here. Mosaic's own layout passes run later, inside the TPU
    compiler, so this cannot prove the kernel compiles on a TPU, only that it gets that far."""
    fn = jax.jit(lambda *a: vt.verify_attention(*a, interpret=False, **kernel_args))
    args = lowering_args(batch, seq, group, head_dim, capacity, dtype)
    text = fn.trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text


def test_tpu_benchmark_prediction_is_the_committed_table():
    """benchmarks/tpu_verify_attention.py --predict reproduces the committed PREDICTED table:
    v5e 819 GB/s and v6e 1640 GB/s over 1 GiB of K/V (B=8, 32K, 8 KV heads, Dh 128, bf16)."""
    from pathlib import Path

    from helpers import load_benchmark

    bench = load_benchmark("tpu_verify_attention")
    committed = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    text = bench.predicted_table()
    assert (committed / "tpu_verify_attention_predicted.md").read_text() == text + "\n"
    assert "PREDICTED" in text.splitlines()[0]
    v5e = bench.predict_row(bench.CHIPS["TPU v5e"], 8, 32768, 4, 8, 128, 1)
    assert abs(v5e["memory_ms"] - 2**30 / 819e9 * 1e3) < 1e-3
    assert [kind for kind, *_ in bench.points(bench.FULL)][:4] == ["kernel", "xla", "kernel", "xla"]
