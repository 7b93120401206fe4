"""num_draft="auto": the draft shape picked every step inside the program (`drafters.auto`).

Greedy output equals plain greedy while the switch visits every branch (the `rotate` test hook,
and picks driven by the cost table), through static batches and refilled slots; sampling stays
lossless (the chi-square test of test_lossless_e2e); the acceptance estimator; the cached step
costs (missing, corrupt, foreign files are profiled again, never an error); the option rules.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import chi_square, tiny_config
from hypothesis import given, settings
from hypothesis import strategies as st

from specjax import auto_costs
from specjax.api import generate_ids
from specjax.drafters.auto import (
    AutoDrafter,
    AutoParams,
    auto_lengths,
    auto_max_draft,
    observations,
    updated_estimate,
)
from specjax.drafters.draft_model import DraftModelDrafter
from specjax.drafters.forced import ForcedDrafter
from specjax.drafters.layerskip import layerskip_drafter
from specjax.drafters.ngram import NgramDrafter
from specjax.drafters.suffix import SuffixDrafter
from specjax.loop import StopCriteria, spec_finish_program, spec_start
from specjax.metrics import job_summary
from specjax.models.cache import init_cache
from specjax.models.llama import cpu_attention_reason, init_params
from specjax.options import draft_choice
from specjax.sampling import SamplingParams
from specjax.tree import chain, k_ary

PROMPTS = [[3, 4, 5, 6, 3, 4, 5, 6, 3], [7, 8, 9, 7, 8], [1, 2, 3, 1, 2, 3, 1], [5, 5, 5, 5],
           [9, 3, 9, 3, 9]]
INNER = {"ngram": (NgramDrafter(tree=chain(1)), (0, 1, 2, 4)),
         "suffix": (SuffixDrafter(tree=chain(1), log2_slots=10), (0, 1, 3))}


@functools.cache
def model():
    cfg = tiny_config(vocab_size=16)
    return cfg, init_params(cfg, jax.random.PRNGKey(0))


@functools.cache
def plain(max_new: int = 24):
    cfg, params = model()
    return [r.token_ids for r in generate_ids(cfg, params, PROMPTS, max_new_tokens=max_new, eos_ids=[])]


def auto(kind: str, step_s=None, **options):
    inner, lengths = INNER[kind]
    drafter = AutoDrafter.wrap(inner, lengths, **options)
    costs = jnp.ones(len(lengths)) if step_s is None else jnp.asarray(step_s, jnp.float32)
    return drafter, AutoParams(inner=None, step_s=costs)


def run(drafter, params, refill: bool, batch_size: int = 2, max_new: int = 24):
    cfg, target_params = model()
    return generate_ids(cfg, target_params, PROMPTS, max_new_tokens=max_new, eos_ids=[],
                        draft=drafter, drafter_params=params, refill=refill, batch_size=batch_size)


def histogram(results) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in results:
        for d, n in r.spec.get("shape_histogram", {}).items():
            out[d] = out.get(d, 0) + n
    return out


# ---- exactness while switching ------------------------------------------------------------------


@pytest.mark.parametrize("kind,refill", [("ngram", True), ("ngram", False), ("suffix", True)])
def test_greedy_auto_visiting_every_branch_equals_plain_greedy(kind, refill):
    drafter, params = auto(kind, rotate=True)
    results = run(drafter, params, refill)
    assert [r.token_ids for r in results] == plain()
    assert sorted(histogram(results), key=int) == [str(d) for d in drafter.lengths]


LEARNED = ("eagle3", "mtp", "medusa", "dflash", "dspark")


def learned(kind: str):
    """(drafter, params): an untrained head of test_learned_drafters (depth 3) on model()."""
    from test_learned_drafters import untrained

    cfg, params = model()
    return untrained(kind, cfg, params, chain(1))


def stateful(kind: str):
    """(drafter on a chain of 1, its params) of a stateful drafter kind on model()."""
    cfg, params = model()
    if kind == "layerskip":
        return layerskip_drafter(chain(1), cfg, 1), params
    if kind == "draft_model":
        draft_cfg = tiny_config(vocab_size=16, num_layers=1, name="tiny-draft")
        return DraftModelDrafter(tree=chain(1), cfg=draft_cfg), init_params(draft_cfg, jax.random.PRNGKey(5))
    return learned(kind)


@pytest.mark.parametrize("kind", ["layerskip", "draft_model", *LEARNED])
def test_greedy_auto_of_stateful_drafters_visiting_every_branch_equals_plain_greedy(kind):
    inner, inner_params = stateful(kind)
    lengths = auto_lengths(None, auto_max_draft(inner, 4))
    drafter = AutoDrafter.wrap(inner, lengths, rotate=True)
    params = AutoParams(inner=inner_params, step_s=jnp.ones(len(lengths)))
    results = run(drafter, params, refill=True)
    assert [r.token_ids for r in results] == plain()
    assert sorted(histogram(results), key=int) == [str(d) for d in drafter.lengths]


@pytest.mark.parametrize("refill", [True, False])
def test_a_perfect_draft_model_stays_in_step_through_every_branch(refill):
    """layerskip over all the target's layers drafts what the target picks: while the switch
    changes the chain length (and runs plain steps) every drafted token must be accepted,
    which holds only when the draft cache stays valid across shapes."""
    cfg, params = model()
    lengths = (0, 1, 3, 4)
    drafter = AutoDrafter.wrap(layerskip_drafter(chain(1), cfg, cfg.num_layers), lengths, rotate=True)
    results = run(drafter, AutoParams(inner=params, step_s=jnp.ones(len(lengths))), refill)
    assert [r.token_ids for r in results] == plain()
    summary = job_summary([r.spec for r in results])
    assert summary["drafted"] > 0 and summary["accepted"] == summary["drafted"], summary


def proposal_after(drafter: AutoDrafter, inner_params, prompt: list[int], branches, width=64):
    """(the committed tokens, the chain the inner drafter proposes next `[D]`, the draft
    distributions it drew them from `[D, V]`) after prefilling `prompt` (one row) and running
    the auto branches `branches` (indices) in turn, greedy."""
    from specjax.auto_costs import _forced_steps
    from specjax.loop import StopCriteria, spec_start_program
    from specjax.models.cache import init_cache
    from specjax.sampling import SamplingParams

    cfg, params = model()
    sampling, criteria = SamplingParams.make(), StopCriteria.make((), ())
    auto_params = AutoParams(inner=inner_params, step_s=jnp.ones(len(drafter.lengths)))
    started = spec_start_program(
        cfg, params, drafter, auto_params, jnp.asarray([prompt], jnp.int32),
        jnp.asarray([len(prompt)], jnp.int32), jnp.asarray([width // 2], jnp.int32),
        init_cache(cfg, 1, width), jax.random.PRNGKey(0), sampling, criteria, (), width=width)
    for b in branches:
        started = _forced_steps(cfg, params, drafter, auto_params, started, jnp.int32(b), sampling,
                                criteria, steps=1)
    state, drafter_state, _ = started
    longest = drafter.shaped(max(drafter.lengths))
    # greedy in value, not statically: a static-greedy proposal builds no distributions
    # (`draft_model.draw_children`), and they are the finer check of the state
    traced_greedy = sampling.replace(greedy=None)
    draft, _ = longest.propose(inner_params, drafter_state.inner, state, jax.random.PRNGKey(1),
                               traced_greedy)
    committed = [int(t) for t in state.tokens[0, : int(state.num_tokens[0])]]
    return committed, [int(t) for t in draft.tokens[0]], np.asarray(draft.probs[0])


@pytest.mark.parametrize("kind", ["layerskip", "draft_model", *LEARNED])
def test_the_drafter_state_after_switching_shapes_is_what_a_fresh_prefill_gives(kind):
    """A drafter's state depends on the committed tokens only, not on the shapes that committed
    them: after a history of chains of every length and plain steps, the next draft equals the
    draft of a fresh job whose prompt is the committed prefix (a stale cache or a missed
    update in a branch breaks it)."""
    inner, inner_params = stateful(kind)
    lengths = auto_lengths(None, auto_max_draft(inner, 4))
    drafter = AutoDrafter.wrap(inner, lengths)
    history = [len(lengths) - 1, 0, 1, 0, 0, len(lengths) - 2, 0, len(lengths) - 1, 1, 0]
    committed, draft, probs = proposal_after(drafter, inner_params, PROMPTS[0], history)
    fresh_committed, fresh, fresh_probs = proposal_after(drafter, inner_params, committed[:-1], [])
    assert fresh_committed == committed and fresh == draft
    np.testing.assert_allclose(probs, fresh_probs, atol=1e-4)


class NoProposals(DraftModelDrafter):
    """A draft model that must not be asked for a draft."""

    def propose(self, *args):
        raise AssertionError("a plain step asked a draft model to propose")


@pytest.mark.parametrize("kind", ["draft_model", "layerskip", "eagle3", "ngram"])
def test_a_plain_step_asks_only_lookup_drafters_for_a_proposal(kind):
    """auto's plain branch costs a plain decoding step for a drafter that runs a model to
    propose (it only syncs, and observes nothing); a lookup drafter (n-gram) proposes one
    token there and observes depth 0."""
    from specjax.loop import StopCriteria, spec_start_program
    from specjax.models.cache import init_cache
    from specjax.sampling import SamplingParams

    cfg, params = model()
    inner, inner_params = (INNER[kind][0], None) if kind == "ngram" else stateful(kind)
    drafter = AutoDrafter.wrap(inner, (0, 1))
    auto_params = AutoParams(inner=inner_params, step_s=jnp.ones(2))
    sampling, criteria = SamplingParams.make(), StopCriteria.make((), ())
    prompt = PROMPTS[0]
    state, drafter_state, metrics = spec_start_program(
        cfg, params, drafter, auto_params, jnp.asarray([prompt], jnp.int32),
        jnp.asarray([len(prompt)], jnp.int32), jnp.asarray([8], jnp.int32), init_cache(cfg, 1, 32),
        jax.random.PRNGKey(0), sampling, criteria, (), width=32)
    if kind == "draft_model":
        drafter = AutoDrafter.wrap(NoProposals(tree=chain(1), cfg=inner.cfg), (0, 1))
    plain_step = functools.partial(drafter._plain_branch, cfg, params, inner_params, sampling,
                                   criteria)
    *_, reached, hits, _, _ = jax.jit(plain_step)(state, drafter_state.inner, metrics,
                                                   drafter_state.watched, drafter_state.watch_at)
    assert drafter.inner.observe_plain_steps == (kind == "ngram")
    assert float(reached[0, 0, 0]) == (1.0 if kind == "ngram" else 0.0)  # row 0, depth 0, rank 0


@pytest.mark.parametrize("kind,every", [("ngram", 1), ("ngram", 3), ("suffix", 1), ("suffix", 4)])
def test_plain_steps_watch_a_lookup_chain_token_by_token(kind, every):
    """A lookup drafter's plain steps observe its chain one depth a step: a fresh chain's
    depth 0 against the sampled token, then while they agree depths 1, 2, ... of the same chain
    against the next steps' tokens; a miss or the chain's end takes a fresh chain, proposed on
    the first step and every `watch_every`-th (a row waiting for one observes nothing). Checked
    against a step-by-step reference over ragged rows, one of them ending early."""
    from specjax.loop import StopCriteria, spec_start_program
    from specjax.models.cache import init_cache
    from specjax.sampling import SamplingParams

    cfg, params = model()
    inner, lengths = INNER[kind]
    drafter = AutoDrafter.wrap(inner, lengths, watch_every=every)
    depth, max_depth = drafter.watch_depth, drafter.tree.max_depth
    assert depth == max(lengths)
    auto_params = AutoParams(inner=None, step_s=jnp.ones(len(lengths)))
    sampling, criteria = SamplingParams.make(), StopCriteria.make((), ())
    width, lens = 48, [len(p) for p in PROMPTS]
    padded = jnp.asarray([p + [0] * (max(lens) - len(p)) for p in PROMPTS], jnp.int32)
    max_new = jnp.asarray([30, 30, 5, 30, 30], jnp.int32)  # row 2 ends early
    state, drafter_state, metrics = spec_start_program(
        cfg, params, drafter, auto_params, padded, jnp.asarray(lens, jnp.int32), max_new,
        init_cache(cfg, len(PROMPTS), width), jax.random.PRNGKey(0), sampling, criteria,
        drafter.init_carry(auto_params), width=width)
    plain_step = jax.jit(functools.partial(drafter._plain_branch, cfg, params, None, sampling, criteria))
    propose = jax.jit(lambda inner_state, state: drafter.shaped(depth).propose(
        None, inner_state, state, None, sampling)[0])
    inner_state, watched, watch_at = drafter_state.inner, drafter_state.watched, drafter_state.watch_at
    chains = [None] * len(PROMPTS)  # the reference: each row's chain under watch and its depth
    at = [0] * len(PROMPTS)
    hits_seen = deep_seen = waits = 0
    for step in range(20):
        draft = propose(inner_state, state)
        fresh = np.where(np.asarray(draft.valid), np.asarray(draft.tokens), -1)
        active = ~np.asarray(state.done)
        proposing = step == 0 or int(state.step) % every == 0
        state, inner_state, metrics, reached, hits, watched, watch_at = plain_step(
            state, inner_state, metrics, watched, watch_at, first=step == 0)
        tokens = np.asarray(state.last_token)
        for row in range(len(PROMPTS)):
            waiting = at[row] == 0 and not proposing
            if at[row] == 0:
                chains[row] = fresh[row]
            expect_reached = np.zeros((max_depth, drafter.num_ranks))
            expect_hits = np.zeros_like(expect_reached)
            waits += waiting and active[row]
            if active[row] and not waiting:
                hit = chains[row][at[row]] >= 0 and chains[row][at[row]] == tokens[row]
                expect_reached[at[row], 0], expect_hits[at[row], 0] = 1.0, float(hit)
                hits_seen += hit
                deep_seen += at[row] > 0
                at[row] = at[row] + 1 if hit and at[row] + 1 < depth else 0
            np.testing.assert_array_equal(np.asarray(reached[row]), expect_reached)
            np.testing.assert_array_equal(np.asarray(hits[row]), expect_hits)
        assert list(np.asarray(watch_at)) == at
    assert hits_seen and deep_seen  # the test's rows repeat themselves: the chains are followed
    assert (waits > 0) == (every > 1)


def test_a_lookup_drafters_job_starts_with_a_plain_step():
    """With nothing observed, a lookup drafter's first step is plain (`plain_first`): it
    observes depth 0 of every row for free; then the cost table's pick. A model drafter's
    plain steps observe nothing, so it starts at the pick."""
    free_drafts = [1.0] * 4
    drafter, params = auto("ngram", free_drafts)
    results = run(drafter, params, refill=False, batch_size=8)
    assert [r.token_ids for r in results] == plain()
    assert histogram(results)["0"] == len(PROMPTS)  # one batch, one plain step of each row
    drafter, params = auto("ngram", free_drafts, plain_first=False)
    assert "0" not in histogram(run(drafter, params, refill=False, batch_size=8))


def test_greedy_auto_picking_by_cost_equals_plain_greedy_and_follows_the_costs():
    drafter, _ = auto("ngram")
    cheap_plain = AutoParams(inner=None, step_s=jnp.asarray([1e-3, 1.0, 1.0, 1.0]))
    results = run(drafter, cheap_plain, refill=True)
    assert [r.token_ids for r in results] == plain() and set(histogram(results)) == {"0"}
    free_drafts = AutoParams(inner=None, step_s=jnp.asarray([1.0, 1.0, 1.0, 1.0]))
    results = run(drafter, free_drafts, refill=True)
    assert [r.token_ids for r in results] == plain() and histogram(results)["0"] <= 2  # plain_first
    spec = results[0].spec
    assert spec["predicted_tokens_per_s"] == pytest.approx(spec["predicted_tokens"] / spec["predicted_s"])


def test_a_branch_keeps_stepping_while_it_stays_the_pick_and_the_slot_counters_follow():
    """Where plain steps are cheapest auto takes only plain steps, several per switch (one
    switch per change of shape, `switched_step`): the refilled job's slot counters (decoding
    steps, busy slot-steps, refills) are then exactly plain decoding's, which counts one step
    per call."""
    from specjax.timing import job_stats

    drafter, _ = auto("ngram")
    cheap_plain = AutoParams(inner=None, step_s=jnp.asarray([1e-3, 1.0, 1.0, 1.0]))
    cfg, target_params = model()
    prompts = PROMPTS + [[2, 3]]
    ends = [24, 5, 17, 9, 30, 3]
    auto_rows = generate_ids(cfg, target_params, prompts, max_new_tokens=ends, eos_ids=[],
                             draft=drafter, drafter_params=cheap_plain, batch_size=2)
    plain_rows = generate_ids(cfg, target_params, prompts, max_new_tokens=ends, eos_ids=[],
                              batch_size=2)
    assert [r.token_ids for r in auto_rows] == [r.token_ids for r in plain_rows]
    ours, theirs = job_stats(auto_rows), job_stats(plain_rows)
    assert (ours.decode_steps, ours.busy_slot_steps, ours.refills) == (
        theirs.decode_steps, theirs.busy_slot_steps, theirs.refills)
    assert ours.decode_steps > 30  # the longest row alone

    from specjax.loop import StopCriteria, spec_start_program
    from specjax.models.cache import init_cache
    from specjax.sampling import SamplingParams

    sampling, criteria = SamplingParams.make(), StopCriteria.make((), ())
    state, drafter_state, metrics = spec_start_program(
        cfg, target_params, drafter, cheap_plain, jnp.asarray([PROMPTS[0]], jnp.int32),
        jnp.asarray([len(PROMPTS[0])], jnp.int32), jnp.asarray([12], jnp.int32),
        init_cache(cfg, 1, 32), jax.random.PRNGKey(0), sampling, criteria, (), width=32)
    after = jax.jit(drafter.switched_step, static_argnums=(0,))(
        cfg, target_params, cheap_plain, state, drafter_state, metrics, sampling, criteria)[0]
    assert int(after.step) - int(state.step) == 11 and bool(after.done[0])  # one call: to the end


def test_the_pick_follows_the_estimate_and_the_active_rows():
    drafter, params = auto("ngram", step_s=[1.0, 1.3, 1.35, 1.5])
    state = drafter.init(params, 2, 16)
    active = jnp.asarray([True, False])
    hopeless = state.replace(conditional=jnp.zeros_like(state.conditional))
    certain = state.replace(conditional=jnp.ones_like(state.conditional))
    assert int(jnp.argmax(drafter.predicted(params, hopeless, active)[0])) == 0
    assert int(jnp.argmax(drafter.predicted(params, certain, active)[0])) == len(drafter.lengths) - 1
    tokens_per_s, per_step = drafter.predicted(params, certain, jnp.asarray([True, True]))
    np.testing.assert_allclose(per_step, [1, 2, 3, 5])
    np.testing.assert_allclose(tokens_per_s, 2 * per_step / params.step_s, rtol=1e-6)


def test_a_draft_shape_must_beat_plain_decoding_by_min_gain():
    drafter, params = auto("ngram", step_s=[1.0, 1.3, 1.35, 1.5])
    state = drafter.init(params, 2, 16)
    state = state.replace(conditional=jnp.full_like(state.conditional, 0.4),
                          job_seen=jnp.ones_like(state.job_seen))  # past plain_first's free look
    decode = types.SimpleNamespace(done=jnp.zeros(2, bool), tokens=jnp.zeros((2, 16), jnp.int32),
                                   step=jnp.int32(0), max_new=jnp.full(2, 9), num_new=jnp.zeros(2, int))
    tokens_per_s = np.asarray(drafter.predicted(params, state, ~decode.done)[0])
    best = int(np.argmax(tokens_per_s))
    margin = tokens_per_s[best] / tokens_per_s[0] - 1.0
    assert best > 0 and margin > 0.02
    for min_gain, picked in [(0.0, best), (margin - 0.01, best), (margin + 0.01, 0)]:
        gated = dataclasses.replace(drafter, min_gain=min_gain)
        assert int(gated.pick(params, state, decode)[0]) == picked, min_gain
    with pytest.raises(ValueError, match="min_gain"):
        dataclasses.replace(drafter, min_gain=-0.1)


# ---- sampling stays lossless ----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("rotate", [True, False, "tree"], ids=["rotate", "picked", "picked-tree"])
def test_sampling_with_auto_matches_plain_sampling(rotate):
    from test_lossless_e2e import PROMPT, TEMPERATURE, TOP_K, TOP_P, models

    target_cfg, target_params, _, _ = models()
    # picked: plain steps cost more than drafting, so the spec branches run from the start
    params = AutoParams(inner=None, step_s=jnp.asarray([3.0, 1.0, 1.0]))
    if rotate == "tree":  # picked: the tree (top-2, then top-1 after each) is the cheap branch
        drafter = AutoDrafter.wrap(NgramDrafter(tree=chain(1)), (0, 2), trees=(k_ary((2, 1)),))
        params = AutoParams(inner=None, step_s=jnp.asarray([3.0, 3.0, 1.0]))
    else:
        drafter = AutoDrafter.wrap(NgramDrafter(tree=chain(1)), (0, 1, 2), rotate=rotate)
    samples = []
    for seed in range(3):
        out = generate_ids(target_cfg, target_params, [PROMPT + PROMPT] * 4096, max_new_tokens=3,
                           temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P, seed=seed, eos_ids=[],
                           batch_size=4096, draft=drafter, drafter_params=params)
        samples += [r.token_ids for r in out]
    stat, dof, p = chi_square(np.asarray(samples), double_prompt_joint())
    assert p > 1e-3, f"chi2={stat:.1f} dof={dof} p={p:.3g}"
    hist = histogram(out)
    if rotate == "tree":  # a plain first step (plain_first), then the cheap tree
        assert sorted(hist) == ["0", "tree0"] and hist["0"] == len(out)
    elif rotate:  # step % 3: a row's 3 tokens take at most two steps (D = 0, then D = 1)
        assert sorted(hist) == ["0", "1"]
    else:  # picked: a plain first step (plain_first), then the cheap long chain
        assert sorted(hist) == ["0", "2"] and hist["0"] == len(out)


@functools.cache
def double_prompt_joint():
    """The exact joint of the first three tokens after PROMPT + PROMPT (plain sampling)."""
    from test_lossless_e2e import PROMPT, TEMPERATURE, TOP_K, TOP_P, VOCAB, models

    from specjax.models.cache import init_cache
    from specjax.models.llama import forward
    from specjax.sampling import SamplingParams, probabilities

    cfg, params, _, _ = models()
    sampling = SamplingParams.make(TEMPERATURE, TOP_K, TOP_P)
    prompt = PROMPT + PROMPT

    def next_probs(prefixes):
        n, length = prefixes.shape
        out = forward(cfg, params, jnp.asarray(prefixes, jnp.int32),
                      jnp.broadcast_to(jnp.arange(length), (n, length)), init_cache(cfg, n, length))
        return np.asarray(probabilities(out.logits[:, -1], sampling), np.float64)

    grid = np.array(np.meshgrid(*[np.arange(VOCAB)] * 2, indexing="ij")).reshape(2, -1).T
    p1 = next_probs(np.array([prompt]))[0]
    p2 = next_probs(np.array([prompt + [a] for a in range(VOCAB)]))
    p3 = next_probs(np.array([prompt + list(ab) for ab in grid])).reshape(VOCAB, VOCAB, VOCAB)
    return p1[:, None, None] * p2[:, :, None] * p3


# ---- the estimator --------------------------------------------------------------------------------


def test_the_pick_sums_each_rows_own_expected_tokens():
    """One row that accepts everything pays for drafting for the batch where the average of
    the two rows' acceptance would not (E of the mean estimate is below the mean of the Es)."""
    drafter, params = auto("ngram", step_s=[1.0, 1.5, 1.75, 2.5])  # D = 0, 1, 2, 4
    state = drafter.init(params, 2, 16)
    active = jnp.asarray([True, True])
    mixed = state.replace(conditional=jnp.asarray([[1.0] * 4, [0.0] * 4]))
    tokens_per_s, per_step = drafter.predicted(params, mixed, active)
    np.testing.assert_allclose(per_step, [1.0, 1.5, 2.0, 3.0])  # (1 + (1 + D)) / 2 rows
    assert int(jnp.argmax(tokens_per_s)) == 3  # 6 tokens / 2.5 s beats 2 / 1.0
    averaged = state.replace(conditional=jnp.full((2, 4), 0.5))
    assert int(jnp.argmax(drafter.predicted(params, averaged, active)[0])) == 0
    only_second = drafter.predicted(params, mixed, jnp.asarray([False, True]))[0]
    assert int(jnp.argmax(only_second)) == 0


def test_a_draining_job_picks_the_soonest_end_of_its_slowest_row():
    """While no queued prompt takes a freed slot (`AutoState.draining`: a static batch, a
    refilling job's last call with its queue empty) the job ends with its slowest row: a row
    that accepts everything does not pay for drafting when the other, as far from its end,
    accepts nothing; it does when the other is a token from its end. With prompts queued the
    pick sums the rows' tokens (`predicted`)."""
    from specjax.refill import draining

    drafter, params = auto("ngram", step_s=[1.0, 1.5, 1.75, 2.5])  # D = 0, 1, 2, 4
    state = drafter.init(params, 2, 16)
    assert bool(state.draining)  # a static batch drains from the start
    state = state.replace(job_seen=jnp.ones_like(state.job_seen))  # past plain_first's free look
    mixed = state.replace(conditional=jnp.asarray([[1.0] * 4, [0.0] * 4]))
    decode = lambda left: types.SimpleNamespace(
        done=jnp.zeros(2, bool), tokens=jnp.zeros((2, 16), jnp.int32), step=jnp.int32(0),
        max_new=jnp.asarray(left), num_new=jnp.zeros(2, jnp.int32))
    assert int(drafter.pick(params, drafter.draining(mixed, False), decode([20, 20]))[0]) == 3
    assert int(drafter.pick(params, mixed, decode([20, 20]))[0]) == 0
    assert int(drafter.pick(params, mixed, decode([20, 1]))[0]) == 3
    np.testing.assert_allclose(drafter.finish_rates(params, mixed, decode([20, 1])),
                               [1 / 20, 2 / 20 / 1.5, 3 / 20 / 1.75, 5 / 20 / 2.5], rtol=1e-6)
    ended = types.SimpleNamespace(**vars(decode([20, 20])) | {"done": jnp.asarray([False, True])})
    assert int(drafter.pick(params, mixed, ended)[0]) == 3  # an ended row is nobody's bottleneck
    queue = types.SimpleNamespace(size=jnp.int32(5))
    at = lambda taken: types.SimpleNamespace(next_prompt=jnp.int32(taken))
    assert [bool(draining(at(n), queue, last)) for n, last in [(3, True), (5, True), (5, False)]] == [
        False, True, False]


def test_rows_keep_their_own_estimate_and_a_refilled_row_starts_from_the_jobs():
    drafter, params = auto("ngram")
    state = drafter.init(params, 3, 16)
    # one step of chain 4 where row 0 accepted all, row 1 none, row 2 is inactive
    reached, hits = observations(jnp.asarray([True, True, False]), jnp.asarray([4, 0, 0]), 4,
                                 drafter.tree.max_depth)
    rows, seen = updated_estimate(state.conditional, state.seen[..., 0], reached, hits, 0.5, 0.9, 0.01, 2.0)
    job, job_seen = updated_estimate(state.job[:, 0], state.job_seen[:, 0], reached.sum(0), hits.sum(0),
                                     0.5, 0.9, 0.01, 2.0)
    assert float(rows[0, 0]) > 0.5 > float(rows[1, 0]) and float(rows[2, 0]) == 0.5
    moved = state.replace(conditional=rows, job=state.job.at[:, 0].set(job),
                          seen=state.seen.at[..., 0].set(seen), job_seen=state.job_seen.at[:, 0].set(job_seen))
    new_rows = types.SimpleNamespace(tokens=jnp.zeros((2, 16), jnp.int32))  # the 2 new rows' decode
    refilled = drafter.refill(params, moved, new_rows, None, jnp.asarray([1, 7]))  # 7: unused
    np.testing.assert_allclose(refilled.conditional[1], job)
    np.testing.assert_allclose(refilled.conditional[0], rows[0])
    np.testing.assert_allclose(refilled.conditional[2], rows[2])
    np.testing.assert_array_equal(refilled.seen[1], 0.0)  # the job's estimate, weighted as a prior
    np.testing.assert_array_equal(refilled.seen[0, :, 0], seen[0])


def test_observations_count_rows_reaching_each_depth():
    active = jnp.asarray([True, True, True, False])
    accepted = jnp.asarray([0, 2, 4, 4])
    reached, hits = observations(active, accepted, num_draft=4, max_depth=6)
    assert reached.shape == hits.shape == (4, 6)  # per row
    np.testing.assert_array_equal(reached[1], [1, 1, 1, 0, 0, 0])
    np.testing.assert_array_equal(hits[1], [1, 1, 0, 0, 0, 0])
    np.testing.assert_array_equal(reached.sum(0), [3, 2, 2, 1, 0, 0])
    np.testing.assert_array_equal(hits.sum(0), [2, 2, 1, 1, 0, 0])


def test_the_estimate_is_an_ema_per_observation_and_unobserved_depths_relax_to_the_prior():
    cond, seen = jnp.asarray([0.5, 0.2]), jnp.asarray([10.0, 10.0])  # past the prior's weight
    new, now = updated_estimate(cond, seen, jnp.asarray([2.0, 0.0]), jnp.asarray([2.0, 0.0]),
                                prior=0.6, decay=0.9, relax=0.1, prior_weight=2.0)
    np.testing.assert_allclose(new, [0.81 * 0.5 + 0.19 * 1.0, 0.2 + 0.1 * 0.4], rtol=1e-6)
    np.testing.assert_array_equal(now, [10.0, 10.0])  # capped at the EMA's window


@given(st.lists(st.booleans(), min_size=1, max_size=30), st.floats(0.0, 1.0), st.floats(0.5, 8.0))
@settings(max_examples=40, deadline=None)
def test_the_first_observations_weigh_against_the_prior_as_a_beta_mean(outcomes, prior, weight):
    """One observation at a time: the estimate keeps min(decay, (weight + n) / (weight + n + 1))
    of its old value at the n-th; so while weight + n < 9 (decay 0.9) it is the mean of the
    prior's `weight` pseudo-observations and the outcomes (a Beta posterior's mean)."""
    decay, est, seen, reference = 0.9, jnp.float32(prior), jnp.float32(0.0), prior
    beta_steps = sum(weight + n < 9 for n in range(len(outcomes)))
    for n, hit in enumerate(outcomes):
        est, seen = updated_estimate(est, seen, jnp.float32(1.0), jnp.float32(hit), prior, decay,
                                     0.01, weight)
        keep = min(decay, (weight + n) / (weight + n + 1))
        reference = keep * reference + (1 - keep) * float(hit)
        np.testing.assert_allclose(float(est), reference, rtol=1e-5, atol=1e-6)
        if n + 1 == beta_steps:
            np.testing.assert_allclose(float(est), (weight * prior + sum(outcomes[: n + 1])) / (weight + n + 1),
                                       rtol=1e-5, atol=1e-6)
    assert float(seen) == min(len(outcomes), 10)


def test_two_misses_from_the_default_prior_reach_a_quarter():
    drafter, params = auto("ngram")
    state = drafter.init(params, 1, 16)
    est, seen = state.conditional, state.seen[..., 0]
    for _ in range(2):
        est, seen = updated_estimate(est, seen, jnp.ones_like(est), jnp.zeros_like(est), drafter.prior,
                                     drafter.decay, drafter.relax, drafter.prior_weight)
    np.testing.assert_allclose(est, 0.25, rtol=1e-6)


def test_auto_lengths_add_the_tile_points_in_range():
    assert auto_lengths(None) == (0, 1, 2, 4, 8)
    assert auto_lengths(16) == (0, 1, 2, 4, 7, 8)  # 128/16 - 1 = 7; 16 x 8 = 128: D = 7
    assert auto_lengths(32) == (0, 1, 2, 3, 4, 7, 8)  # 128/32 - 1 = 3; 32 x 4, 32 x 8: D = 3, 7
    assert auto_lengths(3) == (0, 1, 2, 4, 8)  # SmolLM2: 128/3 - 1 = 41, out of range


# ---- the cost cache -------------------------------------------------------------------------------


@pytest.fixture
def fake_profiler(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
    calls = []

    def profile(target, params, drafter, inner_params, batch_size, *, context, width, **_):
        calls.append((batch_size, width))
        return [0.001 * (1 + d) * (1 + width / 1000) for d in drafter.lengths]

    monkeypatch.setattr(auto_costs, "profile_step_costs", profile)
    return calls


def costs_now(lines=None):
    cfg, params = model()
    drafter, _ = auto("ngram")
    return auto_costs.step_costs(cfg, params, drafter, None, 4, log=(lines if lines is not None else []).append), drafter


def test_costs_are_profiled_once_then_read_from_the_cache(fake_profiler):
    lines = []
    first, drafter = costs_now(lines)
    profiled = [(4, auto_costs.profile_width(drafter, c)) for c in auto_costs.CONTEXTS]
    assert fake_profiler == profiled and any("profiling the step costs" in line for line in lines)
    second, _ = costs_now()
    assert second == first and fake_profiler == profiled
    widths, step_s = first
    assert widths == [auto_costs.profile_width(drafter, c) for c in auto_costs.CONTEXTS]
    assert len(step_s) == len(widths) and all(len(at) == len(drafter.lengths) for at in step_s)


def test_the_cost_key_names_the_mesh_the_weights_are_sharded_over():
    """A sharded job's steps cost what its mesh makes them cost: its key is not a one-device
    job's."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    cfg, params = model()
    drafter, _ = auto("ngram")
    mesh = Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("dp", "tp"))
    sharded = jax.device_put(params, NamedSharding(mesh, PartitionSpec()))
    assert auto_costs.mesh_of(params) is None
    assert auto_costs.mesh_of(sharded) == {"dp": 1, "tp": 1}
    assert auto_costs.cost_key(cfg, drafter, 4, sharded) != auto_costs.cost_key(cfg, drafter, 4, params)


def test_every_process_of_a_job_takes_process_zeros_decision_and_costs(fake_profiler, monkeypatch,
                                                                        tmp_path):
    """A job over several processes runs one program across them: every process profiles as
    process 0 decided (a process whose disk lacks the file does not profile alone) and prices
    the branches at process 0's costs (each times its own steps), faked here as two processes
    run one after the other."""
    single, _ = costs_now()  # one process: its own file, its own costs
    monkeypatch.setattr(auto_costs, "spans_processes", lambda params: True)
    sent = []
    monkeypatch.setattr(auto_costs.multihost_utils, "broadcast_one_to_all",
                        lambda value: sent.append(np.asarray(value)) or value)
    zero, _ = costs_now()  # process 0: reads its file
    for path in tmp_path.rglob("*.json"):
        path.unlink()  # process 1: another host's disk, no file
    received = iter(sent)
    monkeypatch.setattr(auto_costs.multihost_utils, "broadcast_one_to_all", lambda value: next(received))
    profiles = len(fake_profiler)
    one, _ = costs_now()
    assert len(fake_profiler) == profiles  # no profile of its own
    np.testing.assert_allclose(one[1], zero[1], rtol=1e-6)
    np.testing.assert_allclose(zero[1], single[1], rtol=1e-6)

    for path in tmp_path.rglob("*.json"):
        path.unlink()  # now no process has a file: both profile, each on its own clock
    sent.clear()
    monkeypatch.setattr(auto_costs.multihost_utils, "broadcast_one_to_all",
                        lambda value: sent.append(np.asarray(value)) or value)
    zero, _ = costs_now()
    for path in tmp_path.rglob("*.json"):
        path.unlink()
    slower = auto_costs.profile_step_costs
    monkeypatch.setattr(auto_costs, "profile_step_costs", lambda *a, **k: [2 * s for s in slower(*a, **k)])
    received = iter(sent)
    monkeypatch.setattr(auto_costs.multihost_utils, "broadcast_one_to_all", lambda value: next(received))
    one, _ = costs_now()
    assert len(fake_profiler) == profiles + 2 * len(auto_costs.CONTEXTS)  # both profiled
    np.testing.assert_allclose(one[1], zero[1], rtol=1e-6)  # at process 0's costs


@pytest.mark.parametrize("content", ["{not json", json.dumps([1, 2]), json.dumps({"key": {}}), "",
                                     "FOREIGN", "OTHER_OPTIONS", "MALFORMED", "NEGATIVE", "BAD_NOISE"])
def test_a_bad_cost_file_is_profiled_again_with_a_warning(fake_profiler, content):
    _, drafter = costs_now()
    cfg, _ = model()
    key = auto_costs.cost_key(cfg, drafter, 4)
    path = auto_costs.cost_path(key)
    if content == "FOREIGN":
        content = json.dumps({"key": key | {"device_kind": "TPU v9"}, "step_s": [1.0] * 4})
    elif content == "OTHER_OPTIONS":  # profiled with programs compiled under other XLA options
        assert key["compile_options"] == {
            "xla_cpu_enable_concurrency_optimized_scheduler": "False",
            "xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED",
            "xla_cpu_use_fusion_emitters": "False"}
        content = json.dumps({"key": key | {"compile_options": {}}, "step_s": [1.0] * 4})
    elif content == "MALFORMED":  # a cost per branch, but one context only (version 3's layout)
        content = json.dumps({"key": key, "step_s": [1.0] * 4})
    elif content == "BAD_NOISE":
        content = json.dumps({"key": key, "step_s": [[1.0] * 4, [1.0] * 4], "noise": "busy"})
    elif content == "NEGATIVE":
        content = json.dumps({"key": key, "step_s": [[1.0] * 4, [1.0, -1.0, 1.0, 1.0]]})
    path.write_text(content)
    with pytest.warns(UserWarning, match="profiling again"):
        (_, step_s), _ = costs_now()
    assert fake_profiler == [(4, auto_costs.profile_width(drafter, c)) for c in auto_costs.CONTEXTS] * 2
    assert len(step_s[0]) == 4
    assert json.loads(path.read_text())["key"] == key


def test_a_noisy_profile_is_taken_again_by_the_next_runs_and_the_steadiest_kept(monkeypatch, tmp_path):
    """A profile whose rounds scatter (a busy machine) serves its job and its process; the next
    REPROFILES processes profile again and keep the steadier costs; after them, and after a
    quiet profile, the file is read."""
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
    noises = iter([0.20, 0.11, 0.30, 0.25, 0.15, 0.12])  # two widths a profile: its noise, the larger
    calls = []

    def profile(target, params, drafter, inner_params, batch_size, *, context, width, phases, **_):
        noise = next(noises)
        phases["noise"] = noise
        calls.append(noise)
        return [noise * (1 + d) for d in drafter.lengths]  # each profile's own costs

    monkeypatch.setattr(auto_costs, "profile_step_costs", profile)
    runs = []
    for _ in range(5):  # each run a new process
        monkeypatch.setattr(auto_costs, "PROFILED_HERE", set())
        lines = []
        (_, step_s), drafter = costs_now(lines)
        if not runs:  # the process that profiled reads its noisy costs from then on
            assert costs_now()[0][1][0][0] == 0.20 and len(calls) == 2
        runs.append((step_s[0][0], len(calls), lines))
    # run 1: noise 0.20, kept (1 profile); run 2: 0.30 > 0.20, the first kept (2 profiles);
    # run 3: 0.15, kept (3 profiles); runs 4, 5: read, no profiling
    assert [(cost, n) for cost, n, _ in runs] == [(0.20, 2), (0.20, 4), (0.15, 6), (0.15, 6), (0.15, 6)]
    assert any("profiles again (at most 2 more times)" in line for line in runs[0][2])
    assert any("profiling the step costs" in line and "uncertain to +-20 %, profile 2 of at most 3" in line
               for line in runs[1][2])
    assert any("kept the earlier profile's costs" in line for line in runs[1][2])
    assert runs[3][2] == []
    kept = json.loads(auto_costs.cost_path(auto_costs.cost_key(model()[0], drafter, 4)).read_text())
    assert kept["profiles"] == 3 and kept["noise"] == 0.15
    # a quiet profile is never taken again
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "quiet"))
    noises = iter([0.01, 0.02])
    costs_now()
    monkeypatch.setattr(auto_costs, "PROFILED_HERE", set())
    costs_now()
    assert calls[6:] == [0.01, 0.02]


def test_ratio_noise_is_the_largest_relative_standard_error_of_a_branchs_median():
    rounds = np.array([[1.0, 1.2, 2.0], [1.0, 1.3, 2.0], [1.0, 1.4, 2.0], [1.0, 1.5, 2.0]])
    q75, q25 = np.percentile(rounds[:, 1], [75, 25])
    assert auto_costs.ratio_noise(rounds) == pytest.approx(0.93 * (q75 - q25) / 2 / 1.35)
    assert auto_costs.ratio_noise(np.ones((5, 3))) == 0.0


def test_the_wide_profile_caches_few_tokens_where_attention_reads_the_whole_buffer():
    """XLA's attention costs what the cache width makes it cost, however much is filled: the
    wide width is profiled over CONTEXT cached tokens. A Pallas kernel (the target's or a draft
    model's) stops at each row's length, and a target of its own class has its own attention:
    there the tokens are cached for real."""
    cfg, _ = model()
    xla = dataclasses.replace(cfg, attention_impl="xla")
    pallas = dataclasses.replace(cfg, attention_impl="pallas")
    wide = max(auto_costs.CONTEXTS)
    assert auto_costs.cached_tokens(xla, wide) == auto_costs.CONTEXT
    assert auto_costs.cached_tokens(xla, 16) == 16
    assert auto_costs.cached_tokens(pallas, wide) == wide
    ngram = AutoDrafter.wrap(NgramDrafter(tree=chain(1)), (0, 1))
    assert auto_costs.cached_tokens(xla, wide, ngram) == auto_costs.CONTEXT
    for draft_cfg, cached in ((xla, auto_costs.CONTEXT), (pallas, wide)):
        drafter = AutoDrafter.wrap(DraftModelDrafter(tree=chain(1), cfg=draft_cfg), (0, 1))
        assert auto_costs.cached_tokens(xla, wide, drafter) == cached

    @dataclasses.dataclass(frozen=True)
    class Opaque:  # a TargetModel of its own, carrying a ModelConfig it may not attend by
        cfg: object = xla
        vocab_size, eos_token_ids, max_position_embeddings = cfg.vocab_size, (), 64
        init_cache = forward = None

    assert auto_costs.cached_tokens(Opaque(), wide) == wide
    if cpu_attention_reason(cfg) is None:  # the CPU kernel (auto's pick here) stops at the length too
        assert auto_costs.cached_tokens(dataclasses.replace(cfg, attention_impl="auto"), wide) == wide
        assert auto_costs.cached_tokens(xla, wide, AutoDrafter.wrap(
            DraftModelDrafter(tree=chain(1), cfg=dataclasses.replace(cfg, attention_impl="cpu")), (0, 1))) == wide


def test_a_lookup_drafters_profile_stands_its_context_in_without_a_prefill_of_it(monkeypatch):
    """n-gram and suffix hold nothing the target computes: the profile prefills CONTEXT tokens
    and stands the rest of a wider context in (the same tokens, lengths and prompt as a
    prefill of all of them; the forced steps run on from it). A draft model is prefilled
    whole: its own cache needs the target's pass over the context."""
    cfg, params = model()
    context, width = auto_costs.CONTEXT + 20, auto_costs.CONTEXT + 40
    sampling, criteria = SamplingParams.make(), StopCriteria.make((), ())
    prompts = []
    real_start = auto_costs.spec_start_program
    monkeypatch.setattr(auto_costs, "spec_start_program", lambda *args, **kw: (
        prompts.append(args[4].shape[1]), real_start(*args, **kw))[1])

    def started(drafter, fill=None, inner=None):
        costs = AutoParams(inner=inner, step_s=jnp.ones(drafter.num_shapes))
        return auto_costs.started_state(cfg, params, drafter, costs, 2, context, width, sampling,
                                        criteria, fill)

    ngram = AutoDrafter.wrap(NgramDrafter(tree=chain(1)), (0, 2))
    (stood, _, _), (prefilled, _, _) = started(ngram), started(ngram, fill=False)
    assert prompts == [auto_costs.CONTEXT, context]
    motif = auto_costs.motif_tokens(cfg, 2, context + 1)
    np.testing.assert_array_equal(stood.tokens[:, :context + 1], motif)
    np.testing.assert_array_equal(prefilled.tokens[:, :context], motif[:, :context])
    for state in (stood, prefilled):
        assert state.num_tokens.tolist() == [context + 1] * 2 and state.prompt_lens.tolist() == [context] * 2
        assert state.cache.lengths.tolist() == [context] * 2
    state, _, _ = auto_costs._forced_steps(cfg, params, ngram, AutoParams(None, jnp.ones(2)),
                                           started(ngram), jnp.int32(1), sampling, criteria, jnp.int32(2))
    assert (state.num_tokens > context + 2).all() and (state.cache.lengths == state.num_tokens - 1).all()
    assert not state.done.any()
    prompts.clear()
    started(AutoDrafter.wrap(DraftModelDrafter(tree=chain(1), cfg=cfg), (0, 1)), inner=params)
    assert prompts == [context]
    assert SuffixDrafter.state_from_tokens and not DraftModelDrafter.state_from_tokens


def test_costs_from_a_latency_profile():
    profile = {"target_s": {"4": {"1": 0.010, "5": 0.014}}, "ar_step_s": {"4": 0.011},
               "draft_s": {"4": {"2": 0.001}}, "step_s": {"4": {"4": 0.020}}}
    got = auto_costs.costs_from_profile(profile, 4, (0, 2, 4))
    assert got == pytest.approx([0.011, 0.012 + 0.001, 0.020])


# ---- options --------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["ngram", "suffix:1-4", "layerskip:1", "model:tiny",
                                  "eagle3:dir", "mtp:dir", "medusa:dir", "dflash:dir", "dspark:dir"])
def test_auto_is_the_greedy_default_for_every_drafter_kind(spec):
    assert draft_choice(spec).auto and draft_choice(spec, num_draft="auto").auto
    assert not draft_choice(spec, num_draft=4).auto
    assert not draft_choice(spec, tree="kary_2x2x2").auto
    assert not draft_choice(spec, sampled=True).auto and draft_choice(spec, sampled=True).tree.num_nodes == 4
    assert draft_choice(spec, num_draft="auto", sampled=True).auto


def test_auto_option_rules():
    assert not draft_choice("forced:0.5").auto and draft_choice("forced:0.5").tree.num_nodes == 4
    with pytest.raises(ValueError, match="does not drive the forced drafter"):
        draft_choice("forced:0.5", num_draft="auto")
    with pytest.raises(ValueError, match="not both"):
        draft_choice("ngram", num_draft="auto", tree="kary_2x2x2")
    drafter = DraftModelDrafter(tree=chain(2), cfg=tiny_config())
    assert draft_choice(drafter, num_draft="auto").tree == chain(8)
    with pytest.raises(ValueError, match="num_draft='auto' needs"):
        draft_choice(ForcedDrafter(tree=chain(2)), num_draft="auto")


def test_a_drafter_that_drafts_less_deep_gets_shorter_chains():
    cfg, params = model()
    drafter, _ = learned("medusa")  # 3 heads
    assert auto_max_draft(drafter) == 3 and auto_lengths(None, 3) == (0, 1, 2, 3)
    assert draft_choice(drafter, num_draft="auto").tree == chain(3)
    assert auto_max_draft(NgramDrafter(tree=chain(1))) == 8


def test_the_api_default_profiles_once_and_equals_plain_greedy(fake_profiler):
    cfg, params = model()
    out = generate_ids(cfg, params, PROMPTS, max_new_tokens=24, eos_ids=[], draft="ngram",
                       batch_size=2)
    assert [r.token_ids for r in out] == plain()
    assert [b for b, _ in fake_profiler] == [2] * len(auto_costs.CONTEXTS)
    assert histogram(out)


def test_step_costs_follow_the_programs_cache_width():
    """Costs profiled at two widths: on the line through them, at the narrow width's below it;
    width-free costs are the same at every width."""
    params = AutoParams(None, jnp.asarray([[1.0, 2.0], [3.0, 3.0]]), jnp.asarray([100.0, 500.0]))
    assert params.costs_at(100).tolist() == [1.0, 2.0]
    assert params.costs_at(300).tolist() == pytest.approx([2.0, 2.5])
    assert params.costs_at(900).tolist() == pytest.approx([5.0, 4.0])  # extrapolated
    assert params.costs_at(10).tolist() == [1.0, 2.0]
    assert AutoParams(None, jnp.asarray([1.0, 2.0])).costs_at(900).tolist() == [1.0, 2.0]


def test_the_pick_prices_branches_at_the_programs_width():
    """A chain that pays on a narrow cache but not a wide one (its cost grows faster)."""
    drafter, _ = auto("ngram")
    params = AutoParams(None, jnp.asarray([[1.0, 1.2, 1.4, 1.6], [2.0, 4.0, 5.0, 6.0]]),
                        jnp.asarray([100.0, 1000.0]))
    state = drafter.init(params, 2, 8)
    state = state.replace(conditional=jnp.full_like(state.conditional, 0.5))
    active = jnp.asarray([True, True])
    assert int(jnp.argmax(drafter.predicted(params, state, active, 100)[0])) > 0
    assert int(jnp.argmax(drafter.predicted(params, state, active, 1000)[0])) == 0


# ---- what the metrics and bench report -------------------------------------------------------------


def test_job_summaries_sum_the_shape_histograms_and_predictions():
    from specjax.measure.bench import auto_section
    from specjax.metrics import job_summary, summarize

    rows = [summarize(4, 6, 3, [2, 1], [2, 1, 1], 8.0, 0.5), summarize(2, 2, 0, [0, 0], [1, 1, 0], 3.0, 0.6)]
    job = job_summary(rows)
    assert job["shape_histogram"] == {"0": 3, "1": 2, "2": 1}
    assert job["predicted_tokens_per_s"] == pytest.approx(11.0 / 1.1)
    section = auto_section(job, {"decode_tokens_per_s": 5.0})
    assert section["predicted_over_measured"] == pytest.approx(2.0)
    assert "shape_histogram" not in summarize(4, 6, 3, [2, 1]) and auto_section(summarize(1, 1, 1, [1]), {}) == {}


def test_auto_summaries_are_plain_json():
    """A row's auto fields go into the generate JSONL as they are: no numpy scalars."""
    from specjax.metrics import auto_summary

    summary = auto_summary(np.asarray([3, 0, 2], np.int32), np.float32(7.5), np.float32(2.5))
    assert json.loads(json.dumps(summary)) == {"shape_histogram": {"0": 3, "2": 2},
                                               "predicted_tokens": 7.5, "predicted_s": 2.5,
                                               "predicted_tokens_per_s": 3.0}


# ---- tree branches -----------------------------------------------------------------------------


def test_a_trees_expected_tokens_come_from_the_depth_and_rank_estimates():
    from specjax.costmodel import chain_tokens_per_steps, tree_tokens_per_step
    from specjax.tree import load_tree

    conditional = np.asarray([0.6, 0.5, 0.4, 0.3])
    assert tree_tokens_per_step(conditional, np.zeros((4, 1)), chain(3)) == pytest.approx(
        chain_tokens_per_steps(conditional, (3,))[0])
    # top-2 at every depth, rank-1 conditional 0.5: P(depth j accepted) = q0 + (1 - q0) 0.5
    got = tree_tokens_per_step(jnp.asarray(conditional), jnp.full((4, 1), 0.5), load_tree("kary_2x2x2"))
    assert float(got) == pytest.approx(1 + 0.8 + 0.8 * 0.75 + 0.8 * 0.75 * 0.7, rel=1e-6)


def test_tree_observations_count_each_rank_reached_and_hit():
    from specjax.drafters.auto import tree_observations
    from specjax.tree import load_tree

    tree = load_tree("kary_2x2x2")  # verify rows: 1, 2 depth 1 (ranks 0, 1); 3..6 depth 2
    rank1 = 1 + tree.children[0][1]  # the root's rank-1 child (verify index)
    rank1_rank0 = 1 + tree.children[rank1][0]
    path = jnp.asarray([[0, rank1, rank1_rank0, 0], [0, 0, 0, 0], [0, 1, 0, 0]])
    reached, hits = tree_observations(jnp.asarray([True, True, False]), path,
                                      jnp.asarray([2, 0, 1]), tree, max_depth=4, num_ranks=2)
    # row 0: depth 0 rank 1 hit (rank 0 missed), depth 1 rank 0 hit, depth 2: both children missed
    # row 1: depth 0, both ranks missed; row 2 inactive
    np.testing.assert_array_equal(reached.sum(0), [[2, 2], [1, 0], [1, 1], [0, 0]])
    np.testing.assert_array_equal(hits.sum(0), [[0, 1], [1, 0], [0, 0], [0, 0]])
    np.testing.assert_array_equal(reached[1], [[1, 1], [0, 0], [0, 0], [0, 0]])
    assert not reached[2].any() and not hits[2].any()


@pytest.mark.parametrize("kind", ["ngram", "draft_model", "eagle3"])
def test_greedy_auto_with_tree_branches_visiting_every_branch_equals_plain_greedy(kind):
    from specjax.tree import load_tree

    inner, inner_params = (NgramDrafter(tree=chain(1)), None) if kind == "ngram" else stateful(kind)
    trees = (load_tree("kary_2x2x2"), k_ary((2, 1), name="2x1"))
    drafter = AutoDrafter.wrap(inner, (0, 1, 3), trees=trees, rotate=True)
    assert drafter.tree.num_nodes == 14 and drafter.tree.max_depth == 3
    params = AutoParams(inner=inner_params, step_s=jnp.ones(5))
    results = run(drafter, params, refill=True)
    assert [r.token_ids for r in results] == plain()
    assert set(histogram(results)) == {"0", "1", "3", "tree0", "tree1"}


def test_the_pick_takes_a_tree_when_second_candidates_pay():
    from specjax.tree import load_tree

    drafter = AutoDrafter.wrap(NgramDrafter(tree=chain(1)), (0, 1, 3), trees=(load_tree("kary_2x2x2"),))
    params = AutoParams(inner=None, step_s=jnp.asarray([1.0, 1.1, 1.2, 1.3]))
    state = drafter.init(params, 2, 16)
    assert state.siblings.shape == (2, 3, 1)
    active = jnp.asarray([True, True])
    weak_top = state.replace(conditional=jnp.full((2, 3), 0.4), siblings=jnp.full((2, 3, 1), 0.9))
    assert int(jnp.argmax(drafter.predicted(params, weak_top, active)[0])) == 3
    no_second = weak_top.replace(siblings=jnp.zeros((2, 3, 1)))
    assert int(jnp.argmax(drafter.predicted(params, no_second, active)[0])) != 3


def test_the_profile_times_tree_branches_too():
    from specjax.tree import load_tree

    cfg, params = model()
    drafter = AutoDrafter.wrap(NgramDrafter(tree=chain(1)), (0, 3), trees=(load_tree("kary_2x2x2"),))
    phases = {}
    step_s = auto_costs.profile_step_costs(cfg, params, drafter, None, 2, steps=2, rounds=1, phases=phases)
    assert len(step_s) == 3 and all(s > 0 for s in step_s) and phases["first_call_s"] > 0
    key = auto_costs.cost_key(cfg, drafter, 2)
    assert key["trees"][0][0] == "kary_2x2x2"


def test_the_profile_takes_each_branchs_median_ratio_to_the_plain_step(monkeypatch):
    """Each round times every branch's call of 4 steps (the order reversed every other round)
    and the plain branch's call of 1; what a call costs besides its steps (the median of the
    plain branch's intercepts) is left out; a branch's cost is its median per-round ratio to
    the plain step times the plain step's median: a round slowed as a whole (the machine's
    load drifting) and a burst in one call are both left out (the clock is scripted: a call
    of n steps of branch b in round r takes load[r] x (0.5 + n x cost[b]) + burst)."""
    cfg, params = model()
    drafter = AutoDrafter.wrap(NgramDrafter(tree=chain(1)), (0, 1))
    cost, load, burst = {0: 1.0, 1: 1.5}, [1.0, 2.0, 1.0], {(2, 1): 9.0}
    clock, calls = [0.0], []

    def rewound(*args):
        branch, steps = int(args[7]), int(args[10])
        if not calls:  # the first call compiles
            clock[0] += 99.0
        else:
            r = sum(1 for _, n in calls[1:] if n == 1)
            clock[0] += load[r] * (0.5 + steps * cost[branch]) + burst.get((r, branch), 0.0)
        calls.append((branch, steps))
        return args[5]

    monkeypatch.setattr(auto_costs, "_rewound_steps", rewound)
    monkeypatch.setattr(auto_costs, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    phases = {}
    step_s = auto_costs.profile_step_costs(cfg, params, drafter, None, 2, steps=4, rounds=3,
                                           budget_s=1e9, phases=phases)
    assert step_s == pytest.approx([1.0, 1.5]) and phases["first_call_s"] == 99.0
    assert phases["call_s"] == pytest.approx(0.5) and phases["rounds"] == 3
    # per-round ratios 1.5, 12.5 / 8.5 (the loaded round, its call cost not scaled) and the
    # burst's 3.75: the file would be profiled again
    iqr = (1.5 + 3.75) / 2 - (12.5 / 8.5 + 1.5) / 2
    assert phases["noise"] == pytest.approx(0.93 * iqr / 3 ** 0.5 / 1.5) and phases["noise"] > auto_costs.NOISY
    assert calls[1:] == [(0, 4), (1, 4), (0, 1), (1, 4), (0, 4), (0, 1), (0, 4), (1, 4), (0, 1)]
    calls.clear()
    auto_costs.profile_step_costs(cfg, params, drafter, None, 2, steps=4, rounds=9, budget_s=0.0,
                                  phases=phases)
    assert phases["rounds"] == auto_costs.MIN_ROUNDS
    with pytest.raises(ValueError, match="steps >= 2"):
        auto_costs.profile_step_costs(cfg, params, drafter, None, 2, steps=1)


def test_profile_calls_start_from_the_same_state_and_write_the_caches_in_place():
    """`_rewound_steps` runs the forced steps from the start whose large leaves (the caches)
    it takes donated and returns: every call gives what the first did (the counts and lengths
    are the start's each time), and the buffers passed in are consumed, not copied."""
    cfg, params = model()
    drafter = AutoDrafter.wrap(NgramDrafter(tree=chain(1)), (0, 2))
    costs = AutoParams(None, jnp.ones(2))
    sampling, criteria = SamplingParams.make(), StopCriteria.make((), ())
    started = auto_costs.started_state(cfg, params, drafter, costs, 2, 16, 64, sampling, criteria)
    layout = auto_costs.Donated.of(started, min_bytes=1024)
    kept, buffers = layout.parts(started)
    cache = started[0].cache
    assert [b.shape for b in buffers] == [cache.k.shape, cache.v.shape]
    assert jax.tree.structure(layout.joined(kept, buffers)) == jax.tree.structure(started)
    expected = layout.parts(auto_costs._forced_steps(cfg, params, drafter, costs, started,
                                                     jnp.int32(2), sampling, criteria, jnp.int32(3)))[1]
    passed = jax.tree.map(jnp.copy, buffers)
    for _ in range(2):
        out = auto_costs._rewound_steps(cfg, params, drafter, costs, kept, passed, layout,
                                        jnp.int32(2), sampling, criteria, jnp.int32(3))
        assert all(b.is_deleted() for b in passed)
        for got, want in zip(out, expected):
            np.testing.assert_array_equal(got, want)
        passed = out
    assert not any(b.is_deleted() for b in buffers)


def test_chain_costs_are_made_non_decreasing_in_the_draft_length():
    assert auto_costs.monotone([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    assert auto_costs.monotone([265.0, 292.0, 246.0, 354.0]) == pytest.approx([265.0, 269.0, 269.0, 354.0])
    assert auto_costs.monotone([3.0, 2.0, 1.0]) == pytest.approx([2.0, 2.0, 2.0])


def test_the_adaptive_benchmark_cell_times_every_mode_and_prices_decode_alone(fake_profiler):
    from helpers import load_benchmark

    adaptive = load_benchmark("adaptive")
    cfg, params = model()
    variants = adaptive.parse_variants(["gate:min_gain=100"])
    c = adaptive.cell(types.SimpleNamespace(cfg=cfg, params=params), PROMPTS[:2], 2, 8, "ngram",
                      repeats=1, turn=0, static=(1, 2), variants=variants)
    assert set(c["tokens_per_s"]) == {"plain", "auto", "gate", "D=1", "D=2"}
    assert c["variant_shape_histograms"]["gate"] == {"0": sum(c["variant_shape_histograms"]["gate"].values())}
    assert c["auto_decode_tokens_per_s"] > 0 and c["auto_predicted_over_measured_decode"] > 0
    assert c["auto_over_plain_paired"] == pytest.approx(c["runs"]["auto"][0] / c["runs"]["plain"][0])
    assert adaptive.paired([3.0, 1.0, 2.0], [1.0, 1.0, 4.0]) == 1.0
    with pytest.raises(SystemExit, match="no field"):
        adaptive.parse_variants(["bad:no_such_field=1"])


# ---- a lookup drafter's chains in one loop (`AutoDrafter.merged`) -------------------------------


@pytest.mark.parametrize("kind", ["ngram", "suffix"])
@pytest.mark.parametrize("options", [{"rotate": True}, {"step_s": [1.0, 0.2, 0.6, 0.9]}],
                         ids=["rotate", "picked"])
def test_merged_chains_step_as_a_loop_per_chain_does(kind, options):
    """The chains in one loop at the longest, the pick's length as data (nodes deeper dead),
    give the tokens and shape counts that a loop per chain length gives (the same picks), and
    greedy equals plain greedy."""
    options = dict(options)
    step_s = options.pop("step_s", None)
    if step_s is not None:
        step_s = step_s[: len(INNER[kind][1])]
    merged, params = auto(kind, step_s, merge_rows=64, **options)  # merged at run's 2 rows
    assert merged.merged(2) and not dataclasses.replace(merged, merge=False).merged(2)
    together = run(merged, params, refill=True)
    apart = run(dataclasses.replace(merged, merge=False), params, refill=True)
    assert [r.token_ids for r in together] == [r.token_ids for r in apart] == plain()
    assert histogram(together) == histogram(apart)
    assert [r.spec["accepted"] for r in together] == [r.spec["accepted"] for r in apart]


def test_model_drafters_keep_a_loop_per_chain():
    """A drafter that runs a model to propose pays for its length: no merged loop."""
    inner, _ = stateful("draft_model")
    assert not AutoDrafter.wrap(inner, (0, 1, 2, 4)).merged(1)
    assert not AutoDrafter.wrap(NgramDrafter(tree=chain(1)), (0, 4)).merged(1)  # one chain: nothing to merge


def test_lookup_chains_merge_where_the_verify_is_narrow():
    """The chains share one loop only where the merged verify holds at most `merge_rows` rows:
    one row of a chain of 8 (9 rows), not 8 rows (72: dead rows cost XLA's per-row work)."""
    drafter = AutoDrafter.wrap(NgramDrafter(tree=chain(1)), (0, 1, 2, 4, 8))
    assert drafter.merged(1) and not drafter.merged(2) and not drafter.merged(8)
    assert dataclasses.replace(drafter, merge_rows=72).merged(8)
    assert drafter.merged_verify_rows(1) == 9 and drafter.merged_verify_rows(8) == 72


@pytest.mark.skipif(cpu_attention_reason(model()[0]) is not None, reason="the CPU attention kernel is needed")
def test_the_merged_program_compiles_two_target_forwards():
    """The decode program of merged chains calls the target's attention twice (the plain step's
    forward, the chains' forward), a loop per chain once per shape."""
    cfg, params = model()
    drafter, costs = auto("ngram")
    criteria = StopCriteria.make()
    sampling = SamplingParams.make(temperature=0.0)
    forwards = {}
    for merge in (True, False):
        d = dataclasses.replace(drafter, merge=merge)
        started = jax.eval_shape(functools.partial(_started, cfg, params, d, costs, sampling, criteria))
        text = spec_finish_program.lower(cfg, params, d, costs, started, sampling, criteria).as_text()
        forwards[merge] = text.count("specjax_cache_attention")
    assert forwards == {True: 2, False: len(drafter.lengths)}


def _started(cfg, params, drafter, costs, sampling, criteria):
    prompts = jnp.asarray([[3, 4, 5, 6]], jnp.int32)
    return spec_start(cfg, params, drafter, costs, prompts, jnp.asarray([4]), jnp.asarray([8]),
                      init_cache(cfg, 1, 32), jax.random.PRNGKey(0), sampling, criteria, width=24)
