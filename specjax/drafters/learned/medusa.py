"""Medusa: K independent heads on the target's final hidden state, drafting every depth at once.

Head k is `num_layers` residual blocks x + SiLU(W x + b) on the target's final (normalised)
hidden state h_t (zero-initialised, so an untrained head repeats the target's own next-token
distribution), followed by the target's LM head; it predicts x_{t+k+2}.

Loss (`medusa_loss`): head k on the target's final hidden at t, hard cross-entropy against the
data token t+k+2, weights loss_decay ** k.

Drafting: the state is the target's final hidden state at the last accepted verify row (the
row that produced the root). Head k maps it to the distribution of the token k + 1 places after
the root, so one head call drafts every depth at once; depth d of the tree takes head d - 1's
candidates whatever the parent (Medusa's "choices" trees).
"""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct

from specjax.drafters.learned.blocks import TargetView
from specjax.drafters.learned.drafting import (
    HeadDrafter,
    accepted_rows,
    draft_levels,
    make_draft,
)
from specjax.drafters.learned.kind import HeadKind, HeadOption
from specjax.drafters.learned.objectives import decayed_sum, depth_losses
from specjax.gather import take_rows
from specjax.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class MedusaConfig:
    """num_heads: K (the deepest draft); num_layers: residual blocks per head; loss_decay: the
    weight of head k is decay ** k."""

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


def init_medusa(cfg: MedusaConfig, key: jax.Array, consts: dict | None = None):
    """Random Medusa head variables (no consts)."""
    hidden = jnp.zeros((1, cfg.target.hidden_size), cfg.target.jnp_dtype)
    return {**MedusaModel(cfg).init(key, hidden), "consts": dict(consts or {})}


def medusa_loss(head_cfg: MedusaConfig, variables, parts, tout, batch, key):
    del key
    outs = MedusaModel(head_cfg).apply(variables, tout.hidden)  # [K, B, T, H]
    view = TargetView(head_cfg.target)
    logits = (view.logits(parts, outs[k]) for k in range(head_cfg.num_heads))  # [B, T, V]
    losses, metrics = depth_losses(logits, batch)
    return decayed_sum(losses, head_cfg.loss_decay), metrics


@struct.dataclass
class MedusaState:
    hidden: jax.Array  # [B, H] target final hidden state of the root's predecessor


@dataclasses.dataclass(frozen=True)
class MedusaDrafter(HeadDrafter):
    module_class = MedusaModel

    @property
    def deepest_draft(self) -> int:
        return self.head.num_heads

    def init(self, params, batch_size: int, width: int) -> MedusaState:
        t = self.head.target
        return MedusaState(hidden=jnp.zeros((batch_size, t.hidden_size), t.jnp_dtype))

    def prefill(self, params, state, decode, target_out):
        return MedusaState(hidden=take_rows(target_out.hidden, decode.prompt_lens - 1))

    def update(self, params, state, decode, result, target_out):
        rows = accepted_rows(target_out.hidden, result)
        return MedusaState(hidden=take_rows(rows, result.num_accepted))

    def propose(self, params, state: MedusaState, decode, key, sampling):
        outs = self._call(params, None, state.hidden)  # [K, B, H]
        logits = self.view.logits(params["target"], outs)  # [K, B, V]

        def expand(level, tokens, carry):
            return logits[level + 1][:, None], carry

        tokens, valid, probs, _, _ = draft_levels(self.tree, logits[0][:, None], expand, (), key,
                                                  sampling)
        return make_draft(tokens, valid, probs), state


KIND = HeadKind(
    name="medusa",
    summary="Medusa: K residual heads on the target's last hidden state, all depths in one call",
    config=MedusaConfig,
    model=MedusaModel,
    init=init_medusa,
    loss=medusa_loss,
    drafter=MedusaDrafter,
    options=(HeadOption("depth", "num_heads", 1, "heads (= the deepest draft)"),),
)
