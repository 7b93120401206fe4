"""DSpark drafting: the DFlash block forward, then a sequential low-rank correction from each
node's parent token, and per-row verified lengths from the confidence head.

Node i at depth d drafts from `base_d + transition_bias(h_d, parent token)` (the root's token
at depth 1), so a chain applies the correction sequentially (y_1 conditions y_2, ...). Its
confidence `sigmoid(confidence_logit(h_d, parent token))` estimates P(accepted | parent
accepted); a node is verified only while the product of confidences along its path stays
>= confidence_threshold (0: verify everything). The confidences depend on the draft alone, so
sampling stays lossless; padded (invalid) nodes are never accepted.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters.dflash import BlockDrafter
from specjax.drafters.learned import path_log_probs


@dataclasses.dataclass(frozen=True)
class DSparkDrafter(BlockDrafter):
    confidence_threshold: float = 0.1

    def _level_logits(self, params, hidden, level: int, parent_tokens):
        h = hidden[:, level]  # [B, H]
        base = self.view.logits(params["target"], h)[:, None]  # [B, 1, V]
        h_rows = jnp.broadcast_to(h[:, None], parent_tokens.shape + h.shape[-1:])
        return base + self._call(params, "transition_bias", h_rows, parent_tokens)

    def node_confidence(self, params, hidden, tokens, root) -> jax.Array:
        """`[B, N]` confidence of each node given its parent token (root at depth 1)."""
        tree = self.tree
        parents = np.asarray(tree.parents)
        prev = jnp.where(parents[None] < 0, root[:, None], tokens[:, np.maximum(parents, 0)])
        h = hidden[:, tree.node_depth - 1]  # [B, N, H]
        return jax.nn.sigmoid(self._call(params, "confidence_logit", h, prev))

    def _valid(self, params, hidden, tokens, root, valid):
        if self.confidence_threshold <= 0:
            return valid
        conf = self.node_confidence(params, hidden, tokens, root)
        path = jnp.exp(path_log_probs(jnp.log(jnp.maximum(conf, 1e-30)), self.tree))
        return valid & (path >= self.confidence_threshold)
