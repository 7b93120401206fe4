"""Drafting machinery shared by the learned drafters (EAGLE-3, MTP, Medusa, DFlash, DSpark).

- `draft_levels`: lays a drafter's distributions out on a static TreeSpec, level by level,
  drawing children with the draft-model drafter's `draw_children` (processed with the run's
  temperature / top-k / top-p; argmax ranks when greedy, sampling without replacement
  otherwise) and passing the distribution each node was drawn from as `Draft.probs`, which is
  what makes `specjax.accept.accept_sampling` lossless.
- `accepted_rows`: the verify rows of the accepted path (root + accepted nodes), i.e. the
  target features a drafter ingests after each step.
- `path_log_probs` / `make_draft`: per-node validity from path scores (dynamic pruning
  inside the static node budget; invalid nodes are never accepted).
- `HeadDrafter`: the base of the learned drafters (a head config, its Flax module, the
  target views, the depth check); `drafter_params`: the params pytree they take.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters.base import Drafter
from specjax.drafters.draft_model import child_tables, draw_children, tree_levels
from specjax.drafters.learned.blocks import TargetView
from specjax.rng import split_rows
from specjax.sampling import SamplingParams
from specjax.tree import TreeSpec
from specjax.types import AcceptResult, Draft

#: expand(level, tokens of that level's nodes `[B, C]`, carry)
#:   -> (logits `[B, C | 1, V]` of the children of each of those nodes, carry)
#: level: a traced int32 scalar; the tokens are in `level_tables(tree).nodes[level]` order, padded
#: to the widest level C (padding columns hold garbage, and what is computed from them is dropped)
Expand = Callable[[jax.Array, jax.Array, object], tuple[jax.Array, object]]


@dataclasses.dataclass(frozen=True, eq=False)
class LevelTables:
    """The tree's levels as padded tables, row d = the nodes of depth d + 1 (`draft_model`'s
    `child_tables`, padding: node index N, dropped on scatter), plus `cols` `[Dmax, C]`: each
    node's parent's column among the previous level's nodes (0 at depth 1 and for padding)."""

    nodes: np.ndarray
    ranks: np.ndarray
    cols: np.ndarray
    num_ranks: int


@functools.cache
def level_tables(tree: TreeSpec) -> LevelTables:
    children = child_tables(tree)
    cols = np.zeros_like(children.nodes)
    for d, level in enumerate(tree_levels(tree)):
        cols[d, : len(level.parent_cols)] = level.parent_cols
    return LevelTables(children.nodes, children.ranks, cols, children.num_ranks)


def draft_levels(tree: TreeSpec, first_logits: jax.Array, expand: Expand, carry, key: jax.Array,
                 sampling: SamplingParams, log_probs: bool = False):
    """Drafts a whole tree from the root's children logits `[B, 1, V]` and `expand`, level by
    level; children are drawn by `draft_model.draw_children` (argmax ranks when greedy, Gumbel
    top-k = sampling without replacement otherwise, with the distribution each was drawn from).

    expand(level, tokens of that level's nodes, carry) gives the logits of level + 1's parents:
    one row per node of the level (padded to the widest level, `Expand`), or a single row
    shared by all of them (drafters whose depth-d distribution does not depend on the parent:
    Medusa, DFlash). The levels are ONE `lax.scan` (draw a level, then expand it unless it is
    the last), so the program holds one draw and one expand whatever the tree's depth.
    Returns (tokens `[B, N]`, valid `[B, N]`, probs `[B, N, V]` (None under static greedy params,
    as `draw_children`), node log-probs `[B, N]` of each token under the drafter's raw
    (temperature 1) distribution (None unless `log_probs`: a log-softmax over the vocabulary
    per level that only path-probability pruning reads), carry).
    """
    batch, vocab = first_logits.shape[0], first_logits.shape[-1]
    num, depth = tree.num_nodes, tree.max_depth
    tables = level_tables(tree)
    level_tokens = lambda tokens, nodes: jnp.take(tokens, nodes, axis=1, mode="clip")
    like = lambda shape, dtype, fill=0: jnp.full_like(first_logits, fill, dtype, shape=shape)
    init = (like((batch, num), jnp.int32), like((batch, num), bool, True),  # vary like the input
            None if sampling.greedy else like((batch, num, vocab), jnp.float32),  # greedy: none
            like((batch, num), jnp.float32) if log_probs else None)
    rows = jax.eval_shape(expand, jnp.int32(0), level_tokens(init[0], tables.nodes[0]), carry)[0]
    logits = first_logits
    if rows.shape[1] > 1:  # one row per parent: the root's row for every column of depth 1
        logits = jnp.broadcast_to(first_logits, (batch, rows.shape[1], vocab))
    logits = logits.astype(rows.dtype)
    xs = {"level": jnp.arange(depth, dtype=jnp.int32), "nodes": jnp.asarray(tables.nodes),
          "ranks": jnp.asarray(tables.ranks),
          "cols": jnp.asarray(tables.cols if logits.shape[1] > 1 else np.zeros_like(tables.cols)),
          "key": split_rows(key, batch, depth)}  # [Dmax, B, 2]: one per level and row

    def level(state, t):
        (tokens, valid, probs, logp), logits, carry = state
        tok, ok, q = draw_children(t["key"], logits, t["cols"], t["ranks"], tables.num_ranks,
                                   sampling)
        nodes = t["nodes"]
        if log_probs:
            raw = jnp.take_along_axis(
                jax.nn.log_softmax(logits[:, t["cols"]].astype(jnp.float32), -1), tok[..., None], -1)
            logp = logp.at[:, nodes].set(raw[..., 0], mode="drop")
        drafted = (tokens.at[:, nodes].set(tok.astype(jnp.int32), mode="drop"),
                   valid.at[:, nodes].set(ok, mode="drop"),
                   None if q is None else probs.at[:, nodes].set(q, mode="drop"),
                   logp)
        logits, carry = jax.lax.cond(
            t["level"] + 1 < depth,
            lambda: expand(t["level"], level_tokens(drafted[0], nodes), carry),
            lambda: (logits, carry),
        )
        return (drafted, logits, carry), None

    ((tokens, valid, probs, logp), _, carry), _ = jax.lax.scan(level, (init, logits, carry), xs)
    return tokens, valid, probs, logp, carry


def path_log_probs(node_logp: jax.Array, tree: TreeSpec) -> jax.Array:
    """`[B, N]` sum of node log-probs over each node's root path."""
    return node_logp @ jnp.asarray(tree.node_ancestor_mask.T, node_logp.dtype)


def make_draft(tokens, valid, probs, path_score: jax.Array | None = None,
               threshold: float = 0.0) -> Draft:
    """A Draft; nodes whose path score (a probability-like value `[B, N]`, e.g. the path's
    draft probability or a confidence product) is below `threshold` are invalid as well
    (threshold 0: off). The score must not depend on the target (losslessness)."""
    if path_score is not None and threshold > 0:
        valid = valid & (path_score >= threshold)
    return Draft(tokens=tokens, valid=valid, probs=probs)


def accepted_rows(x: jax.Array, result: AcceptResult) -> jax.Array:
    """x `[B, 1 + N, ...]` (verify layout) -> `[B, Dmax + 1, ...]` rows of the accepted path
    (root first; rows past num_accepted repeat the last accepted one)."""
    idx = result.path.reshape(result.path.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, idx, axis=1)


def gather_tokens(tokens: jax.Array, start: jax.Array, count: int) -> jax.Array:
    """`tokens[b, start[b] + j]` for j < count (clipped to the buffer) -> `[B, count]`."""
    idx = jnp.clip(start[:, None] + jnp.arange(count)[None, :], 0, tokens.shape[1] - 1)
    return jnp.take_along_axis(tokens, idx, axis=1)


def drafter_params(head_variables, target_params, head_cfg) -> dict:
    """The params pytree every learned drafter takes: `{"head": its variables, "target": the
    target's embedding / norm / LM head (views of target_params, not copies)}`."""
    return {"head": head_variables, "target": TargetView(head_cfg.target).parts(target_params)}


def check_head_target(head_cfg, target_cfg) -> None:
    """Raises ValueError when a head was built for a target of other shapes."""
    ours = head_cfg.target
    for field in ("vocab_size", "hidden_size", "num_layers"):
        if getattr(ours, field) != getattr(target_cfg, field):
            raise ValueError(
                f"the {head_cfg.kind} head was built for a target with {field}="
                f"{getattr(ours, field)}, this target ({target_cfg.name!r}) has "
                f"{getattr(target_cfg, field)}"
            )


@dataclasses.dataclass(frozen=True)
class HeadDrafter(Drafter):
    """A drafter driven by a learned head: `head` is the kind's head config, `module_class` (set
    by each subclass) its Flax module; the drafter reads the target layers the head reads.

    Drafter params: `{"head": the head's variables, "target": TargetView.parts(target params)}`
    (`drafter_params`).
    """

    module_class: ClassVar[type[nn.Module]]
    head: Any = None

    #: every kind's state is per committed position (a context / one-layer KV cache whose
    #: committed length mirrors the target cache's, or the last accepted hidden state) and
    #: `update` ingests the accepted path's rows, however many the step verified: one state
    #: serves every draft shape (`num_draft="auto"`, `drafters.auto`), up to `deepest_draft`
    shape_free_state: ClassVar[bool] = True
    #: a proposal runs the head and the target's LM head, and leaves the state alone (`sync`
    #: has nothing to do): auto's plain steps skip it
    observe_plain_steps: ClassVar[bool] = False

    def __post_init__(self):
        if self.head is None:
            raise ValueError(f"{type(self).__name__} needs a head config")
        deepest = self.deepest_draft
        if deepest is not None and self.tree.max_depth > deepest:
            raise ValueError(f"a {self.head.kind} head drafts at most {deepest} tokens per round; "
                             f"the tree is {self.tree.max_depth} deep")
        if not self.hidden_layers:
            object.__setattr__(self, "hidden_layers", tuple(self.head.hidden_layers))

    @property
    def deepest_draft(self) -> int | None:
        """The deepest tree the head can fill (None: any depth)."""
        return None

    @property
    def name(self) -> str:
        return self.head.kind

    def check_target(self, target_cfg) -> None:
        check_head_target(self.head, target_cfg)

    @property
    def model(self) -> nn.Module:
        return self.module_class(self.head)

    @property
    def view(self) -> TargetView:
        return TargetView(self.head.target)

    def _call(self, params, method, *args):
        """The head module's `method` on args, with the drafter params' head variables."""
        return self.model.apply(params["head"], *args, method=method)
