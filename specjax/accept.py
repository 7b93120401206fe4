"""Acceptance rules: which draft nodes the target keeps, and the token it emits after them.

Every rule is a pure, jit/vmap-friendly function of static shapes (`tree` is a static
TreeSpec; Python loops run over its static structure, never over the batch) and does its
math in f32. All rules share one shape contract:

  target_logits `[B, 1 + N, V]` (verify layout: row 0 = root, row i + 1 = node i; row v holds
  the target's logits for the token *after* v), draft = Draft{tokens `[B, N]`, valid `[B, N]`,
  probs `[B, N, V]` | None}  ->  AcceptResult{path `[B, Dmax + 1]`, num_accepted `[B]`,
  next_token `[B]`}. key: the rows' keys `[B, 2]` (row b's draws use only its own key) or one
  key split across the rows (`specjax.rng`).

Rules:

- `accept_greedy`: the deepest node whose whole root path equals the target argmax at each
  parent; then the target argmax after it. Ties between equally deep paths (possible only
  when siblings repeat a token) go to the lowest node index.
- `accept_sampling`: lossless speculative sampling by the *sibling walk* (see
  `accept_sampling`); a chain is the one-child case (min(1, p/q), residual, bonus token).
- `accept_typical`: Medusa's typical acceptance. LOSSY: it does not preserve the target
  distribution, so it demands `lossy=True`.
- `accept`: one entry point dispatching on the rule (greedy when temperature == 0).
"""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from specjax.gather import take_rows
from specjax.rng import per_row
from specjax.sampling import SamplingParams, greedy_tokens, probabilities
from specjax.tree import TreeSpec
from specjax.types import AcceptResult, Draft

RULES = ("auto", "greedy", "sampling", "typical")


# ---- shared tree helpers ---------------------------------------------------------------------


def _all_ancestors(ok: jax.Array, tree: TreeSpec) -> jax.Array:
    """`[B, N]` bool: node i and every ancestor of i satisfy `ok` `[B, N]`."""
    anc = jnp.asarray(tree.node_ancestor_mask)
    return jnp.all(ok[:, None, :] | ~anc[None], axis=-1)


def _deepest(taken: jax.Array, tree: TreeSpec) -> jax.Array:
    """`[B]` int32 verify index of the deepest taken node (`taken` `[B, N]`; first on ties),
    or 0 (the root) when no node is taken."""
    depth = jnp.where(taken, jnp.asarray(tree.node_depth), 0)
    depth = jnp.concatenate([jnp.zeros_like(depth[:, :1]), depth], axis=1)
    return jnp.argmax(depth, axis=1).astype(jnp.int32)


def _result(last: jax.Array, next_token: jax.Array, tree: TreeSpec) -> AcceptResult:
    """AcceptResult for the accepted path ending at verify index `last` `[B]`."""
    return AcceptResult(
        path=jnp.asarray(tree.verify_path_table)[last],
        num_accepted=jnp.asarray(tree.verify_depth)[last],
        next_token=next_token.astype(jnp.int32),
    )


def _at_parents(x: jax.Array, tokens: jax.Array, tree: TreeSpec) -> jax.Array:
    """`[B, N]`: `x[b, parent(i) + 1, tokens[b, i]]` for per-row distributions `x` `[B, 1+N, V]`."""
    at_parent = x[:, tree.verify_parents]
    return jnp.take_along_axis(at_parent, tokens[..., None], axis=-1)[..., 0]


def _uniforms(key: jax.Array, batch: int, count: int) -> jax.Array:
    """`[B, count]` f32 uniforms in (0, 1), row b from its own key (`key`: row keys `[B, 2]` or
    one key; `specjax.rng`), from ONE PRNG call site: every rule draws all its randomness at
    once (each threefry call site adds ~0.3 s of XLA compile time on CPU)."""
    tiny = jnp.finfo(jnp.float32).tiny
    return per_row(key, batch, lambda k: jax.random.uniform(k, (count,), jnp.float32, tiny, 1.0))


def _sample(uniforms: jax.Array, probs: jax.Array) -> jax.Array:
    """`[B]` int32 Gumbel-max draws from unnormalised probs `[B, V]` given uniforms `[B, V]`."""
    gumbel = -jnp.log(-jnp.log(uniforms))
    logp = jnp.where(probs > 0, jnp.log(jnp.where(probs > 0, probs, 1.0)), -jnp.inf)
    return jnp.argmax(logp + gumbel, axis=-1).astype(jnp.int32)


# ---- greedy ----------------------------------------------------------------------------------


def accept_greedy(target_logits: jax.Array, draft: Draft, tree: TreeSpec) -> AcceptResult:
    """Longest draft path equal to the target argmax, then the target's next token.

    target_logits `[B, 1 + N, V]`; draft.tokens / draft.valid `[B, N]`. Invalid nodes (and
    their descendants) are never accepted.
    """
    target = greedy_tokens(target_logits.astype(jnp.float32))
    match = draft.valid & (draft.tokens == target[:, tree.verify_parents])
    last = _deepest(_all_ancestors(match, tree), tree)
    return _result(last, take_rows(target, last), tree)


# ---- lossless sampling -----------------------------------------------------------------------


def residual(r: jax.Array, q: jax.Array) -> jax.Array:
    """norm(max(r - q, 0)) over the last axis `[..., V]`, f32.

    Where the residual has no mass, returns `r` unchanged: that happens only when a rejection
    had probability 0 (r == q on the support, or a drafted token outside both supports).
    """
    diff = jnp.maximum(r - q, 0.0)
    mass = jnp.sum(diff, axis=-1, keepdims=True)
    return jnp.where(mass > 0.0, diff / jnp.where(mass > 0.0, mass, 1.0), r)


def without_nonfinite_nodes(draft: Draft) -> Draft:
    """The draft with every node whose reported distribution `probs [B, N, V]` holds a NaN or
    Inf made invalid (a drafter that overflowed, or a bad head): such a node is never accepted
    and its q never enters a residual, so the step stays lossless and only loses speed (the
    target draws that token itself). Without this, q = NaN would turn the residual and so the
    emitted token into garbage that looks like an answer."""
    if draft.probs is None:
        return draft
    return draft.replace(valid=draft.valid & jnp.all(jnp.isfinite(draft.probs), axis=-1))


def draft_distributions(draft: Draft, vocab_size: int, nodes=slice(None)) -> jax.Array:
    """`[B, R, V]` f32 q of the selected nodes (default all, R = N): draft.probs, or one-hot at
    the drafted token when draft.probs is None (built per use, so XLA can fuse it away)."""
    if draft.probs is None:
        return jax.nn.one_hot(draft.tokens[:, nodes], vocab_size, dtype=jnp.float32)
    return draft.probs[:, nodes].astype(jnp.float32)


def accept_sampling(
    key: jax.Array,
    target_logits: jax.Array,
    draft: Draft,
    tree: TreeSpec,
    params: SamplingParams,
) -> AcceptResult:
    """Lossless speculative sampling over a chain or a tree (multi-draft), by the sibling walk.

    p = probabilities(target_logits, params) `[B, 1 + N, V]` (temperature, top-k, top-p);
    q_i = draft.probs[:, i] `[B, V]`, assumed processed by the drafter with the same params, or
    one-hot at draft.tokens[:, i] when draft.probs is None.

    The walk starts at the root with residual r = p(root). At the current node it tries the
    valid children in sibling order: child i with token x is accepted with probability
    min(1, r(x) / q_i(x)); on acceptance the walk moves to i and r = p(i); on rejection
    r <- norm(max(r - q_i, 0)) and the next sibling is tried. When no child is accepted (or the
    node is a leaf) the next token is drawn from r. For a chain this is exactly min(1, p/q),
    the residual on reject, and the bonus token from p when everything is accepted.

    Assumption (what makes it lossless, checked statistically in tests/test_accept.py): q_i is
    the distribution node i was actually drawn from, given the context and its earlier
    siblings, and independent of the acceptance coins. This covers the drafters we have:
      * sampled children, i.i.d. with replacement: every sibling's q_i is the parent's q;
      * sampled children without replacement: q_i = q with earlier siblings' tokens removed,
        renormalised;
      * deterministic children (top-k ranks, greedy draft-model chains, n-gram, suffix;
        distinct or not): probs=None, so q_i is one-hot and the rule accepts x with
        probability r(x), and on rejection zeroes x out of r and renormalises.
    It is NOT lossless to report a soft q for tokens picked deterministically (top-k ranks,
    argmax drafting), nor the parent's q for siblings drawn without replacement: the
    statistical test shows both fail (tests/test_accept.py, MISREPORTED).

    With temperature 0, p is one-hot and the walk equals `accept_greedy` whenever valid
    siblings carry distinct tokens (with repeated sibling tokens it takes the first match,
    greedy the deepest).
    """
    return _sibling_walk(key, probabilities(target_logits, params), draft, tree, residual)


def _sibling_walk(
    key: jax.Array,
    p: jax.Array,
    draft: Draft,
    tree: TreeSpec,
    residual_fn: Callable[[jax.Array, jax.Array], jax.Array],
) -> AcceptResult:
    """The sibling walk on processed p `[B, 1 + N, V]` and the draft (see accept_sampling).

    Vectorised per sibling rank k: every verify row tries its k-th child at once, so the loop
    runs max_children times over static row/node index sets. `residual_fn` is the residual
    update (a parameter only so tests can plant a broken rule).
    """
    batch, num_nodes = draft.tokens.shape
    noise = _uniforms(key, batch, num_nodes + p.shape[-1])
    coins, next_noise = noise[:, :num_nodes], noise[:, num_nodes:]
    valid = _all_ancestors(draft.valid, tree)
    tokens = draft.tokens

    r = p  # [B, 1 + N, V]: residual at each verify row
    accepted = jnp.zeros((batch, num_nodes), bool)  # [B, N] node accepted by its parent
    done = jnp.zeros((batch, num_nodes + 1), bool)  # [B, 1 + N] row already accepted a child
    for k in range(tree.max_children):
        kids = tree.children_table[:, k]
        rows = np.nonzero(kids >= 0)[0]
        nodes = kids[rows]
        r_rows = r[:, rows]  # [B, R, V]
        q_nodes = draft_distributions(draft, p.shape[-1], nodes)  # [B, R, V]
        live = valid[:, nodes]  # [B, R]
        r_x, q_x = (jnp.take_along_axis(d, tokens[:, nodes, None], axis=-1)[..., 0]
                    for d in (r_rows, q_nodes))
        take = live & ~done[:, rows] & (coins[:, nodes] * q_x < r_x)  # P = min(1, r(x)/q(x))
        accepted = accepted.at[:, nodes].set(take)
        done = done.at[:, rows].set(done[:, rows] | take)
        r = r.at[:, rows].set(jnp.where(live[..., None], residual_fn(r_rows, q_nodes), r_rows))

    last = _deepest(_all_ancestors(accepted, tree), tree)
    return _result(last, _sample(next_noise, take_rows(r, last)), tree)


# ---- typical acceptance (lossy) ----------------------------------------------------------------


def accept_typical(
    key: jax.Array,
    target_logits: jax.Array,
    draft: Draft,
    tree: TreeSpec,
    params: SamplingParams,
    *,
    lossy: bool = False,
    epsilon: float = 0.09,
    alpha: float = 0.3,
) -> AcceptResult:
    """Medusa's typical acceptance. LOSSY: output does NOT follow the target distribution.

    Node x (child of v) passes when p_v(x) > min(epsilon, alpha * exp(-H(p_v))), with
    p = probabilities(target_logits, params) `[B, 1 + N, V]` and H its entropy. The deepest
    node whose whole path passes is accepted (first on ties), then the next token is sampled
    from p after it. With temperature 0 this reduces to `accept_greedy`.
    Requires `lossy=True` to acknowledge the distribution change.
    """
    if not lossy:
        raise ValueError("accept_typical is lossy (it changes the output distribution); "
                         "pass lossy=True to use it")
    p = probabilities(target_logits, params)
    entropy = -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0), axis=-1)
    limit = jnp.minimum(epsilon, alpha * jnp.exp(-entropy))  # [B, 1 + N]
    ok = draft.valid & (_at_parents(p, draft.tokens, tree) > limit[:, tree.verify_parents])
    last = _deepest(_all_ancestors(ok, tree), tree)
    noise = _uniforms(key, p.shape[0], p.shape[-1])
    return _result(last, _sample(noise, take_rows(p, last)), tree)


# ---- dispatch --------------------------------------------------------------------------------


def accept(
    key: jax.Array,
    target_logits: jax.Array,
    draft: Draft,
    tree: TreeSpec,
    params: SamplingParams,
    *,
    rule: str = "auto",
    lossy: bool = False,
    **typical_kwargs,
) -> AcceptResult:
    """One entry point. rule (static):

    - "auto": `accept_greedy` when params.temperature == 0, else `accept_sampling`
      (`params.branch`: only that rule when params.greedy is static, else a `lax.cond` on
      params.is_greedy);
    - "greedy" / "sampling": that rule unconditionally;
    - "typical": `accept_typical` (lossy; needs lossy=True; typical_kwargs = epsilon, alpha).
    Shapes as in the module docstring.
    """
    if rule not in RULES:
        raise ValueError(f"unknown acceptance rule {rule!r}; choose from {RULES}")
    if rule == "greedy":
        return accept_greedy(target_logits, draft, tree)
    if rule == "sampling":
        return accept_sampling(key, target_logits, draft, tree, params)
    if rule == "typical":
        return accept_typical(key, target_logits, draft, tree, params, lossy=lossy,
                              **typical_kwargs)
    return params.branch(
        lambda: accept_greedy(target_logits, draft, tree),
        lambda: accept_sampling(key, target_logits, draft, tree, params),
    )
