"""The CPU int8 matmul kernel (`kernels/qmatmul_cpu`) against its jnp reference and qwix.

- packed layout: pack / unpack round trip (int4 two a byte too); the dequantized stack equals
  qwix's dequantize;
- the kernel equals the reference on random shapes (rows 0..13, ragged row tiles, per-channel
  and block scales, every layer of a stack), and a row's result does not depend on the other
  rows (bit for bit: each output is one sum in order, or exact integer sums of x's digits on
  AVX-512 VNNI); a row with a NaN or an infinity gives no finite output and leaves the others
  alone; a wide row of mixed magnitudes keeps f32 precision;
- int4 held two a byte gives what one a byte gives, bit for bit (every row count, a scale a
  channel, a block of 32 or of 8 inputs);
- a PackedKernel multiplies like the QArray it came from (`qwix.dot_general`);
- it composes: jit, vmap over rows and over the layer index, grad in x and scale;
- bad input is an error, never a wrong answer (a layer index out of range, shapes that do not
  fit);
- `pack_params` packs int8 / int4 kernels on one CPU device, leaves fp8 and kernels whose
  output size is not a multiple of 16, `unpack_params` gives the QArrays back exactly, and
  `SPECJAX_CPU_KERNELS=0` or a failed build keeps the QArrays (the XLA path);
- the layer loop over the index (`llama.scan_layers`) computes what `nn.scan` computes, bit for
  bit, on f32 params with the kernels off;
- the float kernel (`qmatmul_cpu.matmul`: f32 / bf16 stacks as stored, read in place) equals its
  reference on random shapes (ragged row tiles, the restriped path of more than 6 rows, every
  layer), is row-invariant bit for bit, composes with vmap and grad (in x and the stack), and
  errors on bad input; the layer loop hands f32 / bf16 kernels to it (`quant.LayerKernel`),
  the model's output stays what XLA's path computes, and the decode program copies no
  weight slice; kernels of one input go in one call (`qmatmul_group` / `matmul_group`, the same
  results as one call each, bit for bit; `quant.grouped_product` groups one kind and one layer);
- float stacks packed in column blocks (`matmul_blocks`, `quant.BlockedKernel`): the same sums
  as the stack as stored, bit for bit; `pack_params` packs the float layer kernels only (params
  `layers/.../kernel`), the model's logits are the unpacked params' bit for bit, the decode
  program makes its 4 calls a layer on the blocks, quantizing packed params quantizes the
  kernels as stored.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix
from helpers import tiny_config
from hypothesis import given, settings
from hypothesis import strategies as st

import specjax.models.quant as quant
from specjax.kernels import cpu_ffi, qmatmul_cpu
from specjax.models.cache import init_cache
from specjax.models.llama import (
    LlamaModel,
    causal_mask,
    forward,
    init_params,
    layer_params,
    rope_tables,
    scan_layers,
)

pytestmark = pytest.mark.skipif(quant.cpu_kernel_reason() is not None,
                                reason=f"CPU kernel unavailable: {quant.cpu_kernel_reason()}")


def random_quantized(seed: int, layers: int, k: int, n: int, mode: str) -> qwix.QArray:
    w = jax.random.normal(jax.random.PRNGKey(seed), (layers, k, n), jnp.float32)
    return quant.quantize_kernel(w, quant.SPECS[mode])


def rows(seed: int, shape) -> jax.Array:
    return jax.random.normal(jax.random.PRNGKey(seed + 100), shape, jnp.float32)


def packed_values(q: qwix.QArray) -> jax.Array:
    """The values as `pack_params` holds them: int4 two a byte, int8 one."""
    if jnp.dtype(q.qtype) == jnp.dtype(jnp.int4):
        return qmatmul_cpu.pack_int4(q.qvalue)
    return qmatmul_cpu.pack(q.qvalue)


def test_pack_round_trips_and_dequantizes_like_qwix():
    q = random_quantized(0, 3, 64, 48, "int4")
    packed = qmatmul_cpu.pack(q.qvalue)
    assert packed.shape == (3, 3, 64, 16) and packed.dtype == jnp.int8
    np.testing.assert_array_equal(qmatmul_cpu.unpack(packed), q.qvalue.astype(jnp.int8))
    np.testing.assert_array_equal(qmatmul_cpu.dequantize(packed, q.scale), qwix.dequantize(q))
    nibbles = qmatmul_cpu.pack_int4(q.qvalue)
    assert nibbles.shape == (3, 3, 32, 16) and nibbles.dtype == jnp.uint8
    assert qmatmul_cpu.kernel_inputs(nibbles) == 64
    np.testing.assert_array_equal(qmatmul_cpu.unpack(nibbles), q.qvalue.astype(jnp.int8))
    np.testing.assert_array_equal(qmatmul_cpu.dequantize(nibbles, q.scale), qwix.dequantize(q))
    # the layout the kernel reads: block 1, byte row 4 c + i = rows 8 c + i (low) and + 4 (high)
    values = np.asarray(q.qvalue.astype(jnp.int8))
    byte = int(np.asarray(nibbles)[2, 1, 4 * 3 + 2, 5])
    assert (byte & 15) - 8 == values[2, 8 * 3 + 2, 16 + 5]
    assert (byte >> 4) - 8 == values[2, 8 * 3 + 4 + 2, 16 + 5]


@pytest.mark.parametrize("per_group", [None, 32, 8, 6])
def test_int4_two_a_byte_computes_what_one_a_byte_computes(per_group):
    """Bit for bit, over row counts 0-13 (every tile shape) and each layer; a scale a channel
    (None), a block of 32 inputs (int4's) or of 8 (the layout's run of rows): the integer path
    where the CPU has AVX-512 VNNI; blocks of 6 inputs take the float path on any CPU
    (`load_nibble_row`)."""
    layers, k, n = 2, 96, 64
    q = random_quantized(7, layers, k, n, "int4")
    groups = 1 if per_group is None else k // per_group
    scale = jnp.abs(rows(7, (layers, groups, n))) + 0.1
    for m in range(14):
        x = rows(m, (m, k))
        for layer in range(layers):
            nibbles = jax.jit(qmatmul_cpu.qmatmul)(x, qmatmul_cpu.pack_int4(q.qvalue), scale, layer)
            one_a_byte = jax.jit(qmatmul_cpu.qmatmul)(x, qmatmul_cpu.pack(q.qvalue), scale, layer)
            np.testing.assert_array_equal(nibbles, one_a_byte)


@settings(max_examples=25, deadline=None)
@given(layers=st.integers(1, 3), k=st.sampled_from([32, 64, 96]), nblocks=st.integers(1, 4),
       m=st.integers(0, 13), block_scales=st.booleans(), seed=st.integers(0, 2**16))
def test_kernel_equals_reference(layers, k, nblocks, m, block_scales, seed):
    q = random_quantized(seed, layers, k, 16 * nblocks, "int4" if block_scales else "int8")
    packed = packed_values(q)
    x = rows(seed, (m, k))
    for layer in range(layers):
        got = jax.jit(qmatmul_cpu.qmatmul)(x, packed, q.scale, layer)
        want = qmatmul_cpu.qmatmul_reference(x, packed, q.scale, layer)
        assert got.shape == (m, 16 * nblocks)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(want), initial=1)))


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_rows_result_does_not_depend_on_the_other_rows(mode):
    q = random_quantized(1, 2, 96, 64, mode)
    packed = packed_values(q)
    x = rows(1, (13, 96))
    together = jax.jit(qmatmul_cpu.qmatmul)(x, packed, q.scale, 1)
    for m in (1, 2, 5, 7):
        np.testing.assert_array_equal(jax.jit(qmatmul_cpu.qmatmul)(x[:m], packed, q.scale, 1),
                                      together[:m])
    np.testing.assert_array_equal(jax.jit(qmatmul_cpu.qmatmul)(x[7:8], packed, q.scale, 1),
                                  together[7:8])


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_row_that_is_not_finite_gives_no_finite_output_and_leaves_the_others_alone(bad, mode):
    """Every path: the integer digits (AVX-512 VNNI builds; a scale a channel or a block) and
    the float FMAs."""
    q = random_quantized(2, 2, 96, 64, mode)
    packed = packed_values(q)
    x = rows(2, (5, 96))
    clean = jax.jit(qmatmul_cpu.qmatmul)(x, packed, q.scale, 0)
    got = np.asarray(jax.jit(qmatmul_cpu.qmatmul)(x.at[3, 17].set(bad), packed, q.scale, 0))
    assert not np.isfinite(got[3]).any()
    np.testing.assert_array_equal(np.delete(got, 3, 0), np.delete(np.asarray(clean), 3, 0))


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_wide_rows_of_mixed_magnitudes_keep_f32_precision(mode):
    """K = 1536 (SmolLM2's down projection), values from 1e-4 to 1e2 in one row: the integer
    path's digits (~2^-24 of the row's largest |x|) keep the product as close as f32 FMAs."""
    q = random_quantized(3, 1, 1536, 48, mode)
    packed = packed_values(q)
    x = rows(3, (4, 1536)) * jnp.logspace(-4, 2, 1536)[None, :]
    want = np.asarray(x, np.float64) @ np.asarray(qwix.dequantize(q)[0], np.float64)
    got = jax.jit(qmatmul_cpu.qmatmul)(x, packed, q.scale, 0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * float(np.max(np.abs(want))))


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_packed_kernel_multiplies_like_its_qarray(mode):
    q = random_quantized(2, 2, 64, 32, mode)
    (kernel,) = jax.tree.leaves(quant.pack_params({"w": q}), is_leaf=quant.is_quantized)
    assert isinstance(kernel, quant.PackedKernel) and kernel.mode == mode
    assert kernel.shape == q.shape
    x = rows(2, (2, 3, 64))
    for layer in range(2):
        one = jax.tree.map(lambda a, i=layer: a[i], q)
        want = qwix.dot_general(x, one, (((2,), (0,)), ((), ())))
        got = quant.packed_matmul(x, quant.PackedKernel(kernel.packed, kernel.scale, layer, mode))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_it_composes_with_vmap_and_grad():
    q = random_quantized(3, 2, 32, 32, "int8")
    packed, scale = qmatmul_cpu.pack(q.qvalue), q.scale
    x = rows(3, (4, 3, 32))
    ref = qmatmul_cpu.qmatmul_reference
    by_rows = jax.jit(jax.vmap(lambda a: qmatmul_cpu.qmatmul(a, packed, scale, 1)))(x)
    np.testing.assert_allclose(by_rows, ref(x, packed, scale, 1), rtol=1e-5, atol=1e-5)
    by_layer = jax.jit(jax.vmap(lambda i: qmatmul_cpu.qmatmul(x[0], packed, scale, i)))(jnp.arange(2))
    for i in range(2):
        np.testing.assert_allclose(by_layer[i], ref(x[0], packed, scale, i), rtol=1e-5, atol=1e-5)

    def loss(fn):
        return lambda a, s: jnp.sum(jnp.sin(fn(a, packed, s, 0)))

    got = jax.grad(loss(qmatmul_cpu.qmatmul), argnums=(0, 1))(x, scale)
    want = jax.grad(loss(ref), argnums=(0, 1))(x, scale)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4 * float(jnp.max(jnp.abs(w))))


def test_bad_input_is_an_error():
    q = random_quantized(4, 2, 32, 16, "int8")
    packed = qmatmul_cpu.pack(q.qvalue)
    with pytest.raises(jax.errors.JaxRuntimeError, match="layer index out of range"):
        jax.jit(qmatmul_cpu.qmatmul)(rows(4, (1, 32)), packed, q.scale, 2).block_until_ready()
    with pytest.raises(ValueError, match="do not fit"):
        qmatmul_cpu.qmatmul(rows(4, (1, 48)), packed, q.scale, 0)


def test_pack_params_packs_what_the_kernel_runs_and_unpacks_exactly(monkeypatch):
    tree = {"int8": random_quantized(5, 2, 32, 48, "int8"),
            "int4": random_quantized(5, 2, 64, 32, "int4"),
            "fp8": random_quantized(5, 2, 32, 48, "fp8"),
            "narrow": random_quantized(5, 2, 32, 24, "int8"),  # 24 outputs: not whole blocks
            "float": jnp.ones((4, 4))}
    packed = quant.pack_params(tree)
    assert {k for k, v in packed.items() if isinstance(v, quant.PackedKernel)} == {"int8", "int4"}
    assert packed["fp8"] is tree["fp8"] and packed["narrow"] is tree["narrow"]
    assert quant.quantization_of({"w": packed["int4"]}) == "int4"
    assert packed["int4"].packed.dtype == jnp.uint8  # two a byte: half int8's bytes
    assert packed["int4"].packed.nbytes * 2 == tree["int4"].qvalue.size
    assert packed["int4"].shape == tree["int4"].shape
    back = quant.unpack_params(packed)
    for name in ("int8", "int4"):
        assert back[name].qtype == tree[name].qtype
        np.testing.assert_array_equal(back[name].qvalue, tree[name].qvalue)
        np.testing.assert_array_equal(back[name].scale, tree[name].scale)
    monkeypatch.setenv(qmatmul_cpu.ENV_SWITCH, "0")
    assert quant.pack_params(tree) is tree


def test_a_failed_build_keeps_the_xla_path(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_ffi, "_state", {})
    monkeypatch.setenv("CXX", "false")
    reason = qmatmul_cpu.available(tmp_path)
    assert reason is not None and "failed" in reason
    tree = {"w": random_quantized(6, 2, 32, 32, "int8")}
    monkeypatch.setattr(quant, "cpu_kernel_reason", lambda: reason)
    assert quant.pack_params(tree) is tree


def test_scan_layers_computes_what_nn_scan_computes(monkeypatch):
    monkeypatch.setenv(qmatmul_cpu.ENV_SWITCH, "0")  # XLA's dots, as nn.scan's
    cfg = tiny_config()
    params = init_params(cfg, jax.random.PRNGKey(7))
    tokens = jnp.asarray(np.random.default_rng(7).integers(0, cfg.vocab_size, (2, 5)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(5, dtype=jnp.int32), (2, 5))
    cache = init_cache(cfg, 2, 8)
    lengths, mask = jnp.zeros(2, jnp.int32), causal_mask(2, 5)

    def inputs(module):
        cos, sin = rope_tables(cfg, positions)
        return module.embed_tokens(tokens), cache.k, cache.v, cos, sin, lengths, mask

    by_nn_scan = LlamaModel(cfg).apply(params, method=lambda m: m.layers(*inputs(m)))
    by_index = LlamaModel(cfg).apply(params, method=lambda m: scan_layers(
        cfg, False, m.variables["params"]["layers"], *inputs(m)))
    for a, b in zip(jax.tree.leaves(by_nn_scan), jax.tree.leaves(by_index)):
        np.testing.assert_array_equal(a, b)


def test_int8_and_int4_add_an_int8_head_the_logits_read():
    """int8 / int4 add an int8 LM head (per vocabulary entry) from the tied embedding or the
    untied head; fp8 adds none; the target's logits are the int8 head's product."""
    for tied in (True, False):
        cfg = tiny_config(tie_word_embeddings=tied)
        f32 = init_params(cfg, jax.random.PRNGKey(8))
        head = quant.head_kernel(f32["params"])
        assert head.shape == (cfg.hidden_size, cfg.vocab_size)
        for mode in ("int8", "int4"):
            q = quant.quantize_params(f32, mode)
            kernel = q["params"][quant.HEAD]["kernel"]
            assert kernel.qvalue.dtype == jnp.int8 and kernel.scale.shape == (1, cfg.vocab_size)
            hidden = rows(8, (3, cfg.hidden_size))
            logits = LlamaModel(cfg).apply(quant.pack_params(q), hidden, method=LlamaModel.logits)
            np.testing.assert_allclose(logits, hidden @ qwix.dequantize(kernel), rtol=1e-5, atol=1e-5)
        assert quant.HEAD not in quant.quantize_params(f32, "fp8")["params"]


def test_auto_step_costs_are_kept_apart_by_how_the_weights_are_held(monkeypatch):
    from specjax.auto_costs import weights_of  # the api layer: only this test needs it

    f32 = init_params(tiny_config(), jax.random.PRNGKey(9))
    q = quant.quantize_params(f32, "int8")
    assert [weights_of(p) for p in (f32, quant.pack_params(f32), q, quant.pack_params(q))] == [
        "float/cpu-kernel", "float/cpu-blocks", "int8", "int8/cpu-kernel"]
    monkeypatch.setenv(qmatmul_cpu.ENV_SWITCH, "0")
    assert weights_of(f32) == "float"


@settings(max_examples=25, deadline=None)
@given(layers=st.integers(1, 3), k=st.sampled_from([8, 32, 96]), nblocks=st.integers(1, 5),
       m=st.integers(0, 14), dtype=st.sampled_from(["float32", "bfloat16"]), seed=st.integers(0, 2**16))
def test_float_kernel_equals_reference(layers, k, nblocks, m, dtype, seed):
    stack = jax.random.normal(jax.random.PRNGKey(seed), (layers, k, 16 * nblocks), dtype)
    blocks = qmatmul_cpu.pack(stack)
    assert blocks.dtype == stack.dtype
    x = rows(seed, (m, k))
    for layer in range(layers):
        got = jax.jit(qmatmul_cpu.matmul)(x, stack, layer)
        want = qmatmul_cpu.matmul_reference(x, stack, layer)
        assert got.shape == (m, 16 * nblocks) and got.dtype == jnp.float32
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(want), initial=1)))
        np.testing.assert_array_equal(jax.jit(qmatmul_cpu.matmul_blocks)(x, blocks, layer), got)
        np.testing.assert_array_equal(qmatmul_cpu.matmul_blocks_reference(x, blocks, layer), want)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kernel, shape", [
    (qmatmul_cpu.matmul, (2, 96, 80)),  # [L, K, N]; 20 rows: 4 row tiles, the restriped path
    (qmatmul_cpu.matmul_rows, (2, 101, 64)),  # [L, N, K]; N = 101: a short last unit
    (qmatmul_cpu.matmul_blocks, (2, 5, 96, 16)),  # [L, N/16, K, 16]
])
def test_a_rows_float_result_does_not_depend_on_the_other_rows(dtype, kernel, shape):
    stack = jax.random.normal(jax.random.PRNGKey(2), shape, dtype)
    k = shape[2] if kernel is qmatmul_cpu.matmul_rows else shape[1] if len(shape) == 3 else shape[2]
    x = rows(2, (20, k))
    together = jax.jit(kernel)(x, stack, 1)
    for lo, hi in ((0, 1), (0, 2), (0, 3), (2, 6), (0, 7), (5, 6), (12, 20)):  # (2, 6): one tile
        np.testing.assert_array_equal(jax.jit(kernel)(x[lo:hi], stack, 1), together[lo:hi])


@pytest.mark.parametrize("kernel, reference, shape", [
    (qmatmul_cpu.matmul, qmatmul_cpu.matmul_reference, (2, 32, 48)),  # [L, K, N]
    (qmatmul_cpu.matmul_rows, qmatmul_cpu.matmul_rows_reference, (2, 40, 32)),  # [L, N, K]
    (qmatmul_cpu.matmul_blocks, qmatmul_cpu.matmul_blocks_reference, (2, 3, 32, 16)),  # blocks
])
def test_the_float_kernels_compose_with_vmap_and_grad(kernel, reference, shape):
    stack = jax.random.normal(jax.random.PRNGKey(3), shape, jnp.float32)
    x = rows(3, (4, 3, 32))
    by_rows = jax.jit(jax.vmap(lambda a: kernel(a, stack, 1)))(x)
    np.testing.assert_allclose(by_rows, reference(x, stack, 1), rtol=1e-5, atol=1e-5)
    by_layer = jax.jit(jax.vmap(lambda i: kernel(x[0], stack, i)))(jnp.arange(2))
    for i in range(2):
        np.testing.assert_allclose(by_layer[i], reference(x[0], stack, i), rtol=1e-5, atol=1e-5)

    def loss(fn):
        return lambda a, w: jnp.sum(jnp.sin(fn(a, w, 1)))

    got = jax.grad(loss(kernel), argnums=(0, 1))(x, stack)
    want = jax.grad(loss(reference), argnums=(0, 1))(x, stack)
    assert not np.any(np.asarray(got[1][0]))  # layer 0 took no part
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4 * float(jnp.max(jnp.abs(w))))


def test_bad_float_input_is_an_error():
    stack = jax.random.normal(jax.random.PRNGKey(4), (2, 32, 16), jnp.float32)
    with pytest.raises(jax.errors.JaxRuntimeError, match="layer index out of range"):
        jax.jit(qmatmul_cpu.matmul)(rows(4, (1, 32)), stack, 2).block_until_ready()
    with pytest.raises(ValueError, match="do not fit"):
        qmatmul_cpu.matmul(rows(4, (1, 48)), stack, 0)
    with pytest.raises(ValueError, match="do not fit"):  # 24 outputs: not whole blocks
        qmatmul_cpu.matmul(rows(4, (1, 32)), jnp.ones((2, 32, 24)), 0)
    with pytest.raises(ValueError, match="do not fit"):
        qmatmul_cpu.matmul(rows(4, (1, 32)), jnp.ones((2, 32, 16), jnp.int32), 0)
    blocks = qmatmul_cpu.pack(stack)
    with pytest.raises(jax.errors.JaxRuntimeError, match="layer index out of range"):
        jax.jit(qmatmul_cpu.matmul_blocks)(rows(4, (1, 32)), blocks, 2).block_until_ready()
    with pytest.raises(ValueError, match="do not fit"):  # K = 32, x has 48
        qmatmul_cpu.matmul_blocks(rows(4, (1, 48)), blocks, 0)
    with pytest.raises(ValueError, match="do not fit"):  # the stack as stored, not packed
        qmatmul_cpu.matmul_blocks(rows(4, (1, 32)), stack, 0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_layer_loop_reads_float_kernels_in_place(dtype, monkeypatch):
    cfg = tiny_config(dtype=dtype)
    params = init_params(cfg, jax.random.PRNGKey(8))
    layers = params["params"]["layers"]
    one = layer_params(layers, jnp.int32(1))
    kernels = [leaf for leaf in jax.tree.leaves(one, is_leaf=lambda v: isinstance(v, quant.LayerKernel))
               if isinstance(leaf, quant.LayerKernel)]
    fitting = [leaf for leaf in jax.tree.leaves(layers) if qmatmul_cpu.float_kernel_fits(leaf)]
    assert kernels and len(kernels) == len(fitting)
    tokens = jnp.asarray(np.random.default_rng(8).integers(0, cfg.vocab_size, (2, 5)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(5, dtype=jnp.int32), (2, 5))

    def logits():
        cache = init_cache(cfg, 2, 8)
        return jax.jit(lambda p: forward(cfg, p, tokens, positions, cache).logits)(params)

    by_kernel = logits()
    monkeypatch.setenv(qmatmul_cpu.ENV_SWITCH, "0")
    assert quant.float_kernel_reason() is not None
    assert not any(isinstance(v, quant.LayerKernel) for v in jax.tree.leaves(
        layer_params(layers, jnp.int32(1)), is_leaf=lambda v: isinstance(v, quant.LayerKernel)))
    by_xla = logits()
    tol = 1e-4 if dtype == "float32" else 5e-2
    np.testing.assert_allclose(np.asarray(by_kernel, np.float32), np.asarray(by_xla, np.float32),
                               rtol=tol, atol=tol)


def test_the_f32_decode_program_copies_no_weight_slice():
    cfg = tiny_config()
    params = init_params(cfg, jax.random.PRNGKey(9))
    cache = init_cache(cfg, 1, 8)
    step = jax.jit(lambda p, t, pos, c: forward(cfg, p, t, pos, c).logits)
    text = step.lower(params, jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32),
                      cache).compile().as_text()
    shapes = {f"f32[{k},{n}]" for k, n in (leaf.shape[1:] for leaf in jax.tree.leaves(
        params["params"]["layers"]) if qmatmul_cpu.float_kernel_fits(leaf))}
    assert shapes
    sliced = [line for line in text.splitlines() if "dynamic-slice" in line
              and any(f" = {s}" in line or f"= {s}{{" in line for s in shapes)]
    assert not sliced, sliced[:3]
    # q / k / v and gate / up go in one call each: 4 calls a layer (o and down alone), and the
    # untied lm_head one more (outside the layer loop)
    assert not cfg.tie_word_embeddings
    assert text.count('custom_call_target="specjax_matmul_f32"') == 4 + 1


@settings(max_examples=25, deadline=None)
@given(layers=st.integers(1, 2), k=st.sampled_from([8, 32, 96]), n=st.integers(1, 70),
       m=st.integers(0, 14), dtype=st.sampled_from(["float32", "bfloat16"]), seed=st.integers(0, 2**16))
def test_rows_kernel_equals_reference(layers, k, n, m, dtype, seed):
    stack = jax.random.normal(jax.random.PRNGKey(seed), (layers, n, k), dtype)  # n: ragged units
    x = rows(seed, (m, k))
    for layer in range(layers):
        got = jax.jit(qmatmul_cpu.matmul_rows)(x, stack, layer)
        want = qmatmul_cpu.matmul_rows_reference(x, stack, layer)
        assert got.shape == (m, n) and got.dtype == jnp.float32
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(want), initial=1)))


def test_bad_rows_input_is_an_error():
    stack = jax.random.normal(jax.random.PRNGKey(6), (2, 40, 32), jnp.float32)
    with pytest.raises(ValueError, match="do not fit"):  # K not a multiple of 8
        qmatmul_cpu.matmul_rows(rows(6, (1, 12)), jnp.ones((1, 40, 12)), 0)
    with pytest.raises(ValueError, match="do not fit"):
        qmatmul_cpu.matmul_rows(rows(6, (1, 40)), stack, 0)
    with pytest.raises(jax.errors.JaxRuntimeError, match="layer index out of range"):
        jax.jit(qmatmul_cpu.matmul_rows)(rows(6, (1, 32)), stack, 2).block_until_ready()


@pytest.mark.parametrize("tied", [True, False])
def test_the_lm_head_goes_through_the_kernel_and_computes_xlas_logits(tied, monkeypatch):
    cfg = tiny_config(tie_word_embeddings=tied)
    params = init_params(cfg, jax.random.PRNGKey(10))
    tokens = jnp.asarray(np.random.default_rng(10).integers(0, cfg.vocab_size, (2, 5)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(5, dtype=jnp.int32), (2, 5))

    def step():
        return jax.jit(lambda p: forward(cfg, p, tokens, positions, init_cache(cfg, 2, 8)).logits)

    text = step().lower(params).compile().as_text()
    assert text.count('custom_call_target="specjax_matmul_rows_f32"') == (1 if tied else 0)
    by_kernel = step()(params)
    monkeypatch.setenv(qmatmul_cpu.ENV_SWITCH, "0")
    assert "specjax_matmul" not in step().lower(params).compile().as_text()
    np.testing.assert_allclose(by_kernel, step()(params), rtol=1e-4, atol=1e-4)


def test_a_group_call_computes_what_its_calls_compute_one_by_one():
    x = rows(10, (5, 64))
    int8 = [random_quantized(10 + i, 2, 64, n, mode) for i, (n, mode) in enumerate(
        [(48, "int8"), (16, "int8"), (32, "int4")])]
    pairs = [(packed_values(q), q.scale) for q in int8] + [(qmatmul_cpu.pack(int8[2].qvalue), int8[2].scale)]
    grouped = jax.jit(qmatmul_cpu.qmatmul_group)(x, pairs, 1)
    for (packed, scale), y in zip(pairs, grouped):
        np.testing.assert_array_equal(y, jax.jit(qmatmul_cpu.qmatmul)(x, packed, scale, 1))
    stacks = [jax.random.normal(jax.random.PRNGKey(i), (2, 64, n)) for i, n in enumerate((32, 96))]
    grouped = jax.jit(qmatmul_cpu.matmul_group)(x, stacks, 0)
    for stack, y in zip(stacks, grouped):
        np.testing.assert_array_equal(y, jax.jit(qmatmul_cpu.matmul)(x, stack, 0))
    with pytest.raises(ValueError, match="one dtype"):
        qmatmul_cpu.matmul_group(x, [stacks[0], stacks[1].astype(jnp.bfloat16)], 0)

    def loss(fn):
        return lambda a, ws: sum(jnp.sum(jnp.sin(y)) for y in fn(a, ws, 1))

    reference = lambda a, ws, layer: [qmatmul_cpu.matmul_reference(a, w, layer) for w in ws]
    got = jax.grad(loss(qmatmul_cpu.matmul_group), argnums=(0, 1))(x, stacks)
    want = jax.grad(loss(reference), argnums=(0, 1))(x, stacks)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4 * float(jnp.max(jnp.abs(w))))


def test_grouped_product_takes_kernels_of_one_kind_and_layer_only():
    stack = jax.random.normal(jax.random.PRNGKey(11), (2, 32, 16))
    q = random_quantized(11, 2, 32, 16, "int8")
    packed = quant.PackedKernel(qmatmul_cpu.pack(q.qvalue), q.scale, jnp.int32(1))
    index = jnp.int32(1)
    x = rows(11, (3, 32))
    same = quant.grouped_product(x, [quant.LayerKernel(stack, index), quant.LayerKernel(stack, index)])
    assert same is not None and len(same) == 2
    assert quant.grouped_product(x, [quant.LayerKernel(stack, index), packed]) is None  # two kinds
    assert quant.grouped_product(x, [quant.LayerKernel(stack, index),
                                     quant.LayerKernel(stack, jnp.int32(1))]) is None  # two indices
    assert quant.grouped_product(x, [stack[0], stack[1]]) is None  # plain arrays: Linear's path


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pack_params_packs_float_layer_kernels_and_the_logits_stay_bit_for_bit(dtype, monkeypatch):
    cfg = tiny_config(dtype=dtype)
    params = init_params(cfg, jax.random.PRNGKey(12))
    packed = quant.pack_params(params)
    other = {"params": {"extra": {"layers": {"kernel": jnp.ones((2, 32, 16), cfg.jnp_dtype)}}}}
    assert quant.pack_params(other) is other  # a float [L, K, N] kernel not in the layer stack
    held = jax.tree_util.tree_flatten_with_path(packed, is_leaf=quant.is_held)[0]
    blocked = {jax.tree_util.keystr(path) for path, leaf in held if isinstance(leaf, quant.BlockedKernel)}
    fitting = {jax.tree_util.keystr(path) for path, leaf in jax.tree_util.tree_flatten_with_path(
        params["params"]["layers"])[0] if qmatmul_cpu.float_kernel_fits(leaf)}
    assert blocked and blocked == {"['params']['layers']" + p for p in fitting}
    jax.tree.map(np.testing.assert_array_equal, quant.unpack_params(packed), params)
    tokens = jnp.asarray(np.random.default_rng(12).integers(0, cfg.vocab_size, (2, 5)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(5, dtype=jnp.int32), (2, 5))

    def step():  # traced anew: the switch is read at each trace
        return jax.jit(lambda p: forward(cfg, p, tokens, positions, init_cache(cfg, 2, 8)).logits)

    np.testing.assert_array_equal(step()(packed), step()(params))  # the same sums, another layout
    if dtype == "float32":
        text = step().lower(packed).compile().as_text()
        assert text.count('custom_call_target="specjax_matmul_blocks_f32"') == 4  # 4 calls a layer
        assert text.count('custom_call_target="specjax_matmul_f32"') == 1  # the untied lm_head
        q_packed, q_plain = (quant.quantize_params(p, "int8") for p in (packed, params))
        jax.tree.map(np.testing.assert_array_equal, q_packed, q_plain)
    monkeypatch.setenv(qmatmul_cpu.ENV_SWITCH, "0")  # packed params, kernels off: the reference
    assert quant.pack_params(params) is params
    assert "specjax_matmul" not in step().lower(packed).compile().as_text()
    tol = 1e-4 if dtype == "float32" else 5e-2
    np.testing.assert_allclose(np.asarray(step()(packed), np.float32), np.asarray(step()(params), np.float32),
                               rtol=tol, atol=tol)


def _live_cases(m: int) -> list[np.ndarray]:
    """Live flags for m rows: all live, all dead, a prefix per group of 3 (a verify's), ragged."""
    rng = np.random.default_rng(m)
    return [np.ones(m, bool), np.zeros(m, bool), np.arange(m) % 3 < 1, np.arange(m) % 3 < 2,
            rng.random(m) < 0.5]


@pytest.mark.parametrize("kind", ["int8", "int4", "f32", "bf16", "rows", "blocks", "int8 group"])
@pytest.mark.parametrize("m", [1, 6, 13])
def test_dead_rows_are_zeros_and_live_rows_what_every_row_computes(kind, m):
    """A row flagged dead gets zeros; a live row gets what the call without flags gives it, bit
    for bit, whatever the other rows' flags (ragged, all dead, all live), in every kernel kind."""
    x = rows(20, (m, 64))
    if kind.startswith("int"):
        mode = kind.split()[0]
        qs = [random_quantized(20 + i, 2, 64, n, mode) for i, n in enumerate((48, 32))]
        pairs = [(packed_values(q), q.scale) for q in qs][: 2 if "group" in kind else 1]
        call = lambda live: qmatmul_cpu.qmatmul_group(x, pairs, 1, live)
        references = [qmatmul_cpu.qmatmul_reference(x, p, s, 1) for p, s in pairs]
    else:
        dtype = jnp.bfloat16 if kind == "bf16" else jnp.float32
        shape = {"rows": (2, 40, 64), "blocks": (2, 3, 64, 16)}.get(kind, (2, 64, 48))
        stack = jax.random.normal(jax.random.PRNGKey(21), shape, dtype)
        kernel, reference = {
            "rows": (qmatmul_cpu.matmul_rows, qmatmul_cpu.matmul_rows_reference),
            "blocks": (qmatmul_cpu.matmul_blocks, qmatmul_cpu.matmul_blocks_reference),
        }.get(kind, (qmatmul_cpu.matmul, qmatmul_cpu.matmul_reference))
        call = lambda live: [kernel(x, stack, 1, live)]
        references = [reference(x, stack, 1)]
    every = jax.jit(call)(None)
    for live in _live_cases(m):
        got = jax.jit(call)(jnp.asarray(live))
        for y, full, ref in zip(got, every, references):
            np.testing.assert_array_equal(y, np.where(live[:, None], full, 0.0))
            want = qmatmul_cpu.with_dead_rows((ref,), qmatmul_cpu.live_flags(x, jnp.asarray(live)))[0]
            np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4 * float(jnp.max(jnp.abs(ref))))


def test_dead_rows_compose_with_vmap_and_grad_and_bad_flags_are_an_error():
    """live with vmap (rows batched, flags batched or not) and grad (a dead row's gradient is
    zero); flags that are not x's leading shape are a ValueError."""
    stack = jax.random.normal(jax.random.PRNGKey(22), (2, 32, 48), jnp.float32)
    x = rows(22, (4, 3, 32))
    live = jnp.asarray(np.arange(12).reshape(4, 3) % 3 < 2)
    every = qmatmul_cpu.matmul(x, stack, 1)
    mapped = jax.vmap(qmatmul_cpu.matmul, in_axes=(0, None, None, 0))(x, stack, 1, live)
    np.testing.assert_array_equal(mapped, jnp.where(live[..., None], every, 0.0))
    shared = jax.vmap(qmatmul_cpu.matmul, in_axes=(0, None, None, None))(x, stack, 1, live[0])
    np.testing.assert_array_equal(shared, jnp.where(live[0][None, :, None], every, 0.0))
    grad = jax.grad(lambda a: jnp.sum(jnp.sin(qmatmul_cpu.matmul(a, stack, 1, live))))(x)
    assert not np.any(np.asarray(grad)[~np.asarray(live)])
    want = jax.grad(lambda a: jnp.sum(jnp.sin(qmatmul_cpu.matmul_reference(a, stack, 1))))(x)
    np.testing.assert_allclose(np.asarray(grad)[np.asarray(live)], np.asarray(want)[np.asarray(live)],
                               rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="leading shape"):
        qmatmul_cpu.matmul(x, stack, 1, live[0])
