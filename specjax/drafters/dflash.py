"""Block drafters: DFlash (and DSpark, `drafters/dspark.py`) -- one head forward per round.

State: the head's context K/V cache (every draft layer's projections of the committed
tokens' target features), with the committed length mirroring the target cache's.

- prefill: the prompt's features (positions 0..P-1) enter the context cache.
- update (after commit): the accepted path's rows (root + accepted nodes: positions M..M+n)
  enter the context cache.
- propose: ONE forward of the block [root, MASK, ...] at positions M..M+Bs-1 against the
  context cache gives the hidden state of every draft position; depth d of the tree takes
  draft position d's distribution (`_level_logits`: DFlash's does not depend on the parent;
  DSpark adds its sequential correction from the parent token). A chain of D <= num_draft
  tokens is the usual shape; trees take the per-depth top-k / sampled candidates.

Drafter params: `{"head": head variables, "target": TargetView.parts(target params)}`.
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
)
from specjax.models.cache import KVCache, empty_cache, write
from specjax.models.dflash import DFlashConfig, block_model
from specjax.models.heads import TargetView, prefix_mask


@struct.dataclass
class BlockState:
    cache: KVCache  # the context keys/values of Ld layers; lengths [B] committed tokens


@dataclasses.dataclass(frozen=True)
class BlockDrafter(Drafter):
    """DFlash drafting: the tree's depth must not exceed the head's num_draft."""

    head: DFlashConfig | None = None

    def __post_init__(self):
        if self.head is None:
            raise ValueError(f"{type(self).__name__} needs a head config")
        if self.tree.max_depth > self.head.num_draft:
            raise ValueError(
                f"a {self.head.kind} head with block size {self.head.block_size} drafts at most "
                f"{self.head.num_draft} tokens per round; the tree is {self.tree.max_depth} deep"
            )
        if not self.hidden_layers:
            object.__setattr__(self, "hidden_layers", tuple(self.head.hidden_layers))

    @property
    def name(self) -> str:
        return self.head.kind

    @property
    def model(self):
        return block_model(self.head)

    @property
    def view(self) -> TargetView:
        return TargetView(self.head.target)

    def check_target(self, target_cfg) -> None:
        check_head_target(self.head, target_cfg)

    def _call(self, params, method, *args):
        return self.model.apply(params["head"], *args, method=method)

    def _ingest(self, params, state: BlockState, layer_hidden, new_lengths) -> BlockState:
        """Feature rows (each `[B, T, H]`) of positions lengths.. -> context cache."""
        cache = state.cache
        seq = layer_hidden[0].shape[1]
        positions = cache.lengths[:, None] + jnp.arange(seq, dtype=jnp.int32)[None, :]
        context = self._call(params, "context", layer_hidden)
        k, v = self._call(params, "context_kv", context, positions)
        return BlockState(cache=write(cache, k, v).replace(lengths=new_lengths.astype(jnp.int32)))

    # ---- Drafter interface -----------------------------------------------------------------

    def init(self, params, batch_size: int, width: int) -> BlockState:
        c = self.head.layer
        return BlockState(cache=empty_cache(c.num_layers, batch_size, width, c.num_kv_heads,
                                            c.head_dim, c.jnp_dtype))

    def prefill(self, params, state, decode, target_out):
        return self._ingest(params, state, target_out.layer_hidden, decode.cache.lengths)

    def update(self, params, state, decode, result, target_out):
        rows = tuple(accepted_rows(h, result) for h in target_out.layer_hidden)
        return self._ingest(params, state, rows, decode.cache.lengths)

    def block_hidden(self, params, state: BlockState, root: jax.Array) -> jax.Array:
        """`[B, num_draft, H]`: hidden state of each draft position after the root `[B]`."""
        head, cache = self.head, state.cache
        size = head.block_size
        tokens = jnp.concatenate(
            [root[:, None], jnp.full((root.shape[0], size - 1), head.mask_token_id, jnp.int32)], 1)
        positions = cache.lengths[:, None] + jnp.arange(size, dtype=jnp.int32)[None, :]
        x = self.view.embed(params["target"], tokens)
        everything = jnp.ones((1, size, size), bool)
        hidden = self._call(params, "block", x, positions, *cache.token_major(),
                            prefix_mask(cache.lengths, cache.capacity), everything)
        return hidden[:, head.predict_offset:]

    def _level_logits(self, params, hidden, level: int, parent_tokens):
        """Logits `[B, n | 1, V]` of depth level+1 given its parents' tokens `[B, n]`."""
        del parent_tokens
        return self.view.logits(params["target"], hidden[:, level])[:, None]

    def _valid(self, params, hidden, tokens, root, valid):
        """Which drafted nodes `[B, N]` to verify (DFlash: all the draw left valid)."""
        del params, hidden, tokens, root
        return valid

    def propose(self, params, state: BlockState, decode, key, sampling):
        root = decode.last_token
        hidden = self.block_hidden(params, state, root)

        def expand(level, tokens, carry):
            return self._level_logits(params, hidden, level + 1, tokens), carry

        first = self._level_logits(params, hidden, 0, root[:, None])
        tokens, valid, probs, _, _ = draft_levels(self.tree, first, expand, (), key, sampling)
        valid = self._valid(params, hidden, tokens, root, valid)
        return make_draft(tokens, valid, probs), state
