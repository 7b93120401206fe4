"""Prompt-lookup (n-gram) drafting on device.

For each row, the longest suffix of length n in [n_min, n_max] of its tokens that occurs
earlier in the row (prompt + output) selects a continuation: the tokens that followed that
occurrence. Longer matches rank first, then more recent ones. Several matches feed a tree.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.drafters.base import Drafter, candidates_to_draft
from specjax.types import Draft


def match_scores(tokens: jax.Array, num_tokens: jax.Array, n_min: int, n_max: int) -> jax.Array:
    """`[B, W]` score of each continuation start s (-1 = no match).

    s qualifies for n when tokens[s-n:s] equals the row's last n tokens and s < num_tokens
    (the continuation starts inside the row, so the suffix does not match itself).
    Score = n * W + s: longest n first, then the most recent occurrence.
    """
    batch, width = tokens.shape
    starts = jnp.arange(width)[None, :]  # [1, W]
    back = jnp.arange(n_max)  # j: compare tokens[s - 1 - j] with the row's tokens[L - 1 - j]
    suffix_idx = num_tokens[:, None] - 1 - back[None, :]  # [B, n_max]
    suffix = jnp.take_along_axis(tokens, jnp.clip(suffix_idx, 0, width - 1), axis=1)
    window_idx = starts[0, :, None] - 1 - back[None, :]  # [W, n_max]
    windows = tokens[:, jnp.clip(window_idx, 0, width - 1)]  # [B, W, n_max]
    equal = (windows == suffix[:, None, :]) & (window_idx >= 0)[None] & (suffix_idx >= 0)[:, None]
    # the longest n whose suffix matches, at most n_max and L - 1: every n <= it matches too
    run = jnp.sum(jnp.cumprod(equal, axis=-1), axis=-1)  # [B, W]
    n = jnp.minimum(run, num_tokens[:, None] - 1)
    ok = (n >= n_min) & (starts < num_tokens[:, None])
    return jnp.where(ok, n * width + starts, -1).astype(jnp.int32)


def continuations(
    tokens: jax.Array, num_tokens: jax.Array, starts: jax.Array, found: jax.Array, depth: int
):
    """Tokens `[B, K, depth]` following each start `[B, K]`, valid inside the row only."""
    idx = starts[:, :, None] + jnp.arange(depth)[None, None, :]
    cand = jnp.take_along_axis(tokens[:, None, :], jnp.clip(idx, 0, tokens.shape[1] - 1), axis=2)
    valid = found[:, :, None] & (idx < num_tokens[:, None, None])
    return cand, valid


@dataclasses.dataclass(frozen=True)
class NgramDrafter(Drafter):
    n_min: int = 1
    n_max: int = 3
    num_candidates: int = 0  # 0: as many as the tree's widest level needs

    def __post_init__(self):
        if not 1 <= self.n_min <= self.n_max:
            raise ValueError(f"ngram needs 1 <= n_min <= n_max, got {self.n_min}, {self.n_max}")

    shape_free_state = True
    state_from_tokens = True

    @property
    def name(self) -> str:
        return "ngram"

    def propose(self, params, state, decode, key, sampling) -> tuple[Draft, tuple]:
        tree = self.tree
        k = self.num_candidates or max(len(level) for level in tree.levels)
        score = match_scores(decode.tokens, decode.num_tokens, self.n_min, self.n_max)
        top_score, top_start = jax.lax.top_k(score, k)
        cand, valid = continuations(
            decode.tokens, decode.num_tokens, top_start, top_score >= 0, tree.max_depth
        )
        return candidates_to_draft(cand, valid, tree), state
