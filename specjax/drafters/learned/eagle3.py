"""EAGLE-3 draft head: fused low/mid/high target features + one decoder layer + a (reduced) LM head.

Data flow for the draft entry at position t (inference and training alike):

    feature f_t = fc([h_low; h_mid; h_high]_t)          `[B, T, 3H] -> [B, T, H]`   (target)
             or  the head's own output at the previous draft step               (drafting)
    a_t      = [input_layernorm(embed(x_{t+1})); hidden_norm(f_t)]   `[B, T, 2H]`
    o_t      = layer(a_t, residual f_t)                              `[B, T, H]`
    logits   = lm_head(norm(o_t))  over the draft vocabulary Vd -> predicts x_{t+2}

The draft vocabulary is the Vd most frequent target tokens of the training data;
`consts/draft_to_target` `[Vd]` int32 maps draft ids to target ids (identity when Vd = V).
The embedding is the target's (frozen). Sequential heads share this *cell* protocol with MTP
(`models/mtp.py`): `features`, `cell_qkv`, `cell_finish`, `draft_logits`, `logits`.
"""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from specjax.models.config import ModelConfig
from specjax.models.heads import HeadLayer, attention, causal, layer_config
from specjax.models.llama import RMSNorm, _dense

NEG_INF = -jnp.inf


def eagle3_feature_layers(num_target_layers: int) -> tuple[int, int, int]:
    """Low, middle and high target layers (outputs of layers 1, L/2 - 1, L - 4 as upstream),
    clamped into [0, L - 1] for tiny targets."""
    last = num_target_layers - 1
    pick = lambda i: min(max(i, 0), last)
    return (pick(1), pick(num_target_layers // 2 - 1), pick(num_target_layers - 4))


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """Static description of an EAGLE-3 head for one target.

    layer: dimensions of the draft decoder layer (the target's by default).
    feature_layers: the three target layers whose outputs are fused.
    draft_vocab_size: Vd (= target vocab: no reduction).
    ttt_steps / loss_decay: training-time-test unroll length and per-step loss weight decay.
    """

    target: ModelConfig
    layer: ModelConfig
    feature_layers: tuple[int, ...]
    draft_vocab_size: int
    ttt_steps: int = 4
    loss_decay: float = 0.8
    kind: str = "eagle3"

    @classmethod
    def for_target(cls, target: ModelConfig, draft_vocab_size: int | None = None,
                   feature_layers: tuple[int, ...] | None = None, **kwargs) -> Eagle3Config:
        return cls(
            target=target,
            layer=layer_config(target),
            feature_layers=tuple(feature_layers or eagle3_feature_layers(target.num_layers)),
            draft_vocab_size=int(draft_vocab_size or target.vocab_size),
            **kwargs,
        )

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """Target layers the head reads (`ForwardOutput.layer_hidden`)."""
        return self.feature_layers

    @property
    def reduced_vocab(self) -> bool:
        return self.draft_vocab_size != self.target.vocab_size


class Eagle3Model(nn.Module):
    cfg: Eagle3Config

    def setup(self):
        c = self.cfg.layer
        dtype = c.jnp_dtype
        self.fc = _dense(c.hidden_size, "fc", dtype)
        self.input_layernorm = RMSNorm(c.rms_norm_eps, dtype)
        self.hidden_norm = RMSNorm(c.rms_norm_eps, dtype)
        self.layer = HeadLayer(c)
        self.norm = RMSNorm(c.rms_norm_eps, dtype)
        self.lm_head = _dense(self.cfg.draft_vocab_size, "lm_head", dtype)
        self.draft_to_target = self.variable(
            "consts", "draft_to_target",
            lambda: jnp.arange(self.cfg.draft_vocab_size, dtype=jnp.int32),
        )

    def features(self, layer_hidden: tuple[jax.Array, ...]) -> jax.Array:
        """Target hidden states of the feature layers (each `[B, T, H]`) -> f `[B, T, H]`."""
        return self.fc(jnp.concatenate(layer_hidden, axis=-1))

    def cell_qkv(self, feature, emb, positions):
        """feature `[B, T, H]`, emb `[B, T, H]` of the next tokens -> (q, k, v, residual)."""
        a = jnp.concatenate([self.input_layernorm(emb), self.hidden_norm(feature)], axis=-1)
        q, k, v = self.layer.qkv(a, positions)
        return q, k, v, feature

    def cell_finish(self, attn, residual):
        return self.layer.finish(attn, residual)

    def draft_logits(self, out, parts=None):
        """out `[..., H]` -> f32 logits over the draft vocabulary `[..., Vd]`."""
        del parts
        return self.lm_head(self.norm(out)).astype(jnp.float32)

    def logits(self, out, parts=None):
        """out `[..., H]` -> f32 logits over the target vocabulary `[..., V]` (-inf outside the
        draft vocabulary)."""
        small = self.draft_logits(out)
        if not self.cfg.reduced_vocab:
            return small
        full = jnp.full(small.shape[:-1] + (self.cfg.target.vocab_size,), NEG_INF, jnp.float32)
        return full.at[..., self.draft_to_target.value].set(small)

    def __call__(self, layer_hidden, emb, positions):
        """Creates every param: one step over T entries (causal self-attention)."""
        q, k, v, res = self.cell_qkv(self.features(layer_hidden), emb, positions)
        out = self.cell_finish(attention(q, [(k, v, causal(emb.shape[1]))]), res)
        return self.logits(out)


def init_sequential(model: nn.Module, cfg, key: jax.Array, consts: dict | None = None):
    """Variables `{"params", "consts"}` of a sequential head (EAGLE-3 or MTP) with random params.

    consts: optional overrides of the "consts" collection (e.g. draft_to_target).
    """
    t = cfg.target
    hidden = jnp.zeros((1, 1, t.hidden_size), t.jnp_dtype)
    layer_hidden = tuple(hidden for _ in cfg.hidden_layers)
    positions = jnp.zeros((1, 1), jnp.int32)
    variables = model.init(key, layer_hidden, hidden, positions)
    variables = dict(variables)
    variables.setdefault("consts", {})
    if consts:
        variables["consts"] = {**variables["consts"], **consts}
    return variables


def init_eagle3(cfg: Eagle3Config, key: jax.Array, draft_to_target=None):
    """Random EAGLE-3 head variables; draft_to_target `[Vd]` target ids (sorted) when reduced."""
    consts = None
    if draft_to_target is not None:
        ids = jnp.asarray(draft_to_target, jnp.int32)
        if ids.shape != (cfg.draft_vocab_size,):
            raise ValueError(f"draft_to_target has shape {ids.shape}, want ({cfg.draft_vocab_size},)")
        consts = {"draft_to_target": ids}
    return init_sequential(Eagle3Model(cfg), cfg, key, consts)
