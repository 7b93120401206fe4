"""Suffix decoding on device: a hashed (context -> next-token counts) table over the job's text.

Like suffix-tree drafting, the drafter looks up the last tokens of a row (and of each draft
path) among everything seen so far and proposes the most frequent continuations, preferring the
longest matching context. Here the "tree" is a fixed-size table that lives on device, so
lookups and updates run inside the one speculative program:

- `SuffixTable`: C context slots, direct-mapped by a hash of (context tokens, order n) for each
  order n in [n_min, n_max]. A slot holds the context's 32-bit fingerprint and M ways of
  (successor token, count). A context that hashes onto another's slot evicts it; a new
  successor of a full slot replaces its least frequent way (the frequent ones stay).
- `observe`: counts every (context, next token) pair of newly committed tokens, for all orders
  at once: a sort groups equal pairs (their count is the group size) and ranks the distinct
  successors of a slot, then M conflict-free scatter rounds merge them into the table. The
  table is shared by all rows of the batch. It is kept up to date at ONE place in the
  program: each proposal first counts what its rows committed since the last one (`catch_up`:
  the prompt and first token at a row's first step, its accepted block after that), in
  chunks of `catch_up_span` positions, so the prefill program and `update` hold no copy of
  the counting (a second copy of it was ~50 of the prefill program's ~150 kernels).
- `ranked_successors`: candidates of a context from all orders, longest order first, then by
  count; duplicates keep their best entry.
- propose: the draft tree grows level by level (one `lax.scan` over the levels): a node of rank
  r takes the r-th ranked successor of its parent's context (the row's last tokens followed by
  the path). A chain is the greedy most-frequent continuation. Nodes with no successor (or a
  path probability below `min_prob`, the product of count / total along the path) are invalid.
  The drafter is deterministic: `Draft.probs` is None (q one-hot).

The table is the drafter's carry (`Drafter.carry`): it leaves the program with the batch and
enters the job's next batch, so the drafter keeps learning across the batches of one job.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.drafters.base import Drafter
from specjax.drafters.draft_model import child_tables
from specjax.types import Draft

ORDER_WEIGHT = 1 << 24  # scores: order index * ORDER_WEIGHT + count (counts are capped below)
MAX_COUNT = ORDER_WEIGHT - 1


# ---- hashing ---------------------------------------------------------------------------------


def _fmix(h: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finaliser (uint32 -> uint32, wrapping)."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _multipliers(orders: tuple[int, ...], n_max: int, base: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Per order, the weight of each of the n_max context positions in a polynomial hash (base
    to the power of the distance from the end, 0 outside the order's window) `[O, n_max]`
    uint32, and the order's start value `[O]` uint32 (the order is part of the hash)."""
    order = np.asarray(orders, np.uint64)
    distance = np.arange(n_max - 1, -1, -1, dtype=np.uint64)
    powers = np.array([pow(base, int(d), 1 << 32) for d in distance], np.uint64)
    inside = distance[None, :] < order[:, None]
    start = (seed + order * np.uint64(0x9E3779B9)) % np.uint64(1 << 32)
    return np.where(inside, powers[None, :], 0).astype(np.uint32), start.astype(np.uint32)


def context_hashes(context: jax.Array, orders: tuple[int, ...], log2_slots: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The contexts of every order at once: for contexts `[..., n_max]` int32 (-1 = before the
    row start), the last n tokens for each order n of `orders` hash to a slot `[..., O]` int32
    in [0, 2**log2_slots) and a fingerprint `[..., O]` uint32 (never 0); ok `[..., O]`: the
    order's window lies inside the row.

    Two polynomial hashes of the window (wrapping uint32 arithmetic, different bases and
    seeds), each finished by MurmurHash3's mixer: a multiply and a sum over the positions for
    all orders together, so the program holds a handful of operations per call, not a hash
    step per token and order.
    """
    n_max = context.shape[-1]
    weights1, start1 = _multipliers(orders, n_max, 0x01000193, 0x811C9DC5)
    weights2, start2 = _multipliers(orders, n_max, 0xCC9E2D51, 0x3C6EF372)
    tokens = context[..., None, :].astype(jnp.uint32)  # [..., 1, n_max]
    h1 = jnp.sum(tokens * weights1, axis=-1, dtype=jnp.uint32) + start1
    h2 = jnp.sum(tokens * weights2, axis=-1, dtype=jnp.uint32) + start2
    ok = jnp.all((context[..., None, :] >= 0) | (weights1 == 0), axis=-1)
    slot = _fmix(h1) >> (32 - log2_slots)
    return slot.astype(jnp.int32), _fmix(h2 ^ jnp.uint32(0x9E3779B9)) | jnp.uint32(1), ok


# ---- the table -------------------------------------------------------------------------------


@struct.dataclass
class SuffixTable:
    """keys `[C]` uint32 context fingerprints (0 = empty slot); tokens `[C, M]` int32 successor
    tokens (-1 = empty way); counts `[C, M]` int32."""

    keys: jax.Array
    tokens: jax.Array
    counts: jax.Array

    @classmethod
    def empty(cls, num_slots: int, ways: int) -> SuffixTable:
        return cls(
            keys=jnp.zeros((num_slots,), jnp.uint32),
            tokens=jnp.full((num_slots, ways), -1, jnp.int32),
            counts=jnp.zeros((num_slots, ways), jnp.int32),
        )

    @property
    def num_slots(self) -> int:
        return self.keys.shape[0]

    @property
    def ways(self) -> int:
        return self.tokens.shape[1]


def _merge_rows(keys, tokens, counts, fp, token, delta):
    """One successor per row: rows `keys [U]`, `tokens/counts [U, M]` get (fp, token, delta)."""
    same = keys == fp
    tokens = jnp.where(same[:, None], tokens, -1)
    counts = jnp.where(same[:, None], counts, 0)
    hit = tokens == token[:, None]
    has = jnp.any(hit, axis=1)
    way = jnp.where(has, jnp.argmax(hit, axis=1), jnp.argmin(counts, axis=1))  # empty ways count 0
    chosen = jnp.arange(tokens.shape[1])[None, :] == way[:, None]
    new_count = jnp.minimum(jnp.where(has[:, None], counts, 0) + delta[:, None], MAX_COUNT)
    return (
        fp,
        jnp.where(chosen, token[:, None], tokens),
        jnp.where(chosen, new_count, counts),
    )


def insert(table: SuffixTable, slot: jax.Array, fp: jax.Array, token: jax.Array, ok: jax.Array) -> SuffixTable:
    """Counts the (context, successor) pairs `[U]` where ok: slot/fp from `context_hash`.

    Equal pairs collapse into one increment; the distinct successors of one slot are merged in
    rank order, one per round (M rounds: more than M new successors of one context in a single
    call keep only the first M in token order).
    """
    num = slot.shape[0]
    slot = jnp.where(ok, slot, table.num_slots)  # invalid pairs sort last and are dropped
    slot, fp, token = jax.lax.sort((slot, fp, token), num_keys=3)
    idx = jnp.arange(num)
    prev = lambda x: jnp.concatenate([x[:1], x[:-1]])
    new_slot = (slot != prev(slot)) | (idx == 0)
    first = new_slot | (fp != prev(fp)) | (token != prev(token))
    group = jnp.cumsum(first) - 1
    delta = jax.ops.segment_sum(jnp.ones_like(slot), group, num_segments=num)[group]
    seen = jnp.cumsum(first)
    rank = seen - seen[jax.lax.cummax(jnp.where(new_slot, idx, 0))]
    live = first & (slot < table.num_slots)

    def round_(r, tab: SuffixTable) -> SuffixTable:
        target = jnp.where(live & (rank == r), slot, tab.num_slots)  # unique or dropped
        at = jnp.minimum(target, tab.num_slots - 1)
        keys, tokens, counts = _merge_rows(
            tab.keys[at], tab.tokens[at], tab.counts[at], fp, token, delta
        )
        return SuffixTable(
            keys=tab.keys.at[target].set(keys, mode="drop"),
            tokens=tab.tokens.at[target].set(tokens, mode="drop"),
            counts=tab.counts.at[target].set(counts, mode="drop"),
        )

    return jax.lax.fori_loop(0, table.ways, round_, table)


def windows_before(tokens: jax.Array, ends: jax.Array, size: int) -> jax.Array:
    """`[B, S, size]`: the `size` tokens before each position `ends` `[B, S]` of tokens `[B, W]`
    (-1 before the row's start)."""
    idx = ends[..., None] - size + jnp.arange(size)
    got = jnp.take_along_axis(tokens[:, None, :], jnp.clip(idx, 0, tokens.shape[1] - 1), axis=2)
    return jnp.where(idx >= 0, got, -1)


def observe(
    table: SuffixTable,
    tokens: jax.Array,
    num_tokens: jax.Array,
    seen: jax.Array,
    span: int,
    orders: tuple[int, ...],
) -> SuffixTable:
    """Counts the successors at positions `[seen, num_tokens)` of each row of tokens `[B, W]`
    (num_tokens, seen `[B]`; span static >= max(num_tokens - seen)) under every order."""
    log2_slots = table.num_slots.bit_length() - 1
    ends = num_tokens[:, None] - span + jnp.arange(span)[None, :]  # [B, S]
    new = (ends >= seen[:, None]) & (ends < num_tokens[:, None])
    nxt = jnp.take_along_axis(tokens, jnp.clip(ends, 0, tokens.shape[1] - 1), axis=1)
    context = windows_before(tokens, ends, max(orders))  # [B, S, n_max]
    slots, fps, oks = context_hashes(context, orders, log2_slots)  # [B, S, O]
    oks = oks & new[..., None]
    succ = jnp.broadcast_to(nxt[..., None], oks.shape)
    flat = lambda x: jnp.moveaxis(x, -1, 0).reshape(-1)  # order-major
    return insert(table, flat(slots), flat(fps), flat(succ), flat(oks))


def ranked_successors(
    table: SuffixTable, context: jax.Array, orders: tuple[int, ...], k: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The k best distinct successors of contexts `[..., n_max]` (-1 = before the row start).

    Ranked by the longest order with a hit, then count. Returns tokens `[..., k]`, found
    `[..., k]` bool and prob `[..., k]` f32 (count / total of the order that ranked it).
    """
    log2_slots = table.num_slots.bit_length() - 1
    orders = tuple(sorted(orders))
    slot, fp, ok = context_hashes(context, orders, log2_slots)  # [..., O]
    hit = (table.keys[slot] == fp) & ok
    count = jnp.where(hit[..., None], table.counts[slot], 0)  # [..., O, M]
    total = jnp.maximum(jnp.sum(count, axis=-1, keepdims=True), 1)
    weight = jnp.arange(len(orders))[:, None] * ORDER_WEIGHT  # longer orders rank first
    flat = lambda x: x.reshape(x.shape[:-2] + (-1,))  # [..., O * M], order-major
    tokens = flat(table.tokens[slot])
    scores = flat(jnp.where(count > 0, weight + count, -1))
    probs = flat(count / total)
    scores, order = jax.lax.top_k(scores, scores.shape[-1])
    tokens = jnp.take_along_axis(tokens, order, axis=-1)
    probs = jnp.take_along_axis(probs, order, axis=-1)
    before = np.tril(np.ones((scores.shape[-1],) * 2, bool), k=-1)  # [j, i]: i < j
    dup = jnp.any((tokens[..., :, None] == tokens[..., None, :]) & before & (scores[..., None, :] >= 0), axis=-1)
    scores, order = jax.lax.top_k(jnp.where(dup, -1, scores), k)
    found = scores >= 0
    return (
        jnp.where(found, jnp.take_along_axis(tokens, order, axis=-1), 0),
        found,
        jnp.where(found, jnp.take_along_axis(probs, order, axis=-1), 0.0),
    )


# ---- the drafter -----------------------------------------------------------------------------


@struct.dataclass
class SuffixState:
    """table: the job's counts (the carry); seen `[B]` int32: tokens of each row counted."""

    table: SuffixTable
    seen: jax.Array


@dataclasses.dataclass(frozen=True)
class SuffixDrafter(Drafter):
    """Suffix decoding over contexts of orders n_min..n_max; a table of 2**log2_slots slots
    with `ways` successors each; nodes below path probability `min_prob` are not drafted."""

    n_min: int = 1
    n_max: int = 6
    log2_slots: int = 18
    ways: int = 4
    min_prob: float = 0.0

    def __post_init__(self):
        if not 1 <= self.n_min <= self.n_max:
            raise ValueError(f"suffix needs 1 <= n_min <= n_max, got {self.n_min}, {self.n_max}")
        if not 1 <= self.log2_slots <= 30:
            raise ValueError(f"suffix needs 1 <= log2_slots <= 30, got {self.log2_slots}")
        if self.ways < 1:
            raise ValueError(f"suffix needs ways >= 1, got {self.ways}")

    shape_free_state = True
    state_from_tokens = True

    @property
    def name(self) -> str:
        return "suffix"

    @property
    def orders(self) -> tuple[int, ...]:
        return tuple(range(self.n_min, self.n_max + 1))

    def init_carry(self, params) -> SuffixTable:
        return SuffixTable.empty(1 << self.log2_slots, self.ways)

    def init(self, params, batch_size: int, width: int) -> SuffixState:
        return SuffixState(self.init_carry(params), jnp.zeros((batch_size,), jnp.int32))

    def resume(self, state: SuffixState, carry: SuffixTable) -> SuffixState:
        return state.replace(table=carry)

    def carry(self, state: SuffixState) -> SuffixTable:
        return state.table

    @property
    def catch_up_span(self) -> int:
        """Positions a row counts per round of `catch_up`: a step's accepted block (at most
        max_depth + 1) in one round, a prompt in a few."""
        return max(self.tree.max_depth + 1, 32)

    def catch_up(self, state: SuffixState, decode) -> SuffixState:
        """The table with every row's positions `[seen, num_tokens)` counted (prefill and
        update count nothing: this runs before each proposal), catch_up_span per row and round."""
        span = self.catch_up_span

        def round_(st: SuffixState) -> SuffixState:
            upto = jnp.minimum(st.seen + span, decode.num_tokens)
            return SuffixState(observe(st.table, decode.tokens, upto, st.seen, span, self.orders),
                               upto)

        return jax.lax.while_loop(lambda st: jnp.any(st.seen < decode.num_tokens), round_, state)

    def propose(self, params, state: SuffixState, decode, key, sampling):
        state = self.catch_up(state, decode)
        tree, tables = self.tree, child_tables(self.tree)
        batch, size = decode.tokens.shape[0], self.n_max
        root = windows_before(decode.tokens, decode.num_tokens[:, None], size)  # [B, 1, n]
        contexts = jnp.concatenate(  # [B, 1 + N, n] per verify row: its context
            [root, jnp.full((batch, tree.num_nodes, size), -1, jnp.int32)], axis=1)
        path_prob = jnp.ones((batch, 1 + tree.num_nodes), jnp.float32)
        valid = jnp.ones((batch, 1 + tree.num_nodes), bool)  # verify layout (root valid)

        def level(carry, t):
            contexts, path_prob, valid = carry
            parent = contexts[:, t["parent"]]  # [B, C, n]
            tok, found, prob = ranked_successors(state.table, parent, self.orders, tables.num_ranks)
            pick = lambda x: jnp.take_along_axis(x, t["ranks"][None, :, None], axis=-1)[..., 0]
            tok, prob = pick(tok), path_prob[:, t["parent"]] * pick(prob)
            ok = pick(found) & valid[:, t["parent"]] & (prob >= self.min_prob)
            rows = t["nodes"] + 1  # padding: N + 1, dropped
            child = jnp.concatenate([parent[..., 1:], tok[..., None]], axis=-1)
            return (
                contexts.at[:, rows].set(child, mode="drop"),
                path_prob.at[:, rows].set(prob, mode="drop"),
                valid.at[:, rows].set(ok, mode="drop"),
            ), None

        xs = {"nodes": tables.nodes, "ranks": tables.ranks, "parent": tables.parent}
        (contexts, _, valid), _ = jax.lax.scan(
            level, (contexts, path_prob, valid), {k: jnp.asarray(v) for k, v in xs.items()}
        )
        draft = Draft(tokens=contexts[:, 1:, -1], valid=valid[:, 1:])
        return draft, state
