"""Pytrees that flow through one speculative step (`specjax.loop.spec_step`).

Verify layout: the target runs 1 + N tokens per row: index 0 is the *root* (the last emitted
token, whose KV is not yet cached) and indices 1..N are the draft nodes of a static TreeSpec
(node i of the tree is verify index i + 1). Node positions are `cache.lengths + depth`
(root depth 0).
"""
from __future__ import annotations

import jax
from flax import struct


@struct.dataclass
class Draft:
    """A padded draft tree per row.

    tokens: `[B, N]` int32 draft token per tree node.
    valid: `[B, N]` bool; invalid (padded) nodes are never accepted, and an invalid node's
      descendants are treated as invalid too.
    probs: `[B, N, V]` f32 or None: the (processed, same temperature/top-k/top-p as the target)
      drafter distribution node i was drawn from, i.e. the drafter's distribution at i's parent
      (for siblings sampled without replacement: with the earlier siblings' tokens removed,
      renormalised; see accept.accept_sampling).
      None = deterministic drafter (n-gram, suffix, top-k ranks, argmax drafting): q is one-hot
      at the drafted token.
    """

    tokens: jax.Array
    valid: jax.Array
    probs: jax.Array | None = None


@struct.dataclass
class AcceptResult:
    """Outcome of verification for each row.

    path: `[B, Dmax + 1]` int32 verify indices of the accepted path: path[:, 0] = 0 (root),
      path[:, 1..n] = the accepted draft nodes (verify index = node + 1); entries past n are
      padding (repeat the last accepted index).
    num_accepted: `[B]` int32 n = accepted draft tokens (0..Dmax).
    next_token: `[B]` int32 the target's token after the accepted path (correction or bonus).
    """

    path: jax.Array
    num_accepted: jax.Array
    next_token: jax.Array
