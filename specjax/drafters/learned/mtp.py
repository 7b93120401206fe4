"""MTP (DeepSeek-style multi-token prediction) head on a frozen target.

One module, reused cyclically for every draft depth. For the entry at position t with
feature h_t (the target's last-layer output, or the module's own previous output) and the
next token x_{t+1}:

    x   = eh_proj([enorm(embed(x_{t+1})); hnorm(h_t)])            `[B, T, 2H] -> [B, T, H]`
    o_t = decoder_layer(x)                                         `[B, T, H]`
    logits = target_lm_head(shared_norm(o_t))  -> predicts x_{t+2}

It follows the same cell protocol as EAGLE-3 (`features`, `cell_qkv`, `cell_finish`, `logits`)
so drafting and the training-time-test unroll are shared (`sequential.py`). Loss (`mtp_loss`):
the same unroll, hard cross-entropy per depth on the data tokens (the target's own greedy
outputs), weights loss_decay ** k.
"""
from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from specjax.drafters.learned.blocks import (
    HeadLayer,
    TargetView,
    attention,
    causal,
    layer_config,
    output_norm_from_target,
)
from specjax.drafters.learned.kind import HeadKind, HeadOption
from specjax.drafters.learned.objectives import decayed_sum, depth_losses
from specjax.drafters.learned.sequential import SequentialDrafter, init_sequential, training_unroll
from specjax.models.config import ModelConfig
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


def init_mtp(cfg: MTPConfig, key: jax.Array, consts: dict | None = None):
    """Random MTP head variables."""
    return init_sequential(MTPModel(cfg), cfg, key, consts)


def mtp_loss(head_cfg: MTPConfig, variables, parts, tout, batch, key):
    del key
    model = MTPModel(head_cfg)
    outs = training_unroll(model, head_cfg, variables, parts, tout, batch)
    logits = (model.apply(variables, out, parts, method="logits") for out in outs)  # [B, T, V]
    losses, metrics = depth_losses(logits, batch)
    return decayed_sum(losses, head_cfg.loss_decay), metrics


@dataclasses.dataclass(frozen=True)
class MTPDrafter(SequentialDrafter):
    module_class = MTPModel


KIND = HeadKind(
    name="mtp",
    summary="MTP (DeepSeek-style): one decoder layer reused for every draft depth",
    config=MTPConfig,
    model=MTPModel,
    init=init_mtp,
    loss=mtp_loss,
    drafter=MTPDrafter,
    options=(HeadOption("depth", "ttt_steps", 1, "training-time-test steps"),),
    init_from_target=functools.partial(output_norm_from_target, "shared_norm"),
)
