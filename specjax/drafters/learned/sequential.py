"""Sequential feature-level heads: what EAGLE-3 (`eagle3.py`) and MTP (`mtp.py`) share.

A sequential head's Flax module follows the *cell* protocol: `features(layer_hidden)`,
`cell_qkv(feature, emb, positions)`, `cell_finish(attn, residual)`, `logits(out, parts)`; its
kind's drafter subclasses `SequentialDrafter` naming the module (`module_class`).

Drafting: the head keeps its own one-layer KV cache over the committed sequence. Draft entry t is
computed from (target feature of position t, token t + 1) and predicts token t + 2.

- prefill: ingest the prompt's entries (features of positions 0..P-1, tokens 1..P, where
  token P is the first sampled token); the output of the last entry gives the root's children.
- update (after commit): ingest the accepted path's entries: verify rows path[0..n] carry the
  target features of positions M..M+n, and tokens M+1..M+n+1 are the accepted ones plus the
  target's next token. The draft cache's committed length mirrors the target cache's.
- propose: level d of the tree is drafted from the outputs of level d-1's entries; an entry
  for a depth-d node (position M + d - 1) takes its parent's output as feature and the node's
  token, and attends to the committed cache plus its ancestors' entries -- the same keys the
  training-time test (`ttt_unroll`) trains with. D levels cost D - 1 layer calls
  here plus one in update.

Drafter params: `{"head": the head's variables, "target": TargetView.parts(target params)}`.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.drafters.learned.blocks import (
    TargetView,
    attention,
    causal,
    diagonal,
    prefix_mask,
    shift_left,
)
from specjax.drafters.learned.drafting import (
    HeadDrafter,
    accepted_rows,
    draft_levels,
    gather_tokens,
    level_tables,
    make_draft,
    path_log_probs,
)
from specjax.gather import take_rows
from specjax.models.cache import KVCache, empty_cache, write

Params = Any


def init_sequential(model: nn.Module, cfg, key: jax.Array, consts: dict | None = None):
    """Variables `{"params", "consts"}` of a sequential head module with random params.

    consts: optional overrides of the "consts" collection (e.g. draft_to_target).
    """
    t = cfg.target
    hidden = jnp.zeros((1, 1, t.hidden_size), t.jnp_dtype)
    layer_hidden = tuple(hidden for _ in cfg.hidden_layers)
    positions = jnp.zeros((1, 1), jnp.int32)
    variables = dict(model.init(key, layer_hidden, hidden, positions))
    variables["consts"] = {**variables.get("consts", {}), **(consts or {})}
    return variables


def ttt_unroll(model: nn.Module, variables: Params, features: jax.Array, embed, tokens: jax.Array,
               steps: int) -> list[jax.Array]:
    """Training-time test of a sequential head over whole sequences: `steps` draft steps.

    features `[B, T, H]`: fused target features f_t; tokens `[B, T]`; embed: tokens -> `[B, T, H]`.
    Step k at index t stands for the draft entry at position t + k of a drafting round that
    started after position t: its token input is x_{t+1+k}, its feature the step-(k-1) output
    at index t (f_t for k = 0), and it attends to the step-0 entries at indices <= t (the
    committed, target-featured prefix) plus its own earlier steps at index t -- exactly the
    keys the drafter sees at inference. Step k's output predicts x_{t+k+2}.
    Returns the output hidden states `[B, T, H]` of each step.
    """
    seq = tokens.shape[1]
    positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), tokens.shape)
    keys: list[tuple[jax.Array, jax.Array]] = []
    outs = []
    feature = features
    for k in range(steps):
        emb = embed(shift_left(tokens, k + 1))
        q, kk, vv, residual = model.apply(variables, feature, emb, positions + k, method="cell_qkv")
        keys.append((kk, vv))
        parts = [(keys[0][0], keys[0][1], causal(seq))]
        parts += [(kj, vj, diagonal(seq)) for kj, vj in keys[1:]]
        feature = model.apply(variables, attention(q, parts), residual, method="cell_finish")
        outs.append(feature)
    return outs


def training_unroll(model: nn.Module, head_cfg, variables, parts, tout, batch) -> list[jax.Array]:
    """`ttt_unroll` of a batch (`objectives` conventions): the head's output `[B, T, H]` of
    each of its `ttt_steps` steps."""
    view = TargetView(head_cfg.target)
    features = model.apply(variables, tout.layer_hidden, method="features")
    return ttt_unroll(model, variables, features, lambda t: view.embed(parts, t), batch["tokens"],
                      head_cfg.ttt_steps)


@struct.dataclass
class SequentialState:
    cache: KVCache  # one layer (see models/cache.py); lengths [B] = committed draft entries
    last: jax.Array  # [B, H] output of the last committed entry (predicts the root's child)


@dataclasses.dataclass(frozen=True)
class SequentialDrafter(HeadDrafter):
    """Drafting with a sequential head over a chain or a static tree (a kind's subclass sets
    `module_class`, its Flax module).

    min_path_prob: dynamic pruning inside the static node budget -- a node whose path
      probability under the head (temperature 1) is below it is marked invalid (0 = off).
    """

    min_path_prob: float = 0.0

    # ---- the head's cell -------------------------------------------------------------------

    def _features(self, params, target_out) -> jax.Array:
        """`[B, T, H]` fused features of a target forward's T rows."""
        return self._call(params, "features", target_out.layer_hidden)

    def _ingest(self, params, state: SequentialState, features, tokens, last_index, new_lengths):
        """Runs entries (features `[B, T, H]`, next tokens `[B, T]`) at the committed length,
        writes their K/V, commits `new_lengths` and keeps the output of entry last_index[b]."""
        cache = state.cache
        seq = tokens.shape[1]
        positions = cache.lengths[:, None] + jnp.arange(seq, dtype=jnp.int32)[None, :]
        emb = self.view.embed(params["target"], tokens)
        q, k, v, residual = self._call(params, "cell_qkv", features, emb, positions)
        parts = [(*cache.layer_kv(0), prefix_mask(cache.lengths, cache.capacity)),
                 (k, v, causal(seq))]
        out = self._call(params, "cell_finish", attention(q, parts), residual)
        cache = write(cache, k[None], v[None]).replace(lengths=new_lengths.astype(jnp.int32))
        return SequentialState(cache=cache, last=take_rows(out, last_index))

    # ---- Drafter interface -----------------------------------------------------------------

    def init(self, params, batch_size: int, width: int) -> SequentialState:
        c = self.head.layer
        return SequentialState(
            cache=empty_cache(1, batch_size, width, c.num_kv_heads, c.head_dim, c.jnp_dtype),
            last=jnp.zeros((batch_size, c.hidden_size), c.jnp_dtype),
        )

    def prefill(self, params, state, decode, target_out):
        features = self._features(params, target_out)  # [B, P, H]
        width = features.shape[1]
        tokens = gather_tokens(decode.tokens, jnp.ones_like(decode.prompt_lens), width)
        return self._ingest(params, state, features, tokens, decode.prompt_lens - 1,
                            decode.cache.lengths)

    def update(self, params, state, decode, result, target_out):
        rows = tuple(accepted_rows(h, result) for h in target_out.layer_hidden)
        features = self._call(params, "features", rows)  # [B, Dmax + 1, H]
        tokens = gather_tokens(decode.tokens, state.cache.lengths + 1, features.shape[1])
        return self._ingest(params, state, features, tokens, result.num_accepted,
                            decode.cache.lengths)

    def propose(self, params, state: SequentialState, decode, key, sampling):
        tree = self.tree
        cache = state.cache
        batch = state.last.shape[0]
        c = self.head.layer
        node_shape = (batch, tree.num_nodes, c.num_kv_heads, c.head_dim)
        like = lambda shape: jnp.zeros_like(state.last, c.jnp_dtype, shape=shape)  # vary like it
        carry = (like(node_shape), like(node_shape), like((batch, tree.num_nodes, c.hidden_size)))
        nodes_at = level_tables(tree).nodes  # [Dmax, C] each level's nodes, padded with N
        parents_at = np.asarray(tree.parents + (-1,))[nodes_at]  # parent node index (-1: root)
        # each node's ancestor mask row; padding (node N) sees no node (its output is dropped)
        ancestors = np.concatenate([tree.node_ancestor_mask, np.zeros((1, tree.num_nodes), bool)])
        prefix = (*cache.layer_kv(0), prefix_mask(cache.lengths, cache.capacity))

        def expand(level, tokens, carry):
            node_k, node_v, node_out = carry
            nodes = jnp.asarray(nodes_at)[level]  # [C]
            parents = jnp.asarray(parents_at)[level]
            width = nodes.shape[0]
            feature = jnp.where(level == 0,
                                jnp.broadcast_to(state.last[:, None], (batch, width, c.hidden_size)),
                                jnp.take(node_out, parents, axis=1, mode="clip"))
            positions = jnp.broadcast_to(cache.lengths[:, None] + level, (batch, width))
            emb = self.view.embed(params["target"], tokens)
            q, k, v, residual = self._call(params, "cell_qkv", feature, emb, positions)
            node_k = node_k.at[:, nodes].set(k, mode="drop")
            node_v = node_v.at[:, nodes].set(v, mode="drop")
            parts = [prefix, (node_k, node_v, jnp.asarray(ancestors)[nodes][None])]
            out = self._call(params, "cell_finish", attention(q, parts), residual)
            logits = self._call(params, "logits", out, params["target"])
            return logits, (node_k, node_v, node_out.at[:, nodes].set(out, mode="drop"))

        first = self._call(params, "logits", state.last[:, None], params["target"])
        pruned = self.min_path_prob > 0
        tokens, valid, probs, logp, _ = draft_levels(tree, first, expand, carry, key, sampling,
                                                     log_probs=pruned)
        score = jnp.exp(path_log_probs(logp, tree)) if pruned else None
        return make_draft(tokens, valid, probs, score, self.min_path_prob), state
