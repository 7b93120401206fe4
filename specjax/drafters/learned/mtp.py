"""MTP (DeepSeek-style multi-token prediction) and Medusa heads on a frozen target.

MTP: one module, reused cyclically for every draft depth. For the entry at position t with
feature h_t (the target's last-layer output, or the module's own previous output) and the
next token x_{t+1}:

    x   = eh_proj([enorm(embed(x_{t+1})); hnorm(h_t)])            `[B, T, 2H] -> [B, T, H]`
    o_t = decoder_layer(x)                                         `[B, T, H]`
    logits = target_lm_head(shared_norm(o_t))  -> predicts x_{t+2}

It follows the same cell protocol as EAGLE-3 (`features`, `cell_qkv`, `cell_finish`, `logits`)
so drafting and the training-time-test unroll are shared (`drafters/eagle3.py`,
`heads.ttt_unroll`); the loss is a per-depth hard cross-entropy (`losses.mtp_loss`).

Medusa: K independent heads on the target's final (normalised) hidden state h_t; head k is
`num_layers` residual blocks x + SiLU(W x + b) (zero-initialised, so an untrained head
repeats the target's own next-token distribution) followed by the target's LM head, and
predicts x_{t+k+2}.
"""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from specjax.models.config import ModelConfig
from specjax.models.eagle3 import init_sequential
from specjax.models.heads import HeadLayer, TargetView, attention, causal, layer_config
from specjax.models.llama import RMSNorm, _dense


@dataclasses.dataclass(frozen=True)
class MTPConfig:
    """target: the frozen target; layer: the module's decoder layer dims (the target's);
    ttt_steps: depths unrolled in training; loss_decay: weight of depth k is decay ** k."""

    target: ModelConfig
    layer: ModelConfig
    ttt_steps: int = 4
    loss_decay: float = 1.0
    kind: str = "mtp"

    @classmethod
    def for_target(cls, target: ModelConfig, **kwargs) -> MTPConfig:
        return cls(target=target, layer=layer_config(target), **kwargs)

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return (self.target.num_layers - 1,)


class MTPModel(nn.Module):
    cfg: MTPConfig

    def setup(self):
        c = self.cfg.layer
        dtype = c.jnp_dtype
        self.enorm = RMSNorm(c.rms_norm_eps, dtype)
        self.hnorm = RMSNorm(c.rms_norm_eps, dtype)
        self.eh_proj = _dense(c.hidden_size, "eh_proj", dtype)
        self.input_layernorm = RMSNorm(c.rms_norm_eps, dtype)
        self.layer = HeadLayer(c)
        self.shared_norm = RMSNorm(c.rms_norm_eps, dtype)

    def features(self, layer_hidden):
        """The target's last-layer output `[B, T, H]` (pre final norm) is the depth-0 feature."""
        return layer_hidden[0]

    def cell_qkv(self, feature, emb, positions):
        x = self.eh_proj(jnp.concatenate([self.enorm(emb), self.hnorm(feature)], axis=-1))
        q, k, v = self.layer.qkv(self.input_layernorm(x), positions)
        return q, k, v, x

    def cell_finish(self, attn, residual):
        return self.layer.finish(attn, residual)

    def logits(self, out, parts):
        """out `[..., H]` -> f32 target-vocabulary logits through the target's LM head."""
        return TargetView(self.cfg.target).logits(parts, self.shared_norm(out))

    def __call__(self, layer_hidden, emb, positions):
        q, k, v, res = self.cell_qkv(self.features(layer_hidden), emb, positions)
        out = self.cell_finish(attention(q, [(k, v, causal(emb.shape[1]))]), res)
        return self.shared_norm(out)


@dataclasses.dataclass(frozen=True)
class MedusaConfig:
    target: ModelConfig
    num_heads: int = 4
    num_layers: int = 1
    loss_decay: float = 0.8
    kind: str = "medusa"

    @classmethod
    def for_target(cls, target: ModelConfig, **kwargs) -> MedusaConfig:
        return cls(target=target, **kwargs)

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return ()  # reads ForwardOutput.hidden (the final normalised hidden state)


class MedusaModel(nn.Module):
    cfg: MedusaConfig

    @nn.compact
    def __call__(self, hidden: jax.Array) -> jax.Array:
        """hidden `[..., H]` -> `[K, ..., H]`, head k's input to the target's LM head."""
        c = self.cfg
        dtype = c.target.jnp_dtype
        outs = []
        for k in range(c.num_heads):
            x = hidden
            for j in range(c.num_layers):
                dense = nn.Dense(hidden.shape[-1], use_bias=True, dtype=dtype, param_dtype=dtype,
                                 kernel_init=nn.initializers.zeros, name=f"head_{k}_{j}")
                x = x + nn.silu(dense(x))
            outs.append(x)
        return jnp.stack(outs)


def init_mtp_family(cfg, key: jax.Array):
    """Random variables `{"params", "consts"}` of an MTP or Medusa head."""
    if cfg.kind == "mtp":
        return init_sequential(MTPModel(cfg), cfg, key)
    hidden = jnp.zeros((1, cfg.target.hidden_size), cfg.target.jnp_dtype)
    return {**MedusaModel(cfg).init(key, hidden), "consts": {}}
