"""Draft-model drafting: a small Llama-family model sharing the target's vocabulary.

The drafter params are the draft model's params pytree; its state is its own KV cache, kept in
step with the target's accepted path:

- prefill: the prompts go through the draft model (entries `[0, P)`).
- propose: the last two committed tokens are re-fed at `num_tokens - 2` (the draft cache is
  valid below that after every step, see `update`), giving the draft logits at the root. Then
  the tree grows level by level: the children of every node of a level are drawn from that
  node's draft distribution (`draw_children`), and one tree-masked forward of the level's
  nodes (plus their non-cached ancestors) gives the next level's distributions. Leaves are
  never fed. The Dmax forward+draw iterations are one `lax.scan` over static tables
  (`ProposePlan`, feeds padded to one width), so the program holds one draft forward whatever
  the tree: compile time stays flat, and a padded forward of a few tokens costs what the
  unpadded one does in the memory-bound regime drafting runs in.
- update: the fed nodes of the accepted path are compacted to `num_tokens_before + depth - 1`
  (the target's commit, on the draft cache); for a chain they are in place already.

When all D drafts of a chain are accepted, draft D and the bonus token are exactly the two
re-fed tokens, so no step needs an extra pass.

Children (`draw_children`): the draft logits get the run's temperature / top-k / top-p
(`sampling.processed_logits`, the transform the target's p gets), then a parent's candidates
are its Gumbel top-k: the argmax ranks when greedy, and *sampling without replacement* from the
processed distribution q otherwise. The node of rank r takes the r-th candidate and carries
`Draft.probs` = q with the candidates of ranks < r removed and renormalised: the distribution
it was actually drawn from, which is what `accept.accept_sampling`'s sibling walk needs to be
lossless (a chain is the rank-0 case: q itself). Candidates outside the top-k / top-p support
are invalid nodes.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.drafters.base import Drafter
from specjax.models.cache import KVCache, compact, init_cache
from specjax.models.config import ModelConfig
from specjax.models.llama import forward
from specjax.rng import per_row, split_rows
from specjax.sampling import SamplingParams, processed_logits
from specjax.tree import TreeSpec
from specjax.types import Draft

# ---- static expansion plan -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Level:
    """One depth of a tree, for drafters that grow the tree level by level.

    nodes: node indices at this depth (node order).
    parents: verify indices whose candidates this level takes: `(0,)` (the root) at depth 1,
      else the previous level's nodes + 1 (all of them, childless ones included).
    parent_cols: per node, its parent's column in `parents`.
    ranks: per node, its candidate rank among its siblings.
    num_ranks: candidates drawn per parent (max rank + 1).
    """

    nodes: tuple[int, ...]
    parents: tuple[int, ...]
    parent_cols: tuple[int, ...]
    ranks: tuple[int, ...]

    @property
    def num_ranks(self) -> int:
        return max(self.ranks) + 1


@functools.cache
def tree_levels(tree: TreeSpec) -> tuple[Level, ...]:
    """The tree's levels, depth 1 first."""
    out, previous = [], (0,)
    for nodes in tree.levels:
        cols = tuple(previous.index(tree.parents[i] + 1) for i in nodes)
        out.append(Level(nodes, previous, cols, tuple(tree.ranks[i] for i in nodes)))
        previous = tuple(i + 1 for i in nodes)
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Feed:
    """A draft forward: tree `nodes` (node order) fed at cache offset `num_tokens + cached`."""

    nodes: tuple[int, ...]
    cached: int


def trunk_length(tree: TreeSpec) -> int:
    """Leading levels with a single node (nodes 0..t-1): fed once, then kept in the cache,
    since they are ancestors of every deeper node. Capped at Dmax - 1 (leaves are not fed)."""
    t = 0
    while t < tree.max_depth - 1 and len(tree.levels[t]) == 1:
        t += 1
    return t


def level_feeds(tree: TreeSpec) -> tuple[Feed, ...]:
    """The forward after each level but the last. Level l (1-based) feeds the nodes of depth in
    (c, l] with c = min(trunk, l - 1) levels already cached: a chain feeds one token per level,
    a bushy tree re-feeds its (non-trunk) upper levels under the ancestor mask."""
    trunk, depth = trunk_length(tree), tree.depth
    feeds = []
    for level in range(1, tree.max_depth):
        cached = min(trunk, level - 1)
        feeds.append(Feed(tuple(i for i in range(tree.num_nodes) if cached < depth[i] <= level), cached))
    return tuple(feeds)


@dataclasses.dataclass(frozen=True, eq=False)
class ChildTables:
    """The levels as padded tables, row i = the nodes of depth i + 1 (padding: node index N,
    dropped on scatter; rank 0 of the root).

    nodes, ranks, parent `[Dmax, C]`: node index, candidate rank, parent's verify index.
    num_ranks: candidates any parent needs (max rank + 1).
    """

    nodes: np.ndarray
    ranks: np.ndarray
    parent: np.ndarray
    num_ranks: int


@dataclasses.dataclass(frozen=True, eq=False)
class ProposePlan:
    """Static tables of `propose`'s loop, one row per iteration i = 0..Dmax-1: iteration 0
    re-feeds the last two committed tokens (root logits), iteration i >= 1 feeds level i (its
    logits); then iteration i draws level i + 1 (`children`, plus `child_cols`: each child's
    parent's column in logit_cols). Feeds are padded to T tokens (padding sits after the real
    tokens, attends to itself only, and its cache entries are overwritten before use),
    parents to K.

    feed_src `[Dmax, T]`: columns of `[last two committed tokens, draft tokens [N]]` to feed.
    feed_pos `[Dmax, T]`: positions relative to num_tokens.
    feed_offset `[Dmax]`: cache offset (the forward's `lengths`) relative to num_tokens.
    feed_mask `[Dmax, T, T]`: attention among the fed tokens.
    logit_cols `[Dmax, K]`: feed positions of the parents of level i + 1.
    """

    feed_src: np.ndarray
    feed_pos: np.ndarray
    feed_offset: np.ndarray
    feed_mask: np.ndarray
    logit_cols: np.ndarray
    child_cols: np.ndarray
    children: ChildTables


def _padded(rows, width: int, fill: int) -> np.ndarray:
    return np.asarray([list(r) + [fill] * (width - len(r)) for r in rows], np.int32)


@functools.cache
def child_tables(tree: TreeSpec) -> ChildTables:
    levels = tree_levels(tree)
    width = max(len(lv.nodes) for lv in levels)
    return ChildTables(
        nodes=_padded([lv.nodes for lv in levels], width, tree.num_nodes),
        ranks=_padded([lv.ranks for lv in levels], width, 0),
        parent=_padded([[tree.parents[i] + 1 for i in lv.nodes] for lv in levels], width, 0),
        num_ranks=max(lv.num_ranks for lv in levels),
    )


@functools.cache
def propose_plan(tree: TreeSpec) -> ProposePlan:
    levels, feeds, children = tree_levels(tree), level_feeds(tree), child_tables(tree)
    depth = np.asarray(tree.depth)
    width = max([2] + [len(f.nodes) for f in feeds])
    src, pos, offset = [(0, 1)], [(-2, -1)], [-2]
    masks = [np.tril(np.ones((2, 2), bool))]
    cols = [(1,)]
    for feed, level in zip(feeds, levels):
        nodes = np.asarray(feed.nodes)
        src.append(tuple(nodes + 2))
        pos.append(tuple(depth[nodes] - 1))
        offset.append(feed.cached)
        masks.append(tree.node_ancestor_mask[np.ix_(nodes, nodes)])
        cols.append(tuple(feed.nodes.index(i) for i in level.nodes))
    mask = np.zeros((len(masks), width, width), bool)
    mask[:, np.arange(width), np.arange(width)] = True
    for i, m in enumerate(masks):
        mask[i, : len(m), : len(m)] = m
    return ProposePlan(
        feed_src=_padded(src, width, 0),
        feed_pos=_padded(pos, width, 0),
        feed_offset=np.asarray(offset, np.int32),
        feed_mask=mask,
        logit_cols=_padded(cols, max(len(lv.parents) for lv in levels), 0),
        child_cols=_padded([lv.parent_cols for lv in levels], children.nodes.shape[1], 0),
        children=children,
    )


@functools.cache
def fed_slots(tree: TreeSpec) -> np.ndarray:
    """`[1 + N]` int32 draft-cache slot of each verify row after propose, relative to
    `num_tokens - 1` (the root's): fed node i sits at 1 + its index among the nodes of depth
    <= Dmax - 1; unfed rows (leaves) map to 0."""
    fed = [i for i in range(tree.num_nodes) if tree.depth[i] < tree.max_depth]
    slots = np.zeros(tree.num_nodes + 1, np.int32)
    for j, i in enumerate(fed):
        slots[i + 1] = j + 1
    return slots


def path_in_place(tree: TreeSpec) -> bool:
    """Whether every fed node already sits at its path slot (depth), e.g. a chain."""
    slots = fed_slots(tree)
    return all(slots[i + 1] in (0, d) for i, d in enumerate(tree.depth))


# ---- children of a level ---------------------------------------------------------------------


def draw_children(
    key: jax.Array,
    logits: jax.Array,
    cols: jax.Array,
    ranks: jax.Array,
    num_ranks: int,
    sampling: SamplingParams,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Children from the parents' raw draft logits `[B, K, V]`: child c takes candidate
    `ranks[c]` of parent `cols[c]` (`[C]` each; num_ranks static >= max rank + 1).

    key: the rows' keys `[B, 2]` (row b's noise from its own key) or one key.
    Returns tokens `[B, C]`, ok `[B, C]` (inside the processed support) and probs `[B, C, V]`
    (the distribution each child was drawn from; see the module docstring), or None under
    static greedy params (`SamplingParams.greedy`): greedy acceptance compares tokens only, so
    a greedy program builds no `[B, N, V]` distribution (16-21 fewer kernels for a chain of 4:
    `benchmarks/compile_time.py --baseline d22347f`, commit 1a69a8d).
    """
    scores = processed_logits(logits, sampling)  # [B, K, V], -inf outside top-k / top-p
    if sampling.greedy:  # static: no draw at all
        noisy = scores
    else:
        noise = per_row(key, scores.shape[0],
                        lambda k: jax.random.gumbel(k, scores.shape[1:], jnp.float32))
        noisy = scores + jnp.where(sampling.is_greedy, 0.0, noise)
    if num_ranks == 1:  # a chain: the argmax (ties to the lower index, as top_k), no sort
        cand, cand_scores = jnp.argmax(noisy, axis=-1)[..., None], jnp.max(noisy, axis=-1)[..., None]
    else:
        cand_scores, cand = jax.lax.top_k(noisy, num_ranks)  # [B, K, R]
    tokens = cand[:, cols, ranks]
    ok = jnp.isfinite(cand_scores[:, cols, ranks])
    if sampling.greedy:
        return tokens, ok, None
    q = jax.nn.softmax(scores, axis=-1)[:, cols]  # [B, C, V]
    earlier = jnp.arange(num_ranks)[None, :] < ranks[:, None]  # [C, R]
    removed = jnp.where(earlier[None], cand[:, cols], q.shape[-1])  # [B, C, R]; V = no-op
    batch_idx = jnp.arange(q.shape[0])[:, None, None]
    child_idx = jnp.arange(q.shape[1])[None, :, None]
    q = q.at[batch_idx, child_idx, removed].set(0.0, mode="drop")
    mass = jnp.sum(q, axis=-1, keepdims=True)
    return tokens, ok & (mass[..., 0] > 0), q / jnp.where(mass > 0, mass, 1.0)


# ---- the drafter ------------------------------------------------------------------------------


@struct.dataclass
class DraftModelState:
    """cache: the draft model's KV cache (lengths are set afresh at every forward).
    base: `[B]` int32 num_tokens at the last propose (the slot of depth-1 nodes)."""

    cache: KVCache
    base: jax.Array


def check_vocab(draft_cfg: ModelConfig, target_cfg: ModelConfig, what: str = "draft model") -> None:
    if draft_cfg.vocab_size != target_cfg.vocab_size:
        raise ValueError(
            f"the {what} {draft_cfg.name!r} has a vocabulary of {draft_cfg.vocab_size} tokens, "
            f"the target {target_cfg.name!r} {target_cfg.vocab_size}: a draft model must share "
            "the target's tokenizer"
        )


@dataclasses.dataclass(frozen=True)
class DraftModelDrafter(Drafter):
    """Drafts with a separate Llama-family model `cfg`; drafter params = its params pytree."""

    cfg: ModelConfig | None = None

    #: the draft cache is valid below `num_tokens - 2` after every step whatever the tree (the
    #: chain's fed nodes sit at their committed slots, a tree's accepted path is compacted
    #: there by `update`, and a plain step of `num_draft="auto"` feeds the token before the
    #: root, `sync`): one state serves every draft shape
    shape_free_state = True
    #: a proposal runs the draft model: auto's plain steps `sync` instead
    observe_plain_steps = False

    def __post_init__(self):
        if not isinstance(self.cfg, ModelConfig):
            raise TypeError("DraftModelDrafter needs the draft model's ModelConfig (cfg=...)")

    @property
    def name(self) -> str:
        return f"model:{self.cfg.name}"

    def check_target(self, target_cfg: ModelConfig) -> None:
        check_vocab(self.cfg, target_cfg)

    def model_params(self, params):
        """The params `forward(self.cfg, ...)` runs with (layerskip slices the target's)."""
        return params

    def init(self, params, batch_size: int, width: int) -> DraftModelState:
        return DraftModelState(
            cache=init_cache(self.cfg, batch_size, width),
            base=jnp.zeros((batch_size,), jnp.int32),
        )

    def prefill(self, params, state: DraftModelState, decode, target_out) -> DraftModelState:
        """Runs the prompts (width P = the target's prefill width) through the draft model."""
        batch, width = target_out.hidden.shape[:2]
        positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
        cache = state.cache.replace(lengths=jnp.zeros((batch,), jnp.int32))
        out = forward(self.cfg, self.model_params(params), decode.tokens[:, :width], positions,
                      cache, compute_logits=False)
        return state.replace(cache=out.cache)

    def propose(self, params, state: DraftModelState, decode, key, sampling):
        tree, plan, params = self.tree, propose_plan(self.tree), self.model_params(params)
        batch, num_nodes = decode.tokens.shape[0], tree.num_nodes
        length = decode.num_tokens  # [B] L: the root sits at L - 1
        last_two = jnp.take_along_axis(decode.tokens, length[:, None] - 2 + jnp.arange(2), axis=1)
        children = plan.children
        tables = {
            "feed_src": plan.feed_src, "feed_pos": plan.feed_pos, "feed_offset": plan.feed_offset,
            "feed_mask": plan.feed_mask, "logit_cols": plan.logit_cols,
            "child_cols": plan.child_cols, "nodes": children.nodes, "ranks": children.ranks,
            "parent": children.parent,
        }
        tables = {k: jnp.asarray(v) for k, v in tables.items()}
        tables["key"] = split_rows(key, batch, tree.max_depth)  # [Dmax, B, 2]

        def iteration(carry, t):
            cache, tokens, valid, probs = carry
            source = jnp.concatenate([last_two, tokens], axis=1)  # [B, 2 + N]
            width = t["feed_src"].shape[0]
            out = forward(
                self.cfg, params, source[:, t["feed_src"]], length[:, None] + t["feed_pos"],
                cache.replace(lengths=length + t["feed_offset"]),
                jnp.broadcast_to(t["feed_mask"], (batch, width, width)),
                logit_indices=jnp.broadcast_to(t["logit_cols"], (batch,) + t["logit_cols"].shape),
            )
            tok, ok, q = draw_children(
                t["key"], out.logits, t["child_cols"], t["ranks"], children.num_ranks, sampling
            )
            parent_ok = jnp.concatenate([jnp.ones((batch, 1), bool), valid], axis=1)
            ok = ok & parent_ok[:, t["parent"]]
            nodes = t["nodes"]
            tokens = tokens.at[:, nodes].set(tok, mode="drop")
            valid = valid.at[:, nodes].set(ok, mode="drop")
            if q is not None:
                probs = probs.at[:, nodes].set(q, mode="drop")
            return (out.cache, tokens, valid, probs), None

        carry = (
            state.cache,
            jnp.zeros((batch, num_nodes), jnp.int32),
            jnp.zeros((batch, num_nodes), bool),
            None if sampling.greedy  # greedy: no draft distributions (`draw_children`)
            else jnp.zeros((batch, num_nodes, self.cfg.vocab_size), jnp.float32),
        )
        (cache, tokens, valid, probs), _ = jax.lax.scan(iteration, carry, tables)
        return Draft(tokens=tokens, valid=valid, probs=probs), state.replace(cache=cache, base=length)

    def sync(self, params, state: DraftModelState, decode) -> DraftModelState:
        """After a plain step (decode: the state after it): feeds the one token the draft cache
        lacks (at `num_tokens - 3`, no logits), so it is valid below `num_tokens - 2` again."""
        missing = jnp.maximum(decode.num_tokens - 3, 0)  # [B]
        token = jnp.take_along_axis(decode.tokens, missing[:, None], axis=1)
        out = forward(self.cfg, self.model_params(params), token, missing[:, None],
                      state.cache.replace(lengths=missing), compute_logits=False)
        return state.replace(cache=out.cache, base=decode.num_tokens - 1)

    def update(self, params, state: DraftModelState, decode, result, target_out) -> DraftModelState:
        """Moves the accepted path's fed nodes to their committed slots (trees only)."""
        if path_in_place(self.tree):
            return state
        slots = jnp.asarray(fed_slots(self.tree))[result.path]  # [B, Dmax + 1]
        width = int(fed_slots(self.tree).max()) + 1
        root = state.base - 1
        return state.replace(cache=compact(state.cache, root, slots, width))

