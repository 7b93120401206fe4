"""Commit: keep only the accepted path's provisional KV entries, compacted, and advance lengths."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.models.cache import KVCache, compact
from specjax.tree import TreeSpec
from specjax.types import AcceptResult


def commit(cache: KVCache, result: AcceptResult, tree: TreeSpec, active: jax.Array) -> KVCache:
    """Cache with only the root + accepted nodes kept; lengths += num_accepted + 1 for active rows.

    For a chain the accepted path is already contiguous, so only lengths move.
    """
    if not tree.is_chain:
        cache = compact(cache, cache.lengths, result.path, tree.num_nodes + 1)
    return cache.advance(jnp.where(active, result.num_accepted + 1, 0))


def accepted_tokens(root_and_draft: jax.Array, result: AcceptResult) -> jax.Array:
    """`[B, Dmax + 1]`: the accepted draft tokens followed by next_token (then padding).

    root_and_draft `[B, 1 + N]` in verify layout.
    """
    path_tokens = jnp.take_along_axis(root_and_draft, result.path, axis=1)[:, 1:]  # [B, Dmax]
    block = jnp.concatenate([path_tokens, result.next_token[:, None]], axis=1)
    j = jnp.arange(block.shape[1])[None, :]
    n = result.num_accepted[:, None]
    return jnp.where(j < n, block, jnp.where(j == n, result.next_token[:, None], 0))
