"""Verification: the target's forward over the root token plus the N draft nodes."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.models.cache import KVCache
from specjax.models.llama import ForwardOutput
from specjax.target import TargetModel, as_target
from specjax.tree import TreeSpec
from specjax.types import Draft


def verify(
    target: TargetModel,
    params,
    cache: KVCache,
    root: jax.Array,
    draft: Draft,
    tree: TreeSpec,
    hidden_layers: tuple[int, ...] = (),
) -> ForwardOutput:
    """Runs the target on `[root, draft nodes]` `[B, 1 + N]` at positions `lengths + depth`.

    The ancestor mask is the tree's (invalid nodes need no extra masking: their descendants
    are invalid too and are never accepted). Returns logits `[B, 1 + N, V]` and the cache with
    1 + N provisional entries per row at `[lengths, lengths + 1 + N)`. target: a
    `specjax.target.TargetModel` or a ModelConfig (the built-in Llama).
    """
    batch = root.shape[0]
    tokens = jnp.concatenate([root[:, None], draft.tokens], axis=1).astype(jnp.int32)
    positions = cache.lengths[:, None] + jnp.asarray(tree.verify_depth)[None, :]
    mask = jnp.broadcast_to(jnp.asarray(tree.ancestor_mask()), (batch,) + (tree.num_nodes + 1,) * 2)
    return as_target(target).forward(params, tokens, positions, cache, mask, hidden_layers=hidden_layers)
