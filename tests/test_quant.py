"""Weight-only quantization (`specjax.models.quant`, qwix) on a tiny random target.

- quantize -> dequantize error is bounded per mode (int8 / int4: half a step of each
  channel's / block's scale; fp8 e4m3: 2^-4 relative plus the subnormal step).
- The params tree keeps its shape: layer kernels become QArrays, everything else is untouched.
- Quantized logits stay close to the f32 model's (a relative tolerance per mode).
- Greedy speculative output equals greedy plain decoding of the SAME quantized target, token
  for token: int8 with every drafter kind (ngram, suffix, draft model, layerskip, the five
  learned heads) on a tree, three of them on a chain; int4 and fp8 with a draft model and
  EAGLE-3 (a quantized drafter and a head reading quantized hidden states); a draft model
  follows the target's quantization.
- Unknown modes and a backend that cannot run fp8 are one-line errors before any load; the
  CLI refuses a bad --quantize before any model loads.
- Sharding specs cover the values and scales of quantized kernels.
- GGUF Q8_0 / Q4_0 kernels load straight into int8 / int4 QArrays equal to quantize(dequantize(x))
  at the file's scales; Q4_1 goes through floats and qwix.
"""
from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix
from helpers import Q, tiny_config, write_gguf
from jax.sharding import PartitionSpec as P
from qwix._src.core.qarray import quantize_with_scale_zero_point
from test_cli_errors import _forbid_model_loads, run_cli

import specjax.models.quant as quant
from specjax.api import generate_ids
from specjax.drafters.learned.drafting import drafter_params
from specjax.drafters.learned.registry import init_head, make_head_config, make_learned_drafter
from specjax.drafters.registry import make_drafter
from specjax.models.cache import init_cache
from specjax.models.hub import load_model
from specjax.models.llama import forward, init_params
from specjax.models.load import load_checkpoint
from specjax.models.quant import quantization_of, quantize_kernel, quantize_params
from specjax.sharding import partition_specs
from specjax.tree import chain, k_ary

CFG = tiny_config(vocab_size=16)
PROMPTS = ((3, 4, 5, 6, 3, 4, 5, 6, 3, 4), (7, 8, 9, 7, 8, 9, 7), (2,), (5, 5, 5, 5, 5, 11, 12))
MAX_NEW = 14
TREES = {"chain": chain(3), "tree": k_ary((2, 2, 1), max_nodes=7)}
HEADS = {
    "eagle3": {"ttt_steps": 3}, "mtp": {"ttt_steps": 3}, "medusa": {"num_heads": 3},
    "dflash": {"block_size": 4, "num_anchors": 8}, "dspark": {"block_size": 4, "num_anchors": 8},
}
DRAFTERS = ("ngram", "suffix", "model:noisy", "layerskip:1", *HEADS)


@functools.cache
def f32_params():
    return init_params(CFG, jax.random.PRNGKey(0))


@functools.cache
def params(mode: str):
    return quantize_params(f32_params(), mode)


# ---- quantize / dequantize ------------------------------------------------------------------


@pytest.mark.parametrize("mode", quant.QUANT_MODES)
def test_round_trip_error_is_bounded(mode):
    kernel = jax.random.normal(jax.random.PRNGKey(1), (3, 64, 48), jnp.float32)  # [L, in, out]
    q = quantize_kernel(kernel, quant.SPECS[mode])
    err = jnp.abs(qwix.dequantize(q) - kernel)
    step = jnp.repeat(q.scale, kernel.shape[1] // q.scale.shape[1], axis=1)  # scale per value
    if mode == "fp8":
        assert q.scale.shape == (3, 1, 48)
        assert bool(jnp.all(err <= 2.0**-4 * jnp.abs(kernel) + 2.0**-9 * step))
    else:
        assert q.scale.shape == ((3, 1, 48) if mode == "int8" else (3, 2, 48))
        assert bool(jnp.all(err <= 0.5 * step * (1 + 1e-4)))  # f32 rounding of x / scale
    assert float(jnp.max(err)) > 0  # it did quantize


def test_the_params_tree_keeps_its_shape():
    f32, q = f32_params(), params("int8")
    assert quantization_of(f32) is None and quantization_of(q) == "int8"
    kernel = q["params"]["layers"]["mlp"]["down_proj"]["kernel"]
    assert isinstance(kernel, qwix.QArray) and kernel.qvalue.dtype == jnp.int8
    assert kernel.qvalue.shape == f32["params"]["layers"]["mlp"]["down_proj"]["kernel"].shape
    for name in ("embed_tokens", "lm_head", "norm"):
        assert all(a is b for a, b in zip(jax.tree.leaves(q["params"][name]),
                                          jax.tree.leaves(f32["params"][name])))
    again = quantize_params(q, "int8")  # already quantized kernels stay
    assert all(a is b for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(q)))


@pytest.mark.parametrize("mode, tolerance", [("int8", 0.02), ("int4", 0.2), ("fp8", 0.1)])
def test_logits_are_close_to_f32(mode, tolerance):
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 9)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), (2, 9))

    def logits(p):
        return forward(CFG, p, tokens, positions, init_cache(CFG, 2, 16)).logits

    exact, approx = logits(f32_params()), logits(params(mode))
    relative = float(jnp.linalg.norm(approx - exact) / jnp.linalg.norm(exact))
    assert 0 < relative < tolerance


# ---- exactness within the quantized model ---------------------------------------------------


def loader(name: str, dtype: str):
    """`model:noisy`: an f32 model near the target (quantized by the registry like it)."""
    leaves, treedef = jax.tree.flatten(f32_params())
    keys = jax.random.split(jax.random.PRNGKey(5), len(leaves))
    noisy = jax.tree.unflatten(treedef, [x + 0.005 * jax.random.normal(k, x.shape, x.dtype)
                                         for x, k in zip(leaves, keys)])
    return types.SimpleNamespace(cfg=CFG, params=noisy, tokenizer=None)


@functools.cache
def drafter(spec: str, tree_name: str, mode: str):
    tree = TREES[tree_name]
    if spec in HEADS:
        head = make_head_config(spec, CFG, **HEADS[spec])
        variables = init_head(head, jax.random.PRNGKey(1))
        return make_learned_drafter(head, tree), drafter_params(variables, params(mode), head)
    return make_drafter(spec, tree=tree, target_cfg=CFG, target_params=params(mode), loader=loader)


def run(mode: str, draft=None):
    d, d_params = draft if draft is not None else (None, None)
    out = generate_ids(CFG, params(mode), [list(p) for p in PROMPTS], max_new_tokens=MAX_NEW,
                       batch_size=4, draft=d, drafter_params=d_params)
    return [(r.token_ids, r.stop_reason) for r in out]


@functools.cache
def plain(mode: str):
    return run(mode)


@pytest.mark.parametrize("spec", DRAFTERS)
def test_greedy_speculative_equals_plain_greedy_of_the_int8_target(spec):
    assert run("int8", drafter(spec, "tree", "int8")) == plain("int8")


@pytest.mark.parametrize("spec", ["ngram", "model:noisy", "layerskip:1"])
def test_greedy_chains_equal_plain_greedy_of_the_int8_target(spec):
    assert run("int8", drafter(spec, "chain", "int8")) == plain("int8")


@pytest.mark.parametrize("mode", ["int4", "fp8"])
@pytest.mark.parametrize("spec", ["model:noisy", "eagle3"])
def test_greedy_speculative_equals_plain_greedy_of_int4_and_fp8_targets(spec, mode):
    assert run(mode, drafter(spec, "tree", mode)) == plain(mode)


def test_a_draft_model_follows_the_target_quantization():
    _, d_params = drafter("model:noisy", "chain", "int4")
    assert quantization_of(d_params) == "int4"


# ---- errors -------------------------------------------------------------------------------


def test_an_unknown_mode_is_one_line():
    with pytest.raises(ValueError, match=r"unknown quantization 'int3': use int8, int4, fp8"):
        quant.check_quantize("int3")


def test_fp8_without_backend_support_is_an_error_before_the_load(monkeypatch, tmp_path):
    monkeypatch.setattr(quant, "backend_supports", lambda name: name != "fp8")
    with pytest.raises(ValueError, match=r"quantize='fp8' is not supported by the \w+ backend"):
        load_model(tmp_path / "missing.gguf", quantize="fp8")  # refused before the file is read


def test_int4_needs_whole_blocks():
    with pytest.raises(ValueError, match=r"int4 needs the input size of w \(48\) to be a multiple of 32"):
        quantize_kernel(jnp.ones((48, 8)), quant.SPECS["int4"], "w")


def test_the_cli_checks_quantize_before_any_load(monkeypatch, capsys):
    _forbid_model_loads(monkeypatch)
    assert run_cli(["generate", "--prompt", "hi", "--quantize", "int3"]) == 2
    assert "--quantize: invalid choice: 'int3'" in capsys.readouterr().err


def test_sharding_specs_cover_quantized_kernels():
    specs = partition_specs(params("int4"), tp=2)["params"]["layers"]
    assert specs["mlp"]["up_proj"]["kernel"].qvalue == P(None, None, "tp")
    assert specs["mlp"]["up_proj"]["kernel"].scale == P(None, None, "tp")
    assert specs["mlp"]["down_proj"]["kernel"].qvalue == P(None, "tp", None)
    assert specs["mlp"]["down_proj"]["kernel"].scale == P(None, "tp", None)  # 2 blocks / 2
    assert specs["self_attn"]["o_proj"]["kernel"].scale == P(None, None, None)  # 1 block


# ---- GGUF blocks straight to QArrays ----------------------------------------------------------

GGUF_CFG = tiny_config(vocab_size=64)  # every kernel's input size is a multiple of 32


@pytest.mark.parametrize("qtype, mode", [(Q.Q8_0, "int8"), (Q.Q4_0, "int4")])
def test_gguf_blocks_load_as_qarrays_equal_to_quantize_of_dequantize(qtype, mode, tmp_path):
    """Q8_0 / Q4_0 kernels become QArrays without a float detour; each equals qwix's quantize of
    the dequantized tensor at the file's block scales, and dequantizes to exactly what the
    file's dequantizer gives."""
    source = init_params(GGUF_CFG, jax.random.PRNGKey(3))
    expected = write_gguf(tmp_path / "m.gguf", GGUF_CFG, source, qtype)
    _, loaded = load_checkpoint(tmp_path / "m.gguf", quantize=mode)
    _, floats = load_checkpoint(tmp_path / "m.gguf")
    assert quantization_of(loaded) == mode
    for name in ("self_attn", "q_proj"), ("self_attn", "k_proj"), ("mlp", "down_proj"):
        kernel = loaded["params"]["layers"][name[0]][name[1]]["kernel"]
        assert kernel.qvalue.dtype == quant.SPECS[mode].qtype
        assert kernel.scale.shape[1] == kernel.shape[1] // 32  # the file's blocks
        dequantized = floats["params"]["layers"][name[0]][name[1]]["kernel"]
        requantized = quantize_with_scale_zero_point(dequantized, kernel.qtype, kernel.scale, None)
        np.testing.assert_array_equal(np.asarray(requantized.qvalue, np.int8),
                                      np.asarray(kernel.qvalue, np.int8))
        np.testing.assert_array_equal(qwix.dequantize(kernel), dequantized)
    hf_name = "model.layers.1.self_attn.k_proj.weight"  # q/k rows un-permuted like the floats
    np.testing.assert_array_equal(
        np.asarray(qwix.dequantize(loaded["params"]["layers"]["self_attn"]["k_proj"]["kernel"]))[1].T,
        expected[hf_name])


def test_other_gguf_block_types_are_quantized_by_qwix(tmp_path):
    """Q4_1 (the shipped SmolLM2 file's type: a float offset per block, which a QArray's integer
    zero point cannot hold) is dequantized, then quantized by qwix."""
    source = init_params(GGUF_CFG, jax.random.PRNGKey(3))
    write_gguf(tmp_path / "m.gguf", GGUF_CFG, source, Q.Q4_1)
    _, loaded = load_checkpoint(tmp_path / "m.gguf", quantize="int4")
    _, floats = load_checkpoint(tmp_path / "m.gguf")
    kernel = loaded["params"]["layers"]["mlp"]["up_proj"]["kernel"]
    expected = quantize_kernel(floats["params"]["layers"]["mlp"]["up_proj"]["kernel"],
                               quant.SPECS["int4"])
    np.testing.assert_array_equal(np.asarray(kernel.qvalue, np.int8),
                                  np.asarray(expected.qvalue, np.int8))
    np.testing.assert_array_equal(kernel.scale, expected.scale)
