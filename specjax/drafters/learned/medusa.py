"""MTP and Medusa drafting.

MTP drafts exactly like EAGLE-3 (its module follows the same cell protocol; see
`drafters/eagle3.py`): `make_learned_drafter(MTPConfig, tree)` gives a SequentialDrafter.

Medusa: the state is the target's final hidden state at the last accepted verify row (the
row that produced the root). Head k maps it to the distribution of the token k + 1 places after
the root, so one head call drafts every depth at once; depth d of the tree takes head d - 1's
candidates whatever the parent (Medusa's "choices" trees).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from specjax.drafters.base import Drafter
from specjax.drafters.learned import (
    accepted_rows,
    check_head_target,
    draft_levels,
    make_draft,
    take_rows,
)
from specjax.models.heads import TargetView
from specjax.models.mtp import MedusaConfig, MedusaModel


@struct.dataclass
class MedusaState:
    hidden: jax.Array  # [B, H] target final hidden state of the root's predecessor


@dataclasses.dataclass(frozen=True)
class MedusaDrafter(Drafter):
    head: MedusaConfig | None = None

    def __post_init__(self):
        if self.head is None:
            raise ValueError("MedusaDrafter needs a head config")
        if self.tree.max_depth > self.head.num_heads:
            raise ValueError(f"{self.head.num_heads} Medusa heads draft at most that many tokens; "
                             f"the tree is {self.tree.max_depth} deep")

    @property
    def name(self) -> str:
        return "medusa"

    def check_target(self, target_cfg) -> None:
        check_head_target(self.head, target_cfg)

    def init(self, params, batch_size: int, width: int) -> MedusaState:
        t = self.head.target
        return MedusaState(hidden=jnp.zeros((batch_size, t.hidden_size), t.jnp_dtype))

    def prefill(self, params, state, decode, target_out):
        return MedusaState(hidden=take_rows(target_out.hidden, decode.prompt_lens - 1))

    def update(self, params, state, decode, result, target_out):
        rows = accepted_rows(target_out.hidden, result)
        return MedusaState(hidden=take_rows(rows, result.num_accepted))

    def propose(self, params, state: MedusaState, decode, key, sampling):
        outs = MedusaModel(self.head).apply(params["head"], state.hidden)  # [K, B, H]
        logits = TargetView(self.head.target).logits(params["target"], outs)  # [K, B, V]

        def expand(level, tokens, carry):
            return logits[level + 1][:, None], carry

        tokens, valid, probs, _, _ = draft_levels(self.tree, logits[0][:, None], expand, (), key,
                                                  sampling)
        return make_draft(tokens, valid, probs), state
