"""Continuous batching inside the one program: B slots, a queue of prompts, one `while_loop`.

A chunk of a job's prompts goes to the device as a `PromptQueue` (`[Q, P]` right-padded
tokens, lengths, max_new, per-prompt PRNG keys, and how many of the Q entries are real). The
loop keeps B slots busy: each iteration first runs the refill passes the `RefillPolicy` asks
for, then one decoding step (`loop.ar_step`, or `loop.spec_step` with a drafter) over all B
slots. A first refill pass fills all B slots at once (a batch of B rows, as a static batch
starts); the later passes

1. harvest every slot whose row ended (EOS, stop sequence, max_new_tokens, error): its token
   row, length, stop reason and speculative counters go to the chunk's outputs (`[Q, ...]`,
   at the prompt's index in the queue) and the slot is free;
2. take the next `policy.rows` queued prompts (fewer when fewer slots are free or fewer
   prompts are left) and prefill them as a batch of `policy.rows` rows, exactly as a static
   batch starts (`loop.init_state` + `loop.prefill`: positions from 0, a fresh cache row,
   each row's first token drawn with its own key), the drafter's `refill` starting its rows
   (`drafters.base.Drafter.refill`);
3. write those rows over the free slots (`gather.put_rows`: the slot's token row, counters,
   key, cache row and drafter rows; unused pass rows are dropped).

A row whose first token ends it (max_new 1, EOS) is harvested by the next pass. When the queue
is empty and every slot has ended, the loop stops and the last rows are harvested. A prompt's
randomness is its own key folded with the tokens it has emitted (`specjax.rng`), so a row
samples the same tokens whichever slot, batch size or neighbours it gets, and greedy rows equal
a batch of one token for token.

`refill_program` is the jitted program (one per target, drafter, shapes and policy); the
counters (`SlotCounters`) tell how busy the slots were.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.gather import put_rows
from specjax.loop import DecodeState, StopCriteria, ar_step, init_state, prefill, spec_step
from specjax.metrics import SpecMetrics
from specjax.models.cache import KVCache
from specjax.sampling import SamplingParams
from specjax.target import TargetModel, as_target


@dataclasses.dataclass(frozen=True)
class RefillPolicy:
    """When and how slots are refilled (static: part of the compiled program).

    rows: prompts one refill pass prefills, as one batch of that many rows (1: one slot at a
      time, a pass per prompt; B: every free slot in one pass, padded rows computed too).
    min_free: free slots before the loop refills (while prompts are queued; fewer when fewer
      prompts are left, and always when no slot is running).
    """

    rows: int = 1
    min_free: int = 1

    def __post_init__(self):
        if self.rows < 1 or self.min_free < 1:
            raise ValueError(f"RefillPolicy needs rows >= 1 and min_free >= 1, got {self}")


@struct.dataclass
class PromptQueue:
    """A chunk of prompts waiting for slots.

    tokens: `[Q, P]` int32 right-padded prompts; lengths `[Q]` int32; max_new `[Q]` int32;
    keys: `[Q, 2]` uint32 each prompt's PRNG key (`specjax.rng.job_row_keys`);
    size: `[]` int32 the real prompts (entries from `size` on are padding, never started).
    """

    tokens: jax.Array
    lengths: jax.Array
    max_new: jax.Array
    keys: jax.Array
    size: jax.Array

    @property
    def capacity(self) -> int:
        return self.tokens.shape[0]

    @classmethod
    def build(cls, prompts, max_new, keys, capacity: int, prompt_width: int) -> PromptQueue:
        """The queue of `len(prompts) <= capacity` token-id prompts (each at most prompt_width
        long), max_new `[N]` ints (or one for all), keys `[N, 2]` uint32, padded to `capacity` entries (host)."""
        count = len(prompts)
        tokens = np.zeros((capacity, prompt_width), np.int32)
        lengths = np.ones((capacity,), np.int32)
        for i, ids in enumerate(prompts):
            tokens[i, : len(ids)] = ids
            lengths[i] = len(ids)
        max_new_rows = np.zeros((capacity,), np.int32)
        max_new_rows[:count] = np.broadcast_to(np.asarray(max_new, np.int32), (count,))
        key_rows = np.zeros((capacity, 2), np.uint32)
        key_rows[:count] = keys
        return cls(jnp.asarray(tokens), jnp.asarray(lengths), jnp.asarray(max_new_rows),
                   jnp.asarray(key_rows), jnp.int32(count))


@struct.dataclass
class ChunkOutputs:
    """Each queued prompt's finished row, at its index in the queue.

    tokens: `[Q, W]` int32 the row's buffer (prompt, then `num_tokens - length` new tokens);
    num_tokens `[Q]`, stop_reason `[Q]` int32 (`loop.STOP_REASONS`);
    metrics: `SpecMetrics` `[Q]` when speculating, else None.
    """

    tokens: jax.Array
    num_tokens: jax.Array
    stop_reason: jax.Array
    metrics: SpecMetrics | None


@struct.dataclass
class SlotCounters:
    """How the slots spent the program (`[]` int32 each).

    decode_steps: decoding steps over all B slots; busy_slot_steps: slot-steps of running
    rows (utilisation = busy / (decode_steps * B)); refills: refill passes (each a prefill of
    `policy.rows` rows); prefilled: prompts started.
    """

    decode_steps: jax.Array
    busy_slot_steps: jax.Array
    refills: jax.Array
    prefilled: jax.Array


@struct.dataclass
class RefillCarry:
    """The loop's state: the B slots, the queue's progress and the outputs so far.

    slot_prompt: `[B]` int32 the queue index of each slot's prompt (-1: empty / harvested);
    next_prompt: `[]` int32 the first prompt not started yet.
    """

    state: DecodeState
    drafter_state: object
    metrics: SpecMetrics | None
    slot_prompt: jax.Array
    next_prompt: jax.Array
    outputs: ChunkOutputs
    counters: SlotCounters


# ---- building blocks ---------------------------------------------------------------------------


def empty_slots(cache: KVCache, prompt_width: int, width: int) -> DecodeState:
    """B slots holding no prompt (done, one padding token): `[B]` from the cache's rows."""
    batch = cache.lengths.shape[0]
    return init_state(jnp.zeros((batch, prompt_width), jnp.int32), jnp.ones((batch,), jnp.int32),
                      jnp.zeros((batch,), jnp.int32), cache, jnp.zeros((batch, 2), jnp.uint32), width)


def empty_outputs(capacity: int, width: int, max_depth: int | None) -> ChunkOutputs:
    """Outputs of `capacity` prompts not finished yet (metrics of depth max_depth, or None)."""
    zeros = jnp.zeros((capacity,), jnp.int32)
    metrics = None if max_depth is None else SpecMetrics.zeros(capacity, max_depth)
    return ChunkOutputs(jnp.zeros((capacity, width), jnp.int32), zeros, zeros, metrics)


def harvest(carry: RefillCarry) -> RefillCarry:
    """Copies every ended slot's row to the outputs at its prompt's index; those slots are free."""
    state = carry.state
    ended = state.done & (carry.slot_prompt >= 0)
    dest = jnp.where(ended, carry.slot_prompt, carry.outputs.num_tokens.shape[0])  # Q: dropped
    rows = ChunkOutputs(state.tokens, state.num_tokens, state.stop_reason, carry.metrics)
    outputs = jax.tree.map(lambda out, row: out.at[dest].set(row, mode="drop"), carry.outputs, rows)
    return carry.replace(outputs=outputs, slot_prompt=jnp.where(ended, -1, carry.slot_prompt))


def pick_slots(free: jax.Array, count: jax.Array, rows: int) -> jax.Array:
    """`[rows]` int32 the first `count` free slots of free `[B]` bool, in slot order; B where
    there is none (fewer free slots or r >= count): those rows are dropped by `put_rows`."""
    batch = free.shape[0]
    rank = jnp.cumsum(free) - 1
    match = free[None, :] & (rank[None, :] == jnp.arange(rows)[:, None])  # [rows, B]
    use = jnp.any(match, axis=1) & (jnp.arange(rows) < count)
    return jnp.where(use, jnp.argmax(match, axis=1), batch).astype(jnp.int32)


def queued_rows(queue: PromptQueue, first: jax.Array, use: jax.Array):
    """(tokens `[R, P]`, lengths, max_new, keys) of queue entries first.. first + R - 1; rows
    not in `use` `[R]` are padding rows (one token, max_new 0: done before they start)."""
    index = jnp.clip(first + jnp.arange(use.shape[0]), 0, queue.capacity - 1)
    pick = lambda x, pad: jnp.where(use.reshape(use.shape + (1,) * (x.ndim - 1)), x[index], pad)
    return (pick(queue.tokens, 0), pick(queue.lengths, 1), pick(queue.max_new, 0),
            pick(queue.keys, jnp.zeros((), queue.keys.dtype)))


def wants_refill(carry: RefillCarry, queue: PromptQueue, policy: RefillPolicy) -> jax.Array:
    """`[]` bool: prompts are queued and at least min(min_free, prompts left) slots have ended
    (or none is running)."""
    left = queue.size - carry.next_prompt
    ended = jnp.sum(carry.state.done)
    return (left > 0) & ((ended >= jnp.minimum(policy.min_free, left)) | jnp.all(carry.state.done))


# ---- the loop ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Decoder:
    """What one loop runs (static): the target, the drafter (None: plain decoding), the policy
    and the token buffer width W."""

    target: TargetModel
    drafter: object
    policy: RefillPolicy
    width: int

    def refill_pass(self, rows: int, params, drafter_params, queue: PromptQueue,
                    carry: RefillCarry, sampling: SamplingParams, criteria: StopCriteria) -> RefillCarry:
        """Harvests the ended slots and starts up to `rows` (static) queued prompts in free ones,
        prefilled as one batch of `rows` rows."""
        carry = harvest(carry)
        drafter = self.drafter
        left = queue.size - carry.next_prompt
        slots = pick_slots(carry.state.done, left, rows)
        use = slots < carry.state.done.shape[0]
        tokens, lengths, max_new, keys = queued_rows(queue, carry.next_prompt, use)
        cache = as_target(self.target).init_cache(rows, self.width)
        fresh = init_state(tokens, lengths, max_new, cache, keys, self.width)
        hidden_layers = () if drafter is None else drafter.hidden_layers
        fresh, prefill_out = prefill(self.target, params, fresh, tokens.shape[1], sampling,
                                     criteria, hidden_layers)
        drafter_state, metrics = carry.drafter_state, carry.metrics
        if drafter is not None:
            drafter_state = drafter.refill(drafter_params, drafter_state, fresh, prefill_out, slots)
            metrics = put_rows(metrics, SpecMetrics.zeros(rows, drafter.tree.max_depth), slots)
        started = jnp.sum(use).astype(jnp.int32)
        queue_index = carry.next_prompt + jnp.arange(rows, dtype=jnp.int32)
        counters = carry.counters
        return carry.replace(
            state=put_rows(carry.state, fresh, slots),
            drafter_state=drafter_state,
            metrics=metrics,
            slot_prompt=carry.slot_prompt.at[slots].set(queue_index, mode="drop"),
            next_prompt=carry.next_prompt + started,
            counters=counters.replace(refills=counters.refills + 1,
                                      prefilled=counters.prefilled + started),
        )

    def decode_step(self, params, drafter_params, carry: RefillCarry, sampling: SamplingParams,
                    criteria: StopCriteria) -> RefillCarry:
        """One decoding step over every slot (ended slots change nothing)."""
        counters = carry.counters
        counters = counters.replace(
            decode_steps=counters.decode_steps + 1,
            busy_slot_steps=counters.busy_slot_steps + jnp.sum(~carry.state.done).astype(jnp.int32))
        if self.drafter is None:
            state = ar_step(self.target, params, carry.state, sampling, criteria)
            return carry.replace(state=state, counters=counters)
        state, drafter_state, metrics = spec_step(
            self.target, params, self.drafter, drafter_params, carry.state, carry.drafter_state,
            carry.metrics, sampling, criteria)
        return carry.replace(state=state, drafter_state=drafter_state, metrics=metrics,
                             counters=counters)

    def run(self, params, drafter_params, queue: PromptQueue, cache: KVCache,
            sampling: SamplingParams, criteria: StopCriteria, drafter_carry):
        """(ChunkOutputs, SlotCounters, the drafter's carry) of a whole queue."""
        drafter, policy = self.drafter, self.policy
        state = empty_slots(cache, queue.tokens.shape[1], self.width)
        batch = state.done.shape[0]
        drafter_state = None if drafter is None else drafter.resume(
            drafter.init(drafter_params, batch, self.width), drafter_carry)
        depth = None if drafter is None else drafter.tree.max_depth
        zero = jnp.zeros((), jnp.int32)
        carry = RefillCarry(
            state=state, drafter_state=drafter_state,
            metrics=None if drafter is None else SpecMetrics.zeros(batch, depth),
            slot_prompt=jnp.full((batch,), -1, jnp.int32), next_prompt=zero,
            outputs=empty_outputs(queue.capacity, self.width, depth),
            counters=SlotCounters(zero, zero, zero, zero),
        )

        def refill(rows, c):
            return self.refill_pass(rows, params, drafter_params, queue, c, sampling, criteria)

        def fill(c):
            return jax.lax.while_loop(lambda c: wants_refill(c, queue, policy),
                                      lambda c: refill(policy.rows, c), c)

        if policy.rows < batch:  # every slot is free: the first prompts start as one batch
            carry = refill(batch, carry)

        def body(c):
            return self.decode_step(params, drafter_params, fill(c), sampling, criteria)

        carry = jax.lax.while_loop(
            lambda c: jnp.any(~c.state.done) | (c.next_prompt < queue.size), body, carry)
        carry = harvest(carry)
        out_carry = () if drafter is None else drafter.carry(carry.drafter_state)
        return carry.outputs, carry.counters, out_carry


def run_refill(target: TargetModel, params, drafter, drafter_params, queue: PromptQueue,
               cache: KVCache, sampling: SamplingParams, criteria: StopCriteria, drafter_carry=(),
               *, width: int, policy: RefillPolicy = RefillPolicy()):
    """Every prompt of `queue` decoded in the B slots of `cache` (B rows, capacity >= width),
    refilling slots as rows end, as ONE XLA program (`refill_program`).

    target: static, a `TargetModel` or a ModelConfig; drafter: static, None for plain decoding;
    width W: the token buffer per slot, >= P + max(max_new) (+ the tree's nodes + 1 when
    speculating); cache: the slots' cache, only its shape and dtype matter (not donated: the
    program returns no cache); drafter_carry: the drafter's job-level state (donated).
    Returns (ChunkOutputs `[Q, ...]`, SlotCounters, the drafter's carry for the next chunk).
    """
    return Decoder(target, drafter, policy, width).run(params, drafter_params, queue, cache,
                                                       sampling, criteria, drafter_carry)


refill_program = jax.jit(run_refill, static_argnames=("target", "drafter", "width", "policy"),
                         donate_argnames=("drafter_carry",))
