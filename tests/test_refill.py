"""Continuous batching inside the one program (`specjax.refill`): exactness and reproducibility.

- greedy: every prompt of a ragged queue (prompt lengths 1..11, max_new 1..14, rows ending at
  once, a queue shorter than B, Q not a multiple of B) decoded through the refilling loop
  equals the prompt decoded alone (plain greedy, a static batch of one), for plain decoding and
  every drafter kind (ngram, suffix, a draft model, layerskip, EAGLE-3, MTP, Medusa, DFlash,
  DSpark with random heads), chains and trees, under both refill policies.
- sampling: the same seed gives the same rows at batch sizes 1, 4 and 8 (AR and ngram), and the
  refilling loop stays lossless (the chi-square test of tests/test_lossless_e2e.py, run with
  slots refilled many times).
"""
from __future__ import annotations

import collections
import functools
import types

import jax
import numpy as np
import pytest
from helpers import tiny_config

from specjax.api import generate_ids, iter_generate_ids, length_groups
from specjax.drafters.learned.drafting import drafter_params
from specjax.drafters.learned.registry import init_head, make_head_config, make_learned_drafter
from specjax.drafters.registry import make_drafter
from specjax.loop import STOP_REASONS, StopCriteria
from specjax.metrics import row_summaries
from specjax.models.llama import init_params
from specjax.refill import PromptQueue, RefillPolicy, refill_program, slots_program
from specjax.rng import job_row_keys, seed_key
from specjax.sampling import SamplingParams
from specjax.target import as_target
from specjax.timing import JobStats, job_stats
from specjax.tree import chain, k_ary

VOCAB = 16
CFG = tiny_config(vocab_size=VOCAB)
PROMPT_WIDTH, MAX_NEW_BUCKET = 16, 16
SLOTS = 4
CHAIN, TREE = chain(3), k_ary((2, 2, 1), max_nodes=7)
POLICIES = {"one": RefillPolicy(rows=1, min_free=1), "batch": RefillPolicy(rows=SLOTS, min_free=2),
            "fill": RefillPolicy(rows=1, min_free=1, batch_fill_from=SLOTS)}  # B-row first pass


@functools.cache
def params():
    return init_params(CFG, jax.random.PRNGKey(0))


def ragged_job(count: int = 11, seed: int = 0):
    """(prompts, max_new): lengths 1..11, max_new 1..14 with several 1s and several 14s."""
    rng = np.random.default_rng(seed)
    prompts = [[int(t) for t in rng.integers(0, VOCAB, rng.integers(1, 12))] for _ in range(count)]
    max_new = [int(m) for m in rng.choice([1, 2, 5, 9, 14, 14], count)]
    max_new[0] = 1
    return prompts, max_new


def run_queue(prompts, max_new, draft=None, *, policy=POLICIES["one"], slots=SLOTS, eos=(),
              sampling=None, seed=0, capacity=16, chunk=None):
    """[(new tokens, stop reason)] of each prompt through `refill_program`, and its counters
    summed over the calls (with `.spec`: each prompt's speculative summary, when speculating).
    chunk: prompts per queue (default: all in one); the slots go from call to call."""
    drafter, dparams = draft if draft is not None else (None, None)
    margin = 0 if drafter is None else drafter.tree.num_nodes + 1
    width = PROMPT_WIDTH + MAX_NEW_BUCKET + margin
    keys = job_row_keys(seed_key(seed), list(range(len(prompts))))
    carry = () if drafter is None else drafter.init_carry(dparams)
    state = slots_program(drafter, dparams, as_target(CFG).init_cache(slots, width), carry,
                          width=width)
    chunk = chunk or len(prompts)
    ended, totals, per_call = {}, collections.Counter(), []
    for first in range(0, len(prompts), chunk):
        part = slice(first, first + chunk)
        queue = PromptQueue.build(prompts[part], max_new[part], keys[part], capacity, PROMPT_WIDTH,
                                  first=first)
        out, counters, state = refill_program(
            CFG, params(), drafter, dparams, queue, state, sampling or SamplingParams.make(0.0),
            StopCriteria.make(eos, ()), first + chunk >= len(prompts), policy=policy)
        out, counters = jax.device_get((out, counters))
        totals.update({k: int(v) for k, v in vars(counters).items()})
        per_call.append(int(out.count))
        summaries = None if out.metrics is None else row_summaries(out.metrics, int(out.count))
        for i in range(int(out.count)):
            job_index = int(out.prompt[i])
            assert job_index not in ended  # every row ends once
            row = (out.tokens[i, len(prompts[job_index]): out.num_tokens[i]].tolist(),
                   STOP_REASONS[int(out.stop_reason[i])])
            ended[job_index] = (row, None if summaries is None else summaries[i])
    assert sorted(ended) == list(range(len(prompts)))
    rows = [ended[j][0] for j in range(len(prompts))]
    spec = None if drafter is None else [ended[j][1] for j in range(len(prompts))]
    return rows, types.SimpleNamespace(**totals, spec=spec, ended_per_call=per_call)


@functools.cache
def alone(prompt: tuple[int, ...], max_new: int, eos: tuple[int, ...] = ()):
    """(new tokens, stop reason) of plain greedy decoding of the prompt alone (a batch of 1)."""
    result = generate_ids(CFG, params(), [list(prompt)], max_new_tokens=max_new, eos_ids=list(eos),
                          batch_size=1, refill=False)[0]
    return result.token_ids, result.stop_reason


def expected(prompts, max_new, eos=()):
    return [alone(tuple(p), m, tuple(eos)) for p, m in zip(prompts, max_new)]


# ---- drafters ----------------------------------------------------------------------------------

HEAD_OPTIONS = {
    "eagle3": {"ttt_steps": 3}, "mtp": {"ttt_steps": 3}, "medusa": {"num_heads": 3},
    "dflash": {"block_size": 4, "num_anchors": 8}, "dspark": {"block_size": 4, "num_anchors": 8},
}


def loader(name: str, dtype: str):
    """`model:noisy`: the target with perturbed weights (partial acceptance); `model:self`:
    the target itself (every draft accepted)."""
    if name == "self":
        return types.SimpleNamespace(cfg=CFG, params=params(), tokenizer=None)
    leaves, treedef = jax.tree.flatten(params())
    keys = jax.random.split(jax.random.PRNGKey(5), len(leaves))
    noisy = jax.tree.unflatten(treedef, [x + 0.005 * jax.random.normal(k, x.shape, x.dtype)
                                         for x, k in zip(leaves, keys)])
    return types.SimpleNamespace(cfg=CFG, params=noisy, tokenizer=None)


@functools.cache
def drafter(spec: str, tree_name: str):
    """(drafter, params) of a registry spec or a learned kind with a random head."""
    tree = {"chain": CHAIN, "tree": TREE}[tree_name]
    if spec in HEAD_OPTIONS:
        head = make_head_config(spec, CFG, **HEAD_OPTIONS[spec])
        variables = init_head(head, jax.random.PRNGKey(1))
        return make_learned_drafter(head, tree), drafter_params(variables, params(), head)
    return make_drafter(spec, tree=tree, target_cfg=CFG, target_params=params(), loader=loader)


# ---- greedy exactness ----------------------------------------------------------------------------


@pytest.mark.parametrize("policy", list(POLICIES))
def test_plain_greedy_through_refill_equals_each_prompt_alone(policy):
    prompts, max_new = ragged_job()
    rows, counters = run_queue(prompts, max_new, policy=POLICIES[policy])
    assert rows == expected(prompts, max_new)
    calls, counters = run_queue(prompts, max_new, policy=POLICIES[policy], chunk=3)  # 4 calls
    assert calls == rows
    assert counters.ended_per_call[0] < 3 < counters.ended_per_call[-1]  # rows carried on
    assert counters.prefilled == len(prompts)
    assert 0 < counters.busy_slot_steps <= counters.decode_steps * SLOTS


def test_rows_ending_at_once_on_eos_and_short_queues():
    prompts, max_new = ragged_job()
    eos = (alone(tuple(prompts[2]), 14)[0][1],)  # a token some rows emit early
    rows, _ = run_queue(prompts, max_new, eos=eos)
    assert rows == expected(prompts, max_new, eos)
    assert any(reason == "eos" for _, reason in rows)
    few = prompts[:3]  # fewer prompts than slots
    rows, counters = run_queue(few, max_new[:3], slots=SLOTS)
    assert rows == expected(few, max_new[:3]) and counters.prefilled == 3


@pytest.mark.parametrize("spec,tree_name", [
    ("ngram", "chain"), ("ngram", "tree"), ("suffix", "chain"), ("suffix", "tree"),
    ("model:noisy", "chain"), ("model:noisy", "tree"), ("layerskip:1", "chain"),
    ("layerskip:1", "tree"), ("eagle3", "chain"), ("eagle3", "tree"), ("mtp", "chain"),
    ("medusa", "tree"), ("dflash", "chain"), ("dspark", "tree"),
])
def test_speculative_greedy_through_refill_equals_each_prompt_alone(spec, tree_name):
    """Through three calls (queues of 4 prompts): the slots, their rows and the drafter's state
    and carry go from call to call."""
    prompts, max_new = ragged_job()
    rows, counters = run_queue(prompts, max_new, drafter(spec, tree_name), chunk=4,
                               policy=POLICIES["fill"])
    assert rows == expected(prompts, max_new)
    # the first pass fills the SLOTS slots, then one prompt per pass: none skipped
    assert counters.prefilled == len(prompts) and counters.refills == len(prompts) - SLOTS + 1


def test_speculative_greedy_with_batched_refills():
    prompts, max_new = ragged_job(13, seed=1)
    for spec in ("suffix", "model:noisy"):
        rows, _ = run_queue(prompts, max_new, drafter(spec, "tree"), policy=POLICIES["batch"])
        assert rows == expected(prompts, max_new), spec


@pytest.mark.parametrize("spec", ["model:self", "layerskip:2"])
def test_a_drafter_equal_to_the_target_accepts_everything_after_refills(spec):
    """The refilled rows' drafter state is started afresh (a stale draft cache would reject)
    and each prompt's counters are its own (harvested with the row, zeroed on refill)."""
    prompts, max_new = ragged_job()
    rows, counters = run_queue(prompts, max_new, drafter(spec, "tree"))
    assert rows == expected(prompts, max_new)
    per_step = TREE.max_depth + 1
    for (tokens, _), summary in zip(rows, counters.spec):
        assert summary["steps"] == -(-(len(tokens) - 1) // per_step), summary  # prefill: 1 token
        if summary["steps"]:
            assert summary["acceptance_rate"] >= 0.99, summary


# ---- sampling ----------------------------------------------------------------------------------

SAMPLING = {"temperature": 0.8, "top_k": 8, "top_p": 0.95}


@pytest.mark.parametrize("spec", [None, "ngram"])
def test_sampled_rows_are_the_same_at_every_batch_size(spec):
    """A prompt samples with its own key (seed, index in the job) folded with the tokens it has
    emitted: the same rows with static batches of one and with 1, 4 or 8 refilled slots."""
    prompts, _ = ragged_job(13, seed=2)
    draft = (None, None) if spec is None else drafter(spec, "chain")

    def rows(batch_size, refill):
        results = generate_ids(CFG, params(), prompts, max_new_tokens=12, eos_ids=[3], seed=7,
                               batch_size=batch_size, refill=refill, draft=draft[0],
                               drafter_params=draft[1], **SAMPLING)
        return [(r.token_ids, r.stop_reason) for r in results]

    reference = rows(1, False)
    assert len({tuple(t) for t, _ in reference}) > 1  # the rows do differ
    for batch_size in (1, 4, 8):
        assert rows(batch_size, True) == reference, batch_size


# ---- the API -----------------------------------------------------------------------------------


def test_the_api_runs_chunks_through_refilled_slots():
    """generate_ids refills by default: one program for every chunk of the job, the slots (and
    the rows still running in them) carried from one call to the next, every row the same as
    static batches, each call's slot counters in its rows' times."""
    prompts, _ = ragged_job(20, seed=3)
    static = generate_ids(CFG, params(), prompts, max_new_tokens=9, eos_ids=[3], batch_size=2,
                          refill=False)
    lengths = [len(p) for p in prompts]
    groups = length_groups(lengths, 4, extra=16)  # 2 x 2 slots; bucket(9) new tokens
    assert len(groups) == 2 and sum(map(len, groups)) == len(prompts)
    before = refill_program._cache_size()
    runs = list(iter_generate_ids(CFG, params(), prompts, max_new_tokens=9, eos_ids=[3],
                                  batch_size=2))
    compiled = refill_program._cache_size()
    assert compiled <= before + 2  # at most a program per group's slot shape (one may exist)
    list(iter_generate_ids(CFG, params(), prompts[::-1], max_new_tokens=9, eos_ids=[3], batch_size=2))
    assert refill_program._cache_size() == compiled  # the same job's shapes: nothing new
    starts = [start for start, _ in runs]
    assert starts[0] == 0 and starts == sorted(starts)  # in prompt order, consecutive
    refilled = [r for _, rows in runs for r in rows]
    assert [(r.token_ids, r.stop_reason) for r in refilled] == [
        (r.token_ids, r.stop_reason) for r in static]
    calls = {r.times.batch: r.times.slots for r in refilled}
    assert sorted(calls) == [0, 1] and all(s.slots == 2 for s in calls.values())
    assert [calls[i].prefilled for i in range(2)] == [len(g) for g in groups]
    assert calls[0].refills == len(groups[0])  # 2 slots (< batch_fill_from): a pass per prompt
    assert all(0 < s.busy_slot_steps <= s.slot_steps for s in calls.values())
    stats = job_stats(refilled)
    assert stats.chunks == 2 and stats.new_tokens == sum(len(r.token_ids) for r in static)
    assert "slots" in stats.line() and "refills/chunk" in stats.line()


def test_unordered_runs_hold_every_row_once():
    """ordered=False yields each call's ended rows at once, as runs of consecutive prompts."""
    prompts, _ = ragged_job(20, seed=3)
    ordered = generate_ids(CFG, params(), prompts, max_new_tokens=9, eos_ids=[3], batch_size=2)
    runs = list(iter_generate_ids(CFG, params(), prompts, max_new_tokens=9, eos_ids=[3],
                                  batch_size=2, ordered=False))
    got = {start + j: r.token_ids for start, rows in runs for j, r in enumerate(rows)}
    assert sorted(got) == list(range(len(prompts)))
    assert sum(len(rows) for _, rows in runs) == len(prompts)
    assert [got[i] for i in range(len(prompts))] == [r.token_ids for r in ordered]


@pytest.mark.parametrize("refill", [True, False])
def test_max_new_tokens_per_prompt(refill):
    """max_new_tokens may be one int per prompt: each row as if it ran alone with its own."""
    prompts, max_new = ragged_job(7, seed=4)
    rows = generate_ids(CFG, params(), prompts, max_new_tokens=max_new, eos_ids=[], batch_size=4,
                        refill=refill)
    assert [(r.token_ids, r.stop_reason) for r in rows] == expected(prompts, max_new)
    with pytest.raises(ValueError, match="max_new_tokens has 2 values for 7 prompts"):
        generate_ids(CFG, params(), prompts, max_new_tokens=[3, 4])
    with pytest.raises(ValueError, match=r"max_new_tokens\[1\] must be an integer >= 1"):
        generate_ids(CFG, params(), prompts, max_new_tokens=[3, 0, 1, 1, 1, 1, 1])


def test_refill_must_be_a_bool():
    with pytest.raises(TypeError, match="refill must be True or False"):
        generate_ids(CFG, params(), [[1, 2]], max_new_tokens=2, refill="yes")


def test_the_refilling_job_line():
    stats = JobStats(new_tokens=90, compile_s=3.0, decode_s=2.0, slot_steps=80, busy_slot_steps=72,
                     refills=6, decode_steps=10, chunks=2)
    assert stats.line() == ("compiled in 3.0 s; 90 tokens in 2.00 s (45.0 tokens/s; slots 90% "
                            "busy, 3.0 refills/chunk, prefill 38% of steps)")


def test_static_batches_count_their_slots():
    """A static batch's slots: a row is busy from its first decoding step to its last, the batch
    runs to its slowest row (padding rows idle throughout)."""
    rows = generate_ids(CFG, params(), [[1, 2], [3], [4, 5, 6]], max_new_tokens=[1, 5, 9],
                        eos_ids=[], batch_size=4, refill=False)
    slots = rows[0].times.slots
    assert (slots.slots, slots.decode_steps, slots.busy_slot_steps, slots.refills) == (4, 8, 12, 0)
    stats = job_stats(rows)
    assert stats.chunks == 0 and stats.slot_utilisation == 12 / 32
    assert stats.line().endswith(", slots 38% busy)")


def test_length_groups():
    """Prompts grouped by the power-of-two bucket of their length (file order within), a group
    taking in longer buckets while it is small or its slots' width grows by at most 1.5x."""
    lengths = [3, 100, 4, 2000, 70, 5, 130, 6, 1500]  # buckets 4, 128, 4, 2048, 128, 8, 256, 8, 2048
    assert length_groups(lengths, 1) == [[0, 2], [5, 7], [1, 4], [6], [3, 8]]
    assert length_groups(lengths, 1, extra=512) == [[0, 1, 2, 4, 5, 6, 7], [3, 8]]  # 4..256: 516..768
    assert length_groups(lengths, 3) == [[0, 2, 5, 7], [1, 3, 4, 6, 8]]  # the small last joins
    assert length_groups([5] * 4, 8) == [[0, 1, 2, 3]]
