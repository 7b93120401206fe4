"""Drafters: suffix, draft model, layerskip and the registry, on a tiny random target.

- Greedy speculative output equals plain greedy output token for token for every drafter ×
  {chain, tree}, for a batch of 4 prompts of different lengths and a single prompt, with EOS
  and max_new_tokens cutting blocks. Every case of one (drafter, tree) reuses one compiled
  program: the same batch size (the single prompt runs with 3 padding rows), buckets and
  EOS-list shape.
- Draft model = the target: everything is accepted (AL = D + 1); EOS and max_new_tokens land
  inside accepted blocks there.
- The draft model's cache is kept exactly in step: its acceptance equals that of a reference
  that rebuilds the draft cache from scratch before every step.
- Suffix decoding learns across the batches of one job.
- The draft model's sampled children (without replacement) + `accept_sampling` are lossless:
  a chi-square test of the first 3 tokens, which fails when siblings claim the parent's q.
"""
from __future__ import annotations

import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tiny_config
from scipy import stats

from specjax.accept import accept_sampling
from specjax.api import generate_ids
from specjax.drafters.draft_model import DraftModelDrafter, child_tables, draw_children
from specjax.drafters.registry import make_drafter
from specjax.loop import StopCriteria, spec_finish, spec_start_program
from specjax.models.llama import forward, init_params
from specjax.sampling import SamplingParams, probabilities
from specjax.target import as_target
from specjax.tree import chain, k_ary
from specjax.types import Draft

CFG = tiny_config(vocab_size=16)  # a small vocabulary makes outputs repeat: lookups hit
MAX_NEW = 14
PROMPTS = ((3, 4, 5, 6, 3, 4, 5, 6, 3, 4), (7, 8, 9, 7, 8, 9, 7), (2,), (5, 5, 5, 5, 5, 11, 12))
BATCH = 4
TREES = {"chain": chain(3), "tree": k_ary((2, 2, 1))}
DRAFTERS = ("suffix", "model:noisy", "layerskip:1")


def perturbed(params, scale: float, seed: int):
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    return jax.tree.unflatten(
        treedef, [x + scale * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    )


@functools.cache
def target_params():
    return init_params(CFG, jax.random.PRNGKey(0))


def loader(name: str, dtype: str):
    """`model:` loader for in-memory models: the target itself, a perturbed copy (partial
    acceptance at every depth) or one with another vocabulary."""
    models = {
        "self": (CFG, target_params()),
        "noisy": (CFG, perturbed(target_params(), 0.005, seed=5)),
        "vocab32": (tiny_config(vocab_size=32), None),
    }
    cfg, params = models[name]
    return types.SimpleNamespace(cfg=cfg, params=params, tokenizer=None)


@functools.cache
def drafter(spec: str, tree_name: str):
    return make_drafter(spec, tree=TREES[tree_name], target_cfg=CFG, target_params=target_params(),
                        loader=loader)


def run(prompts, draft=None, *, max_new=MAX_NEW, eos=(), **sampling):
    d, d_params = draft if draft is not None else (None, None)
    return generate_ids(
        CFG, target_params(), [list(p) for p in prompts], max_new_tokens=max_new,
        eos_ids=list(eos), batch_size=BATCH, draft=d, drafter_params=d_params, **sampling,
    )


@functools.cache
def plain(prompts, max_new=MAX_NEW, eos=()):
    return [(r.token_ids, r.stop_reason) for r in run(prompts, max_new=max_new, eos=eos)]


def outputs(results):
    return [(r.token_ids, r.stop_reason) for r in results]


def mid_output_eos() -> int:
    """A token first generated in the middle of some row (not in row 0's first 2 outputs)."""
    first_row = plain(PROMPTS)[0][0]
    return next(t for t in first_row[2:] if t not in first_row[:2])


# ---- greedy equivalence ----------------------------------------------------------------------


@pytest.mark.parametrize("tree_name", list(TREES))
@pytest.mark.parametrize("spec", DRAFTERS)
def test_greedy_speculative_equals_plain_greedy(spec, tree_name):
    draft = drafter(spec, tree_name)
    assert outputs(run(PROMPTS, draft)) == plain(PROMPTS)
    assert outputs(run(PROMPTS[:1], draft)) == plain(PROMPTS[:1])
    eos = (mid_output_eos(),)
    with_eos = plain(PROMPTS, eos=eos)
    assert any(reason == "eos" for _, reason in with_eos)
    assert outputs(run(PROMPTS, draft, eos=eos)) == with_eos
    assert outputs(run(PROMPTS, draft, max_new=7)) == plain(PROMPTS, max_new=7)
    sampled = run(PROMPTS, draft, temperature=0.8, top_k=5, top_p=0.9)  # the sampling program
    assert all(len(r.token_ids) == MAX_NEW for r in sampled)


# ---- draft model = target ----------------------------------------------------------------------


@pytest.mark.parametrize("tree_name", list(TREES))
def test_draft_model_equal_to_target_accepts_everything(tree_name):
    draft = make_drafter("model:self", tree=TREES[tree_name], target_cfg=CFG, loader=loader)
    depth = TREES[tree_name].max_depth
    results = run(PROMPTS, draft)
    assert outputs(results) == plain(PROMPTS)
    for r in results:
        assert r.spec["acceptance_rate"] >= 0.99, r.spec
        assert r.spec["acceptance_length"] >= 0.99 * (depth + 1), r.spec


@pytest.mark.parametrize("tree_name", list(TREES))
def test_draft_model_equal_to_target_accepts_everything_when_sampling(tree_name):
    """q = p (up to float rounding), so min(1, p/q) accepts (nearly) every draft: the draft
    probabilities reach the acceptance rule aligned with their nodes."""
    draft = make_drafter("model:self", tree=TREES[tree_name], target_cfg=CFG, loader=loader)
    for r in run(PROMPTS, draft, temperature=0.8, top_k=5, top_p=0.9):
        assert r.spec["acceptance_rate"] >= 0.95, r.spec


def test_eos_and_max_new_tokens_inside_an_accepted_block():
    """With draft = target every step accepts all D drafts, so the new tokens come as
    [prefill token] + blocks of D + 1 whose first D are accepted drafts: a cut at index k
    (0-based) with (k - 1) % (D + 1) < D falls inside the accepted part of a block."""
    draft = make_drafter("model:self", tree=TREES["chain"], target_cfg=CFG, loader=loader)
    block = TREES["chain"].max_depth + 1
    inside = lambda k: k >= 1 and (k - 1) % block < block - 1
    row = plain(PROMPTS)[1][0]
    k = next(k for k, t in enumerate(row) if inside(k) and t not in row[:k])
    got = run(PROMPTS, draft, eos=(row[k],))
    assert outputs(got) == plain(PROMPTS, eos=(row[k],))
    assert got[1].token_ids == row[: k + 1] and got[1].stop_reason == "eos"
    assert inside(6)
    got = run(PROMPTS, draft, max_new=7)
    assert outputs(got) == plain(PROMPTS, max_new=7)
    assert all(len(r.token_ids) == 7 and r.stop_reason == "length" for r in got)


@dataclasses.dataclass(frozen=True)
class FromScratchDrafter(DraftModelDrafter):
    """Reference: rebuilds the whole draft cache from the committed tokens before every step."""

    def propose(self, params, state, decode, key, sampling):
        batch, width = decode.tokens.shape
        positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
        empty = state.cache.replace(lengths=jnp.zeros((batch,), jnp.int32))
        out = forward(self.cfg, params, decode.tokens, positions, empty, compute_logits=False)
        return super().propose(params, state.replace(cache=out.cache), decode, key, sampling)


def test_draft_cache_stays_in_step_with_the_accepted_path():
    """Tree drafting with partial acceptance at every depth: the incremental draft cache
    (re-feed two tokens, compact the accepted path) drafts exactly what a from-scratch draft
    cache drafts, so the per-position acceptance counts agree row by row."""
    cached = drafter("model:noisy", "tree")
    reference = (FromScratchDrafter(tree=TREES["tree"], cfg=CFG), cached[1])
    got, want = run(PROMPTS, cached), run(PROMPTS, reference)
    assert [r.spec["accepted_per_position"] for r in got] == [
        r.spec["accepted_per_position"] for r in want]
    assert any(0 < r.spec["accepted"] < r.spec["drafted"] for r in got)


# ---- suffix ----------------------------------------------------------------------------------


def test_suffix_learns_across_batches():
    """The same 4 prompts twice, in two batches of one job: the second batch drafts from the
    first batch's outputs (the carried table) and accepts more."""
    results = run(PROMPTS + PROMPTS, drafter("suffix", "chain"))
    assert outputs(results) == plain(PROMPTS) * 2
    first = [r.spec["acceptance_length"] for r in results[:BATCH]]
    second = [r.spec["acceptance_length"] for r in results[BATCH:]]
    assert all(b > a for a, b in zip(first, second)), (first, second)
    assert min(second) >= 3.0, second


# ---- registry ---------------------------------------------------------------------------------


def test_registry_parses_specs_and_rejects_bad_ones():
    make = functools.partial(make_drafter, tree=TREES["chain"], target_cfg=CFG,
                             target_params=target_params(), loader=loader)
    ngram, _ = make("ngram:2-4")
    assert (ngram.n_min, ngram.n_max) == (2, 4)
    suffix, params = make("suffix:3")
    assert (suffix.n_min, suffix.n_max, params) == (1, 3, None)
    skip, params = make("layerskip:1")
    assert skip.cfg.num_layers == 1 and params is target_params()
    for bad, match in [("bogus", "unknown drafter"), ("layerskip:3", "1 <= K <= 2"),
                       ("layerskip:x", "integer"), ("model:vocab32", "vocabulary of 32"),
                       ("ngram:a-b", "N or A-B"), ("model", "name or path")]:
        with pytest.raises(ValueError, match=match):
            make(bad)


def test_api_rejects_a_draft_model_with_another_vocabulary():
    other = DraftModelDrafter(tree=TREES["chain"], cfg=tiny_config(vocab_size=32))
    with pytest.raises(ValueError, match="share the target's tokenizer"):
        run(PROMPTS, (other, None))


def test_tokenizer_mismatch_is_an_error():
    def tok(vocab):
        backend = types.SimpleNamespace(get_vocab=lambda with_added_tokens=True: vocab)
        return types.SimpleNamespace(backend=backend)

    def load(name, dtype):
        return types.SimpleNamespace(cfg=CFG, params=None, tokenizer=tok({"a": 0, "b": 1}))

    target = types.SimpleNamespace(cfg=CFG, params=None, tokenizer=tok({"a": 1, "b": 0}))
    with pytest.raises(ValueError, match="does not share the target's tokenizer"):
        make_drafter("model:x", tree=TREES["chain"], target=target, loader=load)
    target = types.SimpleNamespace(cfg=CFG, params=None, tokenizer=tok({"a": 0, "b": 1}))
    make_drafter("model:x", tree=TREES["chain"], target=target, loader=load)


# ---- lossless sampled children -----------------------------------------------------------------

V_STAT, X0, SAMPLES = 8, 5, 80_000
STAT_PARAMS = SamplingParams.make(0.8, top_k=6, top_p=0.9)
STAT_TREE = k_ary((3, 2))
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def propose_bigram(key, q_logits, tree, honest: bool):
    """The draft model's level loop with a first-order draft q(x | prev) `[V, V]` (raw logits)
    after X0: children from `draw_children`. honest=False makes every sibling claim its
    parent's full q (as if drawn with replacement): a broken drafter."""
    tables = child_tables(tree)
    tokens = jnp.zeros((1, tree.num_nodes), jnp.int32)
    probs = jnp.zeros((1, tree.num_nodes, V_STAT), jnp.float32)
    valid = jnp.zeros((1, tree.num_nodes), bool)
    for i, k in enumerate(jax.random.split(key, tree.max_depth)):
        prev = jnp.concatenate([jnp.full((1, 1), X0, jnp.int32), tokens], axis=1)
        parent = jnp.asarray(tables.parent[i])
        logits = q_logits[prev[:, parent]]  # [1, C, V]: each child's parent row
        cols = jnp.arange(parent.shape[0])
        tok, ok, q = draw_children(k, logits, cols, jnp.asarray(tables.ranks[i]),
                                   tables.num_ranks, STAT_PARAMS)
        if not honest:
            q = probabilities(logits, STAT_PARAMS)
        nodes = jnp.asarray(tables.nodes[i])
        tokens = tokens.at[:, nodes].set(tok, mode="drop")
        probs = probs.at[:, nodes].set(q, mode="drop")
        valid = valid.at[:, nodes].set(ok, mode="drop")
    return Draft(tokens=tokens, valid=valid, probs=probs)


def first_three(key, p_logits, q_logits, honest):
    """One speculative step after X0, completed from p when it emitted fewer than 3 tokens."""
    k_draft, k_accept, k_fill = jax.random.split(key, 3)
    draft = propose_bigram(k_draft, q_logits, STAT_TREE, honest)
    verify = p_logits[jnp.concatenate([jnp.array([X0]), draft.tokens[0]])][None]
    res = accept_sampling(k_accept, verify, draft, STAT_TREE, STAT_PARAMS)
    n = res.num_accepted[0]
    along = jnp.concatenate([jnp.zeros(1, jnp.int32), draft.tokens[0]])[res.path[0, 1:]]
    emitted = jnp.where(jnp.arange(STAT_TREE.max_depth + 1) < n, jnp.pad(along, (0, 1)),
                        res.next_token[0])
    p_table = probabilities(p_logits, STAT_PARAMS)
    fill = jax.random.gumbel(k_fill, (3, V_STAT))
    out, prev = [], X0
    for j in range(3):
        ar = jnp.argmax(jnp.log(jnp.maximum(p_table[prev], 1e-38)) + fill[j])
        out.append(jnp.where(j <= n, emitted[min(j, STAT_TREE.max_depth)], ar))
        prev = out[-1]
    return jnp.stack(out)


@functools.cache
def chi_square_pvalue(honest: bool) -> float:
    k_p, k_q, k_run = jax.random.split(jax.random.PRNGKey(11), 3)
    p_logits, q_logits = (jax.random.normal(k, (V_STAT, V_STAT)) for k in (k_p, k_q))
    keys = jax.random.split(k_run, SAMPLES)
    sim = jax.jit(jax.vmap(lambda k: first_three(k, p_logits, q_logits, honest)))
    samples = np.asarray(sim.lower(keys).compile(FAST_COMPILE)(keys))
    p = np.asarray(probabilities(p_logits, STAT_PARAMS), np.float64)
    joint = p[X0][:, None, None] * p[:, :, None] * p[None, :, :]
    observed = np.bincount(np.ravel_multi_index(samples.T, joint.shape), minlength=joint.size)
    expected = joint.ravel() * SAMPLES
    big = expected >= 5
    if observed[expected == 0].sum():
        return 0.0  # an impossible sequence was emitted
    pooled = expected[~big].sum()
    obs = np.append(observed[big], observed[~big].sum()) if pooled else observed[big]
    exp = np.append(expected[big], pooled) if pooled else expected[big]
    stat = float(np.sum((obs - exp) ** 2 / exp))
    return float(stats.chi2.sf(stat, len(obs) - 1))


def test_sampled_children_are_lossless():
    """Children drawn without replacement, each with the renormalised q it was drawn from,
    verified by the sibling walk: the first 3 tokens follow the target (p > 1e-3), and the
    same test catches siblings that claim the parent's q (p < 1e-6)."""
    assert chi_square_pvalue(honest=True) > 1e-3
    assert chi_square_pvalue(honest=False) < 1e-6


@pytest.mark.parametrize("num_ranks", [1, 3])
def test_static_greedy_children_equal_the_reference_draw(num_ranks):
    """`draw_children` under static greedy params (argmax for a chain, no distributions) picks
    the same children as the reference path (greedy only in value: top_k and the distributions
    built), on random logits with ties and a non-finite row."""
    rng = np.random.default_rng(0)
    logits = rng.integers(-3, 3, (4, 2, 16)).astype(np.float32)  # small integers: many ties
    logits[1, 0, :] = -np.inf
    logits[2, 1, 5] = np.nan
    cols = jnp.asarray([0, 0, 1] if num_ranks == 3 else [0, 1])
    ranks = jnp.asarray([0, 1, 0] if num_ranks == 3 else [0, 0])
    static = SamplingParams.make()
    traced = static.replace(greedy=None)
    key = jax.random.PRNGKey(0)
    tok, ok, probs = draw_children(key, jnp.asarray(logits), cols, ranks, num_ranks, static)
    ref_tok, ref_ok, ref_probs = draw_children(key, jnp.asarray(logits), cols, ranks, num_ranks, traced)
    assert probs is None and ref_probs is not None
    np.testing.assert_array_equal(np.asarray(ok), np.asarray(ref_ok))
    np.testing.assert_array_equal(np.asarray(tok)[np.asarray(ok)], np.asarray(ref_tok)[np.asarray(ref_ok)])


def _while_bodies(jaxpr):
    """The body jaxprs of every `while` in jaxpr, nested ones included."""
    for eqn in jaxpr.eqns:
        for sub in jax.core.jaxprs_in_params(eqn.params):
            if eqn.primitive.name == "while":
                yield sub
            yield from _while_bodies(sub)


def test_layerskip_cuts_the_stacked_layers_once_before_the_decoding_loop():
    """`loop_params`: the first K of the target's stacked layers are sliced before the decode
    loop, not in every step (XLA keeps such a slice inside the loop); the slices' result is
    what the drafter's methods take as it is."""
    skip, params = drafter("layerskip:1", "chain")
    looped = skip.loop_params(params)
    assert jax.tree.leaves(looped["params"]["layers"])[0].shape[0] == 1
    assert skip.model_params(looped) is looped
    target, width = as_target(CFG), 32
    sampling, criteria = SamplingParams.make(0.0), StopCriteria.make(())
    started = spec_start_program(
        target, target_params(), skip, params, jnp.asarray([[3, 4, 5, 6]], jnp.int32),
        jnp.asarray([4]), jnp.asarray([8]), target.init_cache(1, width),
        jnp.zeros((1, 2), jnp.uint32), sampling, criteria, width=width)
    jaxpr = jax.make_jaxpr(spec_finish, static_argnums=(0, 2))(
        target, target_params(), skip, params, started, sampling, criteria).jaxpr
    stacked = {x.shape for x in jax.tree.leaves(params["params"]["layers"])}  # [L, ...] weights
    cuts = lambda jx: [e for e in jx.eqns if e.primitive.name == "slice"
                       and e.invars[0].aval.shape in stacked and e.outvars[0].aval.shape[:1] == (1,)]
    assert cuts(jaxpr), "the cut moved: update this test"
    assert not any(cuts(body) for body in _while_bodies(jaxpr))
