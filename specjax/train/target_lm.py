"""Training a small Llama-family target from scratch (or fine-tuning one) on token windows with
optax, and saving it as a Hugging Face folder the normal loaders open (`load_model(DIR)`,
`specjax generate --model DIR`, `specjax train-drafter --model DIR`).

This is what makes a *learnable* setting for the drafters: a target whose continuations are
largely determined by its context (`specjax.train.synthetic`), trained here in minutes on a CPU.

    cfg = synthetic_target_config()
    params, log = train_lm(cfg, init_params(cfg, key), windows, LMConfig(steps=600))
    save_hf(folder, cfg, params)          # config.json + model.safetensors
    synthetic.write_tokenizer(folder)     # tokenizer.json + tokenizer_config.json
"""
from __future__ import annotations

import dataclasses
import functools
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from specjax.models.cache import init_cache
from specjax.models.checkpoint import params_to_hf
from specjax.models.config import ModelConfig
from specjax.models.llama import forward
from specjax.train.trainer import adamw_cosine


@dataclasses.dataclass(frozen=True)
class LMConfig:
    steps: int
    batch_size: int = 32
    learning_rate: float = 3e-3
    warmup_steps: int = 50
    end_lr_ratio: float = 0.05
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0
    log_every: int = 50


def synthetic_target_config(vocab_size: int, name: str = "synthetic-target", *, hidden: int = 128,
                            layers: int = 4, heads: int = 4, kv_heads: int = 2) -> ModelConfig:
    """A small Llama config for the synthetic corpus (pad 0, bos 1, eos 2)."""
    return ModelConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=3 * hidden,
                       num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
                       head_dim=hidden // heads, rope_theta=10000.0, tie_word_embeddings=False,
                       max_position_embeddings=1024, bos_token_id=1, eos_token_ids=(2,),
                       pad_token_id=0, name=name)


def lm_loss(cfg: ModelConfig, params, tokens: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy over windows `[B, T]` (every position but the last)."""
    batch, seq = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
    logits = forward(cfg, params, tokens, positions, init_cache(cfg, batch, seq)).logits
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), -1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))


def make_optimizer(lc: LMConfig) -> optax.GradientTransformation:
    return adamw_cosine(lc.learning_rate, min(lc.warmup_steps, max(lc.steps - 1, 1)),
                        max(lc.steps, lc.warmup_steps + 1), lc.end_lr_ratio, lc.weight_decay,
                        lc.grad_clip)


@functools.partial(jax.jit, static_argnames=("cfg", "lc"))
def lm_step(cfg: ModelConfig, lc: LMConfig, params, opt_state, tokens):
    loss, grads = jax.value_and_grad(functools.partial(lm_loss, cfg))(params, tokens)
    updates, opt_state = make_optimizer(lc).update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def train_lm(cfg: ModelConfig, params, windows: np.ndarray, lc: LMConfig,
             on_log=None) -> tuple[dict, list[dict]]:
    """Trains (or fine-tunes) params on random batches of windows `[N, T]` for lc.steps steps
    -> (params, log rows {"step", "loss", "tokens", "elapsed_s"}). Batches are a pure function of
    (seed, step)."""
    opt_state = make_optimizer(lc).init(params)
    rng = np.random.default_rng(lc.seed)
    log, start = [], time.perf_counter()
    for step in range(lc.steps):
        idx = rng.integers(0, len(windows), size=lc.batch_size)
        params, opt_state, loss = lm_step(cfg, lc, params, opt_state, jnp.asarray(windows[idx]))
        if (step + 1) % lc.log_every == 0 or step + 1 == lc.steps:
            row = {"step": step + 1, "loss": float(loss),
                   "tokens": (step + 1) * lc.batch_size * windows.shape[1],
                   "elapsed_s": round(time.perf_counter() - start, 2)}
            log.append(row)
            if on_log is not None:
                on_log(row)
    return params, log


def eval_loss(cfg: ModelConfig, params, windows: np.ndarray, batch_size: int = 64) -> float:
    """Mean next-token cross-entropy (nats) over windows `[N, T]`."""
    fn = jax.jit(functools.partial(lm_loss, cfg))
    losses = [float(fn(params, jnp.asarray(windows[i:i + batch_size])))
              for i in range(0, len(windows) - batch_size + 1, batch_size)]
    return float(np.mean(losses))


def hf_config(cfg: ModelConfig) -> dict:
    """config.json of a Llama-family config (what `models.hf_loader.config_from_hf` reads)."""
    if cfg.attention_bias or cfg.qk_norm or cfg.rope_scaling is not None:
        raise ValueError("save_hf writes plain Llama configs (no biases, q/k norm or rope scaling)")
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "_name_or_path": cfg.name,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
        "bos_token_id": cfg.bos_token_id, "eos_token_id": list(cfg.eos_token_ids),
        "pad_token_id": cfg.pad_token_id, "torch_dtype": "float32",
    }


def save_hf(folder: str | Path, cfg: ModelConfig, params) -> Path:
    """config.json + model.safetensors (f32) of a Llama target; add a tokenizer to make it a
    folder `load_model` opens."""
    from safetensors.numpy import save_file  # only saving needs it

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf_config(cfg), indent=1), encoding="utf-8")
    tensors = {k: np.asarray(v, np.float32) for k, v in params_to_hf(cfg, params).items()}
    save_file(tensors, str(folder / "model.safetensors"))
    return folder
