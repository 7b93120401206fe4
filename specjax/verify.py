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
    live_depth: jax.Array | None = None,
) -> ForwardOutput:
    """Runs the target on `[root, draft nodes]` `[B, 1 + N]` at positions `lengths + depth`.

    The ancestor mask is the tree's (invalid nodes need no extra masking: their descendants
    are invalid too and are never accepted). Returns logits `[B, 1 + N, V]` and the cache with
    1 + N provisional entries per row at `[lengths, lengths + 1 + N)`. live_depth `[]` int32
    (None: every node): the nodes deeper are dead, their mask rows without the diagonal (they
    still see their ancestors; no live node sees them): the built-in Llama's CPU kernels skip them
    (`models.llama.live_rows`), any target's outputs for them go unused. target: a
    `specjax.target.TargetModel` or a ModelConfig (the built-in Llama).
    """
    batch = root.shape[0]
    tokens = jnp.concatenate([root[:, None], draft.tokens], axis=1).astype(jnp.int32)
    positions = cache.lengths[:, None] + jnp.asarray(tree.verify_depth)[None, :]
    mask = jnp.broadcast_to(jnp.asarray(tree.ancestor_mask()), (batch,) + (tree.num_nodes + 1,) * 2)
    if live_depth is not None:
        mask = mask & ~dead_diagonal(tree, live_depth)[None]
    return as_target(target).forward(params, tokens, positions, cache, mask, hidden_layers=hidden_layers)


def dead_diagonal(tree: TreeSpec, live_depth: jax.Array) -> jax.Array:
    """`[1 + N, 1 + N]` bool: True on the diagonal of each verify row deeper than live_depth
    `[]` (a dead row: the target need not compute it)."""
    dead = jnp.asarray(tree.verify_depth) > live_depth
    return jnp.diag(dead)
