"""The suffix drafter's device table (`specjax.drafters.suffix`: hashed, sorted, scattered in
rounds) against a plain-Python reference of the same rules, on random token streams."""
from __future__ import annotations

from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest

from specjax.drafters import suffix
from specjax.tree import chain

ORDERS = (1, 2, 3)


def reference_observe(ref: dict, tokens, num_tokens, seen, orders, log2_slots, ways):
    """`ref` {slot: [fingerprint, [[token, count] x ways]]} after counting the successors at
    positions [seen, num_tokens) of each row: a call's equal (context, successor) pairs add
    their count at once; in each slot the distinct (fingerprint, token) pairs merge in sorted
    order, at most `ways` of them; another fingerprint empties the slot; a new successor takes
    the first least-counted way."""
    pairs: dict[tuple[int, int, int], int] = {}
    n_max = max(orders)
    for toks, end, start in zip(tokens, num_tokens, seen):
        for pos in range(start, end):
            context = [toks[p] if p >= 0 else -1 for p in range(pos - n_max, pos)]
            slots, fps, oks = (np.asarray(x)[0] for x in suffix.context_hashes(
                jnp.asarray([context], jnp.int32), orders, log2_slots))
            for slot, fp, ok in zip(slots, fps, oks):
                if ok:
                    key = (int(slot), int(fp), int(toks[pos]))
                    pairs[key] = pairs.get(key, 0) + 1
    rank: dict[int, int] = {}
    for slot, fp, token in sorted(pairs):
        rank[slot] = rank.get(slot, -1) + 1
        if rank[slot] >= ways:
            continue
        stored = ref.get(slot)
        if stored is None or stored[0] != fp:
            stored = ref[slot] = [fp, [[-1, 0] for _ in range(ways)]]
        entries = stored[1]
        hit = [i for i, (t, _) in enumerate(entries) if t == token]
        if hit:
            entries[hit[0]][1] = min(entries[hit[0]][1] + pairs[(slot, fp, token)], suffix.MAX_COUNT)
        else:
            way = min(range(ways), key=lambda i: (entries[i][1], i))
            entries[way] = [token, pairs[(slot, fp, token)]]
    return ref


def reference_ranked(ref: dict, context, orders, log2_slots, k):
    """The k best distinct successors of one context: longest order with a hit first, then
    count, then table position; (tokens, found, probs) padded with (0, False, 0.0)."""
    slots, fps, oks = (np.asarray(x)[0] for x in suffix.context_hashes(
        jnp.asarray([context], jnp.int32), tuple(sorted(orders)), log2_slots))
    candidates = []
    for weight, (slot, fp, ok) in enumerate(zip(slots, fps, oks)):
        stored = ref.get(int(slot))
        if not ok or stored is None or stored[0] != int(fp):
            continue
        total = max(sum(c for _, c in stored[1]), 1)
        for way, (token, count) in enumerate(stored[1]):
            if count > 0:
                candidates.append((-(weight * suffix.ORDER_WEIGHT + count), weight * len(stored[1]) + way,
                                   token, count / total))
    best, taken = [], set()
    for _, _, token, prob in sorted(candidates):
        if token not in taken:
            taken.add(token)
            best.append((token, True, prob))
    best = (best + [(0, False, 0.0)] * k)[:k]
    return [b[0] for b in best], [b[1] for b in best], [b[2] for b in best]


def table_as_dict(table: suffix.SuffixTable) -> dict:
    keys, tokens, counts = (np.asarray(x) for x in (table.keys, table.tokens, table.counts))
    return {int(s): [int(keys[s]), [[int(t), int(c)] for t, c in zip(tokens[s], counts[s])]]
            for s in np.flatnonzero(keys)}


@pytest.mark.parametrize("seed,vocab,log2_slots,ways", [
    (0, 5, 12, 4),   # few contexts, many successors each: ways fill and get replaced
    (1, 9, 4, 2),    # 16 slots: contexts collide and evict each other
    (2, 3, 10, 1),   # one way per slot
])
def test_table_matches_the_reference_over_several_calls(seed, vocab, log2_slots, ways):
    rng = np.random.default_rng(seed)
    batch, width, span = 3, 48, 6
    table = suffix.SuffixTable.empty(1 << log2_slots, ways)
    ref: dict = {}
    tokens = rng.integers(0, vocab, (batch, width)).astype(np.int32)
    seen = np.zeros(batch, np.int32)
    lengths = rng.integers(4, 9, batch).astype(np.int32)  # ragged rows
    for call in range(6):
        start = seen if call else np.zeros(batch, np.int32)
        table = suffix.observe(table, jnp.asarray(tokens), jnp.asarray(lengths), jnp.asarray(start),
                               width if call == 0 else span, ORDERS)
        reference_observe(ref, tokens, lengths, start, ORDERS, log2_slots, ways)
        assert table_as_dict(table) == ref, call
        seen = lengths.copy()
        lengths = np.minimum(lengths + rng.integers(0, span + 1, batch), width).astype(np.int32)

    contexts = rng.integers(-1, vocab, (20, max(ORDERS))).astype(np.int32)
    contexts[:10] = np.stack([tokens[0, i:i + max(ORDERS)] for i in range(10)])  # seen contexts: hits
    k = 3
    got = suffix.ranked_successors(table, jnp.asarray(contexts), ORDERS, k)
    for i, context in enumerate(contexts):
        want_tokens, want_found, want_probs = reference_ranked(ref, context, ORDERS, log2_slots, k)
        assert np.asarray(got[1][i]).tolist() == want_found, (i, context)
        assert np.asarray(got[0][i]).tolist() == want_tokens, (i, context)
        np.testing.assert_allclose(np.asarray(got[2][i]), want_probs, rtol=1e-6)
    assert any(any(reference_ranked(ref, c, ORDERS, log2_slots, k)[1]) for c in contexts)


def test_hashes_of_all_orders_equal_hashing_each_order_alone():
    """`context_hashes` (all orders in one pass) hashes each order's window as if alone: the
    same window content gives the same slot at any context width, a changed token outside the
    order's window changes nothing, one inside changes it."""
    rng = np.random.default_rng(3)
    context = jnp.asarray(rng.integers(0, 50, (4, 6)), jnp.int32)
    slots, fps, oks = suffix.context_hashes(context, (1, 2, 6), 16)
    narrow = suffix.context_hashes(context[:, -2:], (1, 2), 16)
    np.testing.assert_array_equal(slots[:, :2], narrow[0])
    np.testing.assert_array_equal(fps[:, :2], narrow[1])
    assert bool(oks.all())
    changed = context.at[:, 0].set(context[:, 0] + 1)  # outside orders 1 and 2
    again = suffix.context_hashes(changed, (1, 2, 6), 16)
    np.testing.assert_array_equal(again[1][:, :2], fps[:, :2])
    assert bool((again[1][:, 2] != fps[:, 2]).all())
    before_start = context.at[:, 0].set(-1)
    assert suffix.context_hashes(before_start, (1, 2, 6), 16)[2][:, 2].tolist() == [False] * 4


@pytest.mark.parametrize("log2_slots,ways", [(12, 4), (4, 2)])
def test_catch_up_counts_each_backlog_in_rounds_like_the_reference(log2_slots, ways):
    """`SuffixDrafter.catch_up` (what runs before every proposal) counts each row's positions
    [seen, num_tokens) in rounds of catch_up_span: the same table as the reference applied
    round by round, for ragged backlogs (a long prompt's several rounds, a step's block, and a
    row with nothing new), and every row caught up afterwards."""
    drafter = suffix.SuffixDrafter(tree=chain(4), n_min=1, n_max=3, log2_slots=log2_slots, ways=ways)
    span = drafter.catch_up_span
    rng = np.random.default_rng(7)
    width = 3 * span + 10
    tokens = rng.integers(0, 6, (3, width)).astype(np.int32)
    seen = np.array([0, 40, 25], np.int32)
    num_tokens = np.array([3 * span + 5, 45, 25], np.int32)  # 4 rounds, one round, none
    state = suffix.SuffixState(suffix.SuffixTable.empty(1 << log2_slots, ways), jnp.asarray(seen))
    out = drafter.catch_up(state, SimpleNamespace(tokens=jnp.asarray(tokens),
                                                  num_tokens=jnp.asarray(num_tokens)))
    ref, at = {}, seen.copy()
    while np.any(at < num_tokens):
        upto = np.minimum(at + span, num_tokens)
        reference_observe(ref, tokens, upto, at, drafter.orders, log2_slots, ways)
        at = upto
    assert table_as_dict(out.table) == ref
    assert np.asarray(out.seen).tolist() == num_tokens.tolist()
