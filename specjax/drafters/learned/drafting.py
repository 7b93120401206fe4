"""Machinery shared by the learned drafters (EAGLE-3, MTP, Medusa, DFlash, DSpark).

- `draft_levels`: lays a drafter's distributions out on a static TreeSpec, level by level,
  drawing children with the draft-model drafter's `draw_children` (processed with the run's
  temperature / top-k / top-p; argmax ranks when greedy, sampling without replacement
  otherwise) and passing the distribution each node was drawn from as `Draft.probs`, which is
  what makes `specjax.accept.accept_sampling` lossless.
- `accepted_rows`: the verify rows of the accepted path (root + accepted nodes), i.e. the
  target features a drafter ingests after each step.
- `path_log_probs` / `prefix_valid`: per-node validity from path scores (dynamic pruning
  inside the static node budget; invalid nodes are never accepted).
"""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters.draft_model import draw_children, tree_levels
from specjax.models.finite import check_tree_finite
from specjax.rng import split_rows
from specjax.sampling import SamplingParams
from specjax.tree import TreeSpec
from specjax.types import AcceptResult, Draft

#: expand(level, tokens of that level's nodes `[B, n]`, carry)
#:   -> (logits `[B, n | 1, V]` of the children of each of those nodes, carry)
Expand = Callable[[int, jax.Array, object], tuple[jax.Array, object]]


def draft_levels(tree: TreeSpec, first_logits: jax.Array, expand: Expand, carry, key: jax.Array,
                 sampling: SamplingParams):
    """Drafts a whole tree from the root's children logits `[B, 1, V]` and `expand`, level by
    level; children are drawn by `draft_model.draw_children` (argmax ranks when greedy, Gumbel
    top-k = sampling without replacement otherwise, with the distribution each was drawn from).

    expand(i, tokens of level i, carry) gives the logits of level i + 1's parents: one row per
    level-i node, or a single row shared by all of them (drafters whose depth-d distribution
    does not depend on the parent: Medusa, DFlash).
    Returns (tokens `[B, N]`, valid `[B, N]`, probs `[B, N, V]`, node log-probs `[B, N]` of each
    token under the drafter's raw (temperature 1) distribution, carry).
    """
    batch, vocab = first_logits.shape[0], first_logits.shape[-1]
    num = tree.num_nodes
    tokens = jnp.zeros((batch, num), jnp.int32)
    valid = jnp.ones((batch, num), bool)
    probs = jnp.zeros((batch, num, vocab), jnp.float32)
    logp = jnp.zeros((batch, num), jnp.float32)
    levels = tree_levels(tree)
    keys = split_rows(key, batch, tree.max_depth)  # [Dmax, B, 2]: one per level and row
    logits = first_logits
    for i, level in enumerate(levels):
        if i > 0:
            logits, carry = expand(i - 1, tokens[:, np.asarray(levels[i - 1].nodes)], carry)
        cols = np.asarray(level.parent_cols if logits.shape[1] > 1 else (0,) * len(level.nodes))
        tok, ok, q = draw_children(keys[i], logits, jnp.asarray(cols), jnp.asarray(level.ranks),
                                   level.num_ranks, sampling)
        idx = np.asarray(level.nodes)
        raw = jnp.take_along_axis(jax.nn.log_softmax(logits[:, cols], -1), tok[..., None], -1)
        tokens = tokens.at[:, idx].set(tok.astype(jnp.int32))
        valid = valid.at[:, idx].set(ok)
        probs = probs.at[:, idx].set(q)
        logp = logp.at[:, idx].set(raw[..., 0])
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


def take_rows(x: jax.Array, index: jax.Array) -> jax.Array:
    """`x[b, index[b]]` for x `[B, T, ...]`, index `[B]` -> `[B, ...]`."""
    idx = index.reshape(index.shape + (1,) * (x.ndim - 1))
    return jnp.take_along_axis(x, idx, axis=1)[:, 0]


def drafter_params(head_variables, target_params, head_cfg) -> dict:
    """The params pytree every learned drafter takes: `{"head": its variables, "target": the
    target's embedding / norm / LM head (views of target_params, not copies)}`."""
    from specjax.models.heads import TargetView

    return {"head": head_variables, "target": TargetView(head_cfg.target).parts(target_params)}


def make_learned_drafter(head_cfg, tree: TreeSpec, **options):
    """The drafter of a head config (by its kind) over a static tree."""
    kind = head_cfg.kind
    if kind in ("eagle3", "mtp"):
        from specjax.drafters.eagle3 import SequentialDrafter

        return SequentialDrafter(tree=tree, head=head_cfg, **options)
    if kind == "medusa":
        from specjax.drafters.mtp import MedusaDrafter

        return MedusaDrafter(tree=tree, head=head_cfg, **options)
    if kind == "dflash":
        from specjax.drafters.dflash import BlockDrafter

        return BlockDrafter(tree=tree, head=head_cfg, **options)
    if kind == "dspark":
        from specjax.drafters.dspark import DSparkDrafter

        return DSparkDrafter(tree=tree, head=head_cfg, **options)
    raise ValueError(f"unknown learned drafter kind {kind!r}")


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


def load_learned_drafter(kind: str, folder: str, tree: TreeSpec, target_cfg, target_params):
    """(drafter, drafter params) of a learned head in `folder`: a `specjax train-drafter`
    output (drafter.json + orbax checkpoints; latest step) or, for eagle3 / dflash, an upstream
    Hugging Face folder (config.json + *.safetensors). A weight holding NaN / Inf is refused
    (CheckpointError naming the folder and the tensor)."""
    from pathlib import Path

    path = Path(folder)
    if not folder or not path.is_dir():
        raise ValueError(f"{kind}:DIR needs a folder with a trained drafter, got {folder!r}")
    if target_params is None:
        raise ValueError(f"{kind} drafts with the target's embedding/head: pass the target's params")
    if (path / "drafter.json").exists():
        from specjax.train.trainer import load_trained

        head_cfg, variables = load_trained(path, target_cfg)
        check_tree_finite(variables["params"], path / "checkpoints")
        if head_cfg.kind != kind:
            raise ValueError(f"{folder} holds a {head_cfg.kind} drafter, not {kind}")
    elif (path / "config.json").exists():
        from specjax.models.upstream import load_upstream

        head_cfg, variables = load_upstream(kind, path, target_cfg)
    else:
        raise ValueError(f"{folder}: neither drafter.json (specjax) nor config.json (upstream)")
    return make_learned_drafter(head_cfg, tree), drafter_params(variables, target_params, head_cfg)
