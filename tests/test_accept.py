"""Acceptance rules: table-driven cases, a numpy greedy reference, and statistical losslessness.

The statistical test needs no model: the "target" and the "draft" are fixed random first-order
tables p(x | prev), q(x | prev) over a vocabulary of 8, both processed with temperature 0.8,
top-k 6 and top-p 0.9. One speculative step (the drafter samples a chain or tree from q, or
picks top-k ranks deterministically; `accept_sampling` decides), completed autoregressively
from p when it emits fewer than 3 tokens, gives the first 3 tokens after a fixed context;
their joint frequencies over SAMPLES draws
are compared with the exact autoregressive joint p(a | x0) p(b | a) p(c | b) by a chi-square
test (cells with expected count < 5 pooled). A rule passes when the p-value > P_PASS = 1e-3
and the same test must give a p-value < P_FAIL = 1e-6 for a deliberately broken rule (no
residual: on rejection keep sampling from r instead of norm(max(r - q, 0))) and for drafters
that misreport q (sampled without replacement but reporting the parent's q; deterministic
top-k ranks but reporting the soft q). Seeds are fixed, so the outcome is deterministic.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import chi_square
from hypothesis import given, settings
from hypothesis import strategies as st

from specjax.accept import (
    _sibling_walk,
    accept,
    accept_greedy,
    accept_sampling,
    accept_typical,
    without_nonfinite_nodes,
)
from specjax.sampling import SamplingParams, probabilities
from specjax.tree import TreeSpec, chain, from_paths, k_ary, load_tree
from specjax.types import Draft

GREEDY = SamplingParams.make(0.0)
PEAK = 1e4  # logit margin that makes softmax exactly one-hot in f32, at any temperature <= 1


def peaked_logits(argmax, vocab):
    """`[B, 1 + N, V]` logits whose argmax (and, for T <= 1, whole distribution) is `argmax`."""
    return jax.nn.one_hot(jnp.asarray(argmax), vocab, dtype=jnp.float32) * PEAK


# ---- table-driven cases ------------------------------------------------------------------------

CHAIN3 = chain(3)
#              node:  0    1    2    3      parents (-1, -1, 0, 1)
TWO_BRANCH = from_paths([[0], [1], [0, 0], [1, 0]])
VOCAB = 8

# (name, tree, target argmax per verify row, draft tokens, valid, want path, want next token)
CASES = [
    ("perfect_match_bonus", CHAIN3, [1, 2, 3, 4], [1, 2, 3], [1, 1, 1], [0, 1, 2, 3], 4),
    ("first_token_mismatch", CHAIN3, [1, 2, 3, 4], [0, 2, 3], [1, 1, 1], [0, 0, 0, 0], 1),
    ("middle_mismatch", CHAIN3, [1, 2, 3, 4], [1, 5, 3], [1, 1, 1], [0, 1, 1, 1], 2),
    ("last_mismatch", CHAIN3, [1, 2, 3, 4], [1, 2, 7], [1, 1, 1], [0, 1, 2, 2], 3),
    ("padded_tail", CHAIN3, [1, 2, 3, 4], [1, 2, 3], [1, 1, 0], [0, 1, 2, 2], 3),
    ("invalid_parent_blocks_child", CHAIN3, [1, 2, 3, 4], [1, 2, 3], [1, 0, 1], [0, 1, 1, 1], 2),
    ("zero_length_draft", CHAIN3, [1, 2, 3, 4], [1, 2, 3], [0, 0, 0], [0, 0, 0, 0], 1),
    ("tree_first_sibling", TWO_BRANCH, [5, 6, 7, 1, 2], [5, 4, 6, 7], [1, 1, 1, 1], [0, 1, 3], 1),
    ("tree_second_sibling", TWO_BRANCH, [5, 6, 7, 1, 2], [4, 5, 6, 7], [1, 1, 1, 1], [0, 2, 4], 2),
    ("tree_second_sibling_stops", TWO_BRANCH, [5, 6, 7, 1, 2], [4, 5, 6, 0], [1, 1, 1, 1],
     [0, 2, 2], 7),
    ("tree_invalid_first_sibling", TWO_BRANCH, [5, 6, 7, 1, 2], [5, 5, 6, 7], [0, 1, 1, 1],
     [0, 2, 4], 2),
    ("tree_padded_leaf", TWO_BRANCH, [5, 6, 7, 1, 2], [4, 5, 6, 7], [1, 1, 1, 0], [0, 2, 2], 7),
    ("tree_nothing_matches", TWO_BRANCH, [5, 6, 7, 1, 2], [0, 1, 6, 7], [1, 1, 1, 1],
     [0, 0, 0], 5),
    ("tree_all_invalid", TWO_BRANCH, [5, 6, 7, 1, 2], [5, 6, 6, 7], [0, 0, 0, 0], [0, 0, 0], 5),
]


def make_case(tree, target, tokens, valid, soft_q=False):
    """One-row logits `[1, 1+N, V]` and Draft; soft_q: draft probs are a non-one-hot mix."""
    logits = peaked_logits([target], VOCAB)
    tokens = jnp.asarray([tokens], jnp.int32)
    probs = None
    if soft_q:
        probs = 0.5 * jax.nn.one_hot(tokens, VOCAB) + 0.5 / VOCAB
    return logits, Draft(tokens=tokens, valid=jnp.asarray([valid], bool), probs=probs)


def check(result, path, next_token, row=0):
    assert np.asarray(result.path[row]).tolist() == path
    assert int(result.num_accepted[row]) == len(set(path)) - 1
    assert int(result.next_token[row]) == next_token


T07 = SamplingParams.make(0.7, top_k=3, top_p=0.9)  # p is still exactly one-hot (PEAK logits)


def all_rules(key, logits, draft, params, tree):
    """Every rule on one batch (one compile per tree and draft structure). "auto" is checked
    separately (test_auto_dispatches_on_temperature) to keep compiles few."""
    return {
        "greedy": accept(key, logits, draft, tree, params, rule="greedy"),
        "sampling": accept(key, logits, draft, tree, params, rule="sampling"),
        "typical": accept(key, logits, draft, tree, params, rule="typical", lossy=True),
    }


all_rules_jit = jax.jit(all_rules, static_argnames="tree")


@functools.cache
def table_results(tree, soft_q, seed):
    """All table cases of `tree` as one batch (row r = case r) under every rule, at T=0 and at
    T=0.7: {"rule@T": AcceptResult}."""
    rows = [make_case(*c[1:5], soft_q=soft_q) for c in CASES if c[1] is tree]
    logits = jnp.concatenate([r[0] for r in rows])
    draft = jax.tree.map(lambda *xs: jnp.concatenate(xs), *[r[1] for r in rows])
    key = jax.random.PRNGKey(seed)
    return {f"{name}@{label}": result
            for label, params in (("t0", GREEDY), ("t07", T07))
            for name, result in all_rules_jit(key, logits, draft, params, tree).items()}


@pytest.mark.parametrize("soft_q", [False, True], ids=["onehot_q", "soft_q"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_table_cases(case, soft_q):
    """Each case is one row of a batch whose rows have different outcomes; every rule (greedy,
    sampling, typical; T = 0 and 0.7 on one-hot targets) must give the table's answer."""
    _, tree, _, _, _, path, next_token = case
    row = [c for c in CASES if c[1] is tree].index(case)
    for seed in range(3):
        for name, result in table_results(tree, soft_q, seed).items():
            try:
                check(result, path, next_token, row)
            except AssertionError as err:
                raise AssertionError(f"{name}, seed {seed}: {err}") from err


jit_sampling = jax.jit(accept_sampling, static_argnums=3)
jit_auto = jax.jit(lambda key, logits, draft, params, tree: accept(key, logits, draft, tree, params),
                   static_argnums=4)
jit_probabilities = jax.jit(probabilities)


def chain_batch_q_is_p(params):
    """64 rows of CHAIN3: logits `[64, 4, V]` and a Draft with x_i ~ p(parent), q = p."""
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(64, 4, VOCAB)) * 2, jnp.float32)
    p = jit_probabilities(logits, params)
    p64 = np.asarray(p[:, :3], np.float64)
    tokens = [[rng.choice(VOCAB, p=row / row.sum()) for row in rows] for rows in p64]
    draft = Draft(tokens=jnp.asarray(tokens, jnp.int32), valid=jnp.ones((64, 3), bool),
                  probs=p[:, :3])
    return logits, draft


def test_q_equal_p_accepts_everything_and_impossible_token_never():
    params = SamplingParams.make(0.9, top_k=4)
    logits, draft = chain_batch_q_is_p(params)
    result = jit_sampling(jax.random.PRNGKey(1), logits, draft, CHAIN3, params)
    np.testing.assert_array_equal(result.num_accepted, 3)
    # a token outside the target's top-k has p = 0: always rejected, and never re-emitted
    banned = jnp.argmin(logits[:, :3], axis=-1).astype(jnp.int32)
    never = Draft(tokens=banned, valid=draft.valid, probs=jax.nn.one_hot(banned, VOCAB))
    result = jit_sampling(jax.random.PRNGKey(2), logits, never, CHAIN3, params)
    np.testing.assert_array_equal(result.num_accepted, 0)
    assert not np.any(np.asarray(result.next_token) == np.asarray(banned[:, 0]))


def test_auto_dispatches_on_temperature():
    """"auto" is greedy at T=0 (on a chain the walk at T=0 is greedy too) and the sibling walk,
    with the same key, at T>0."""
    t08 = SamplingParams.make(0.8)
    logits, draft = chain_batch_q_is_p(SamplingParams.make(2.0))  # a flatter q than p
    key = jax.random.PRNGKey(5)
    for params in (GREEDY, t08):
        jax.tree.map(np.testing.assert_array_equal, jit_auto(key, logits, draft, params, CHAIN3),
                     jit_sampling(key, logits, draft, CHAIN3, params))
    sampled = jit_auto(key, logits, draft, t08, CHAIN3).num_accepted
    assert int(jnp.min(sampled)) < 3 and int(jnp.max(sampled)) == 3


def test_typical_requires_lossy_flag_and_rule_names_are_checked():
    logits, draft = make_case(*CASES[0][1:5])
    key = jax.random.PRNGKey(0)
    with pytest.raises(ValueError, match="lossy"):
        accept_typical(key, logits, draft, CHAIN3, GREEDY)
    with pytest.raises(ValueError, match="lossy"):
        accept(key, logits, draft, CHAIN3, GREEDY, rule="typical")
    with pytest.raises(ValueError, match="unknown"):
        accept(key, logits, draft, CHAIN3, GREEDY, rule="best")


def test_typical_accepts_plausible_non_argmax_tokens():
    """Lossy by design: a near-tie second choice is accepted where sampling-exactness would not
    force it."""
    logits = jnp.log(jnp.array([[[0.55, 0.45, 0, 0, 0, 0, 0, 0]] * 4]) + 1e-9)
    draft = Draft(tokens=jnp.array([[1, 1, 1]], jnp.int32), valid=jnp.ones((1, 3), bool))
    result = jax.jit(accept_typical, static_argnums=3, static_argnames="lossy")(
        jax.random.PRNGKey(0), logits, draft, CHAIN3, SamplingParams.make(1.0), lossy=True)
    assert int(result.num_accepted[0]) == 3


# ---- greedy vs a plain numpy reference ---------------------------------------------------------


def reference_greedy(parents, logits, tokens, valid):
    """Per row: deepest node whose path matches the argmax (lowest index on ties)."""
    n = len(parents)
    argmax = logits.argmax(-1)
    out = []
    for b in range(logits.shape[0]):
        taken, depth = [False] * n, [0] * n
        for i, p in enumerate(parents):
            parent_ok = p < 0 or taken[p]
            taken[i] = parent_ok and bool(valid[b, i]) and tokens[b, i] == argmax[b, p + 1]
            depth[i] = 1 if p < 0 else depth[p] + 1
        best = -1
        for i in range(n):
            if taken[i] and (best < 0 or depth[i] > depth[best]):
                best = i
        path, node = [], best
        while node >= 0:
            path.append(node + 1)
            node = parents[node]
        out.append(([0] + path[::-1], int(argmax[b, best + 1])))
    return out


@st.composite
def greedy_problems(draw, batch=4):
    """A random tree, logits `[B, 1+N, V]`, tokens that often hit the parent's argmax, valid."""
    n = draw(st.sampled_from([1, 4, 8]))  # few shapes: eager ops compile once per shape
    parents = tuple(draw(st.integers(-1, i - 1)) for i in range(n))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    vocab = 3  # fixed (with B) so eager ops only recompile per N
    logits = rng.normal(size=(batch, n + 1, vocab)).astype(np.float32)
    argmax = logits.argmax(-1)
    hit = rng.random((batch, n)) < 0.7
    tokens = np.where(hit, argmax[:, np.asarray(parents) + 1], rng.integers(0, vocab, (batch, n)))
    valid = rng.random((batch, n)) < 0.85
    return parents, logits, tokens.astype(np.int32), valid


def check_reference(result, parents, logits, tokens, valid, max_depth):
    for b, (path, nxt) in enumerate(reference_greedy(parents, logits, tokens, valid)):
        check(result, path + [path[-1]] * (max_depth + 1 - len(path)), nxt, b)


@settings(max_examples=30, deadline=None)
@given(greedy_problems())
def test_greedy_matches_numpy_reference(problem):
    parents, logits, tokens, valid = problem
    tree = TreeSpec(parents)
    draft = Draft(tokens=jnp.asarray(tokens), valid=jnp.asarray(valid))
    result = accept_greedy(jnp.asarray(logits), draft, tree)
    check_reference(result, parents, logits, tokens, valid, tree.max_depth)


def distinct_sibling_tokens(rng, tree, argmax, vocab):
    """`[B, N]` tokens, distinct among siblings, holding the parent's argmax with prob 0.8."""
    tokens = np.zeros(argmax.shape[:1] + (tree.num_nodes,), np.int32)
    for b in range(tokens.shape[0]):
        for v, kids in enumerate(tree.children):
            if not kids:
                continue
            pick = rng.permutation(vocab)[: len(kids)]
            if rng.random() < 0.8 and argmax[b, v] not in pick:
                pick[rng.integers(len(kids))] = argmax[b, v]
            tokens[b, list(kids)] = pick
    return tokens


@pytest.mark.parametrize("tree", [load_tree("eagle_small"), load_tree("kary_2x2x2")],
                         ids=lambda t: t.name)
def test_sampling_walk_at_temperature_zero_is_greedy(tree):
    """With distinct sibling tokens the sibling walk at T=0 takes exactly the greedy path."""
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(64, tree.num_nodes + 1, 5)).astype(np.float32)
    tokens = distinct_sibling_tokens(rng, tree, logits.argmax(-1), 5)
    valid = rng.random(tokens.shape) < 0.9
    draft = Draft(tokens=jnp.asarray(tokens), valid=jnp.asarray(valid))
    walk = jit_sampling(jax.random.PRNGKey(0), jnp.asarray(logits), draft, tree, GREEDY)
    check_reference(walk, tree.parents, logits, tokens, valid, tree.max_depth)
    assert int(jnp.max(walk.num_accepted)) >= 2  # the batch reaches past the first level


# ---- statistical losslessness ------------------------------------------------------------------

V_STAT = 8
SAMPLES = 40_000
P_PASS, P_FAIL = 1e-3, 1e-6
STAT_PARAMS = SamplingParams.make(0.8, top_k=6, top_p=0.9)
X0 = 5  # fixed context token (its row spreads the joint over ~100 cells with expected >= 5)
FAST_COMPILE = {"xla_backend_optimization_level": 0}  # ~2.5x faster CPU compile; runs are ms


def tables():
    """Target and draft first-order tables: raw logits `[V, V]` (row = previous token)."""
    k_t, k_d = jax.random.split(jax.random.PRNGKey(7))
    return (jax.random.normal(k_t, (V_STAT, V_STAT)), jax.random.normal(k_d, (V_STAT, V_STAT)))


def exact_joint(p_table):
    """`[V, V, V]` exact AR probability of the first three tokens after X0 (float64)."""
    p = np.asarray(p_table, np.float64)
    return p[X0][:, None, None] * p[:, :, None] * p[None, :, :]


def gumbel_max(q, noise):
    """Token id drawn from q `[V]` with Gumbel noise `[V]`."""
    return jnp.argmax(jnp.where(q > 0, jnp.log(jnp.where(q > 0, q, 1.0)), -jnp.inf) + noise)


def draw_children(gumbel, q, mode):
    """Sibling tokens from one parent's q `[V]` (Gumbel noise `[count, V]`), each with the q
    the drafter reports for it. Returns lists of tokens, probs (entries None = one-hot), valid.

    mode: "iid" (with replacement, reports q), "no_replacement" (reports q without the earlier
    siblings, renormalised: what the draw really used), "topk" (deterministic ranks, reports
    None = one-hot). Misreporting drafters, which break the rule's assumption:
    "no_replacement_parent_q" (reports the parent's q) and "topk_soft_q" (reports q).
    """
    count = len(gumbel)
    mode = mode.removesuffix("_nan_q")
    if mode.startswith("topk"):
        order = jnp.argsort(-q)
        soft = mode == "topk_soft_q"
        return ([order[k] for k in range(count)], [q if soft else None] * count,
                [q[order[k]] > 0 for k in range(count)])
    tokens, probs, valid, base = [], [], [], q
    for noise in gumbel:
        tokens.append(gumbel_max(q, noise))
        probs.append(base if mode == "no_replacement_parent_q" else q)
        valid.append(jnp.sum(q) > 0)
        if mode.startswith("no_replacement"):
            q = jnp.where(jnp.arange(V_STAT) == tokens[-1], 0.0, q)
            q = q / jnp.maximum(jnp.sum(q), 1e-30)
    return tokens, probs, valid


def propose(key, q_table, tree, mode):
    """Drafts the whole tree after X0: tokens `[N]`, probs `[N, V]` | None, valid `[N]`."""
    n = tree.num_nodes
    tokens, probs, valid = [None] * n, [None] * n, [None] * n
    gumbel = jax.random.gumbel(key, (n, V_STAT))
    for v, kids in enumerate(tree.children):
        if kids:
            q = q_table[X0 if v == 0 else tokens[v - 1]]
            got = draw_children(gumbel[np.asarray(kids)], q, mode)
            for k, node in enumerate(kids):
                tokens[node], valid[node] = got[0][k], got[2][k]
                probs[node] = got[1][k]
    stacked_probs = None if probs[0] is None else jnp.stack(probs)
    if mode.endswith("nan_q"):  # each node's q has a NaN entry with probability 1/2, independently of x
        poisoned = jax.random.bernoulli(jax.random.fold_in(key, 1), 0.5, (n,))
        stacked_probs = stacked_probs.at[:, -1].set(jnp.where(poisoned, jnp.nan, stacked_probs[:, -1]))
    return jnp.stack(tokens).astype(jnp.int32), stacked_probs, jnp.stack(valid)


def first_three(key, target_logits, p_table, q_table, tree, mode, rule):
    """One speculative step after X0 (it emits n + 1 >= 1 tokens), completed autoregressively
    from p_table when it emitted fewer than 3; returns the first 3 tokens."""
    k_draft, k_accept, k_fill = jax.random.split(key, 3)
    tokens, probs, valid = propose(k_draft, q_table, tree, mode)
    verify_logits = target_logits[jnp.concatenate([jnp.array([X0]), tokens])][None]
    draft = Draft(tokens=tokens[None], valid=valid[None],
                  probs=None if probs is None else probs[None])
    res = rule(k_accept, verify_logits, draft, tree)
    n = res.num_accepted[0]
    along = jnp.concatenate([jnp.zeros(1, jnp.int32), tokens])[res.path[0, 1:]]  # [Dmax]
    emitted = jnp.where(jnp.arange(tree.max_depth + 1) < n, jnp.pad(along, (0, 1)),
                        res.next_token[0])
    fill = jax.random.gumbel(k_fill, (3, V_STAT))
    out, prev = [], X0
    for j in range(3):
        spec = emitted[min(j, tree.max_depth)]
        out.append(jnp.where(j <= n, spec, gumbel_max(p_table[prev], fill[j])))
        prev = out[-1]
    return jnp.stack(out)


def good_rule(key, logits, draft, tree):
    return accept_sampling(key, logits, without_nonfinite_nodes(draft), tree, STAT_PARAMS)


def unguarded_rule(key, logits, draft, tree):
    """The sampler given a draft with NaN q as it is (no `without_nonfinite_nodes`)."""
    return accept_sampling(key, logits, draft, tree, STAT_PARAMS)


def broken_rule(key, logits, draft, tree):
    """No residual: after a rejection keep sampling from r, not norm(max(r - q, 0))."""
    return _sibling_walk(key, probabilities(logits, STAT_PARAMS), draft, tree, lambda r, q: r)


STAT_SETUPS = {
    "chain3_sampled": (chain(3), "iid"),
    "tree_iid": (k_ary((2, 2, 1)), "iid"),
    "tree_no_replacement": (k_ary((2, 3)), "no_replacement"),
    "tree_topk_deterministic": (from_paths([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]),
                                "topk"),
    # drafters that misreport q (the documented assumption is violated): must fail too
    "tree_no_replacement_parent_q": (k_ary((2, 3)), "no_replacement_parent_q"),
    "tree_topk_soft_q": (from_paths([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]),
                         "topk_soft_q"),
    # a drafter whose reported q is NaN at some nodes (an overflowing head): lossless only
    # through `without_nonfinite_nodes` (what the loop applies to every draft)
    "chain3_nan_q": (chain(3), "iid_nan_q"),
    "tree_nan_q": (k_ary((2, 2, 1)), "iid_nan_q"),
}
LOSSLESS = ["chain3_sampled", "tree_iid", "tree_no_replacement", "tree_topk_deterministic",
            "chain3_nan_q", "tree_nan_q"]
NAN_Q = ["chain3_nan_q", "tree_nan_q"]
MISREPORTED = ["tree_no_replacement_parent_q", "tree_topk_soft_q"]


@functools.cache
def measured(setup, rule_name):
    """(chi2, dof, p-value) of SAMPLES simulated first-3-token triples vs the exact AR joint."""
    tree, mode = STAT_SETUPS[setup]
    target_logits, draft_logits = tables()
    p_table, q_table = (probabilities(x, STAT_PARAMS) for x in (target_logits, draft_logits))
    rule = {"good": good_rule, "broken": broken_rule, "unguarded": unguarded_rule}[rule_name]
    sim = jax.vmap(lambda k: first_three(k, target_logits, p_table, q_table, tree, mode, rule))
    keys = jax.random.split(jax.random.PRNGKey(list(STAT_SETUPS).index(setup)), SAMPLES)
    compiled = jax.jit(sim).lower(keys).compile(FAST_COMPILE)
    samples = np.asarray(compiled(keys))
    return chi_square(samples, exact_joint(p_table))


def report(setup, rule_name):
    stat, dof, pvalue = measured(setup, rule_name)
    print(f"{setup} {rule_name}: chi2={stat:.1f} dof={dof} p={pvalue:.3g}")
    return pvalue


@pytest.mark.parametrize("setup", LOSSLESS)
def test_sampling_is_lossless(setup):
    assert report(setup, "good") > P_PASS


@pytest.mark.parametrize("setup", LOSSLESS)
def test_broken_rule_fails_the_same_test(setup):
    assert report(setup, "broken") < P_FAIL


@pytest.mark.parametrize("setup", MISREPORTED)
def test_misreported_draft_probs_fail_the_same_test(setup):
    """The rule is lossless only when q_i is what node i was really drawn from."""
    assert report(setup, "good") < P_FAIL


@pytest.mark.parametrize("setup", NAN_Q)
def test_nan_draft_probs_break_the_sampler_without_the_guard(setup):
    """What `without_nonfinite_nodes` prevents: one NaN entry of a node's q leaves its own token's
    acceptance test finite but silently skips the residual update after a rejection (the
    residual's mass is NaN), so the emitted tokens follow the wrong distribution (the same
    statistical test fails)."""
    assert report(setup, "unguarded") < P_FAIL
