"""Continuous batching inside the one program: B slots, a queue of prompts, one `while_loop`.

A chunk of a job's prompts goes to the device as a `PromptQueue` (`[Q, P]` right-padded
tokens, lengths, max_new, per-prompt PRNG keys, how many of the Q entries are real and each
entry's index in the job). The loop keeps the B `Slots` busy: each iteration first runs the refill
passes the `RefillPolicy` asks for, then one decoding step (`loop.ar_step`, or `loop.spec_step`
with a drafter) over all B slots. When every slot is free (a group's first call) and B is at
least `policy.batch_fill_from`, one pass fills all B slots at once (a batch of B rows, as a
static batch starts); the other passes

1. harvest every slot whose row ended (EOS, stop sequence, max_new_tokens, error): its job
   index, token row, length, stop reason and speculative counters go to the call's outputs
   (`ChunkOutputs`, `[Q + B, ...]`, in the order rows ended) and the slot is free;
2. take the next `policy.rows` queued prompts (fewer when fewer slots are free or fewer
   prompts are left) and prefill them as a batch of `policy.rows` rows, exactly as a static
   batch starts (`loop.init_state` + `loop.prefill`: positions from 0, a fresh cache row,
   each row's first token drawn with its own key), the drafter's `refill` starting its rows
   (`drafters.base.Drafter.refill`);
3. write those rows over the free slots (`gather.put_rows`: the slot's token row, counters,
   key, cache row and drafter rows; unused pass rows are dropped).

The slots outlive a call: when the queue is empty and a slot is free, a call that is not the
last of its slots (`last` False) stops and returns its slots, still running their rows, and
the next call refills the free ones from the next chunk's queue. So the slots never drain
between chunks, only after the `last` call, which runs until every row has ended (the API
starts new slots for each group of prompts of similar length: `api.run_chunks`). A row whose first token
ends it (max_new 1, EOS) is harvested by the next pass. A prompt's randomness is its own key
folded with the tokens it has emitted (`specjax.rng`), so a row samples the same tokens whichever
slot, chunk, batch size or neighbours it gets, and greedy rows equal a batch of one token for
token.

`slots_program` makes a job's empty slots (and the drafter's state, with its job-level carry);
`refill_program` is one call (one per target, drafter, shapes and policy); the counters
(`SlotCounters`) tell how busy the slots were.
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
from specjax.xla_options import program


@dataclasses.dataclass(frozen=True)
class RefillPolicy:
    """When and how slots are refilled (static: part of the compiled program).

    rows: prompts one refill pass prefills, as one batch of that many rows (1: one slot at a
      time, a pass per prompt; B: every free slot in one pass, padded rows computed too).
    min_free: free slots before the loop refills (while prompts are queued; fewer when fewer
      prompts are left, and always when no slot is running).
    batch_fill_from: slots (B) from which a call that starts with every slot free fills them
      in one prefill of B rows rather than B / rows passes. That second prefill is compiled into
      the program (measured: SmolLM2 AR refill program at B = 8, 20.3 s to compile with it,
      11.9 s without), and below it a CPU prefills B rows in about the time of B one-row passes.
    """

    rows: int = 1
    min_free: int = 1
    batch_fill_from: int = 32

    def __post_init__(self):
        if self.rows < 1 or self.min_free < 1 or self.batch_fill_from < 1:
            raise ValueError(f"RefillPolicy needs rows >= 1 and min_free >= 1, got {self}")


@struct.dataclass
class PromptQueue:
    """A chunk of prompts waiting for slots.

    tokens: `[Q, P]` int32 right-padded prompts; lengths `[Q]` int32; max_new `[Q]` int32;
    keys: `[Q, 2]` uint32 each prompt's PRNG key (`specjax.rng.job_row_keys`);
    size: `[]` int32 the real prompts (entries from `size` on are padding, never started);
    index: `[Q]` int32 each entry's index in the job (its rows are harvested under it).
    """

    tokens: jax.Array
    lengths: jax.Array
    max_new: jax.Array
    keys: jax.Array
    size: jax.Array
    index: jax.Array

    @property
    def capacity(self) -> int:
        return self.tokens.shape[0]

    @classmethod
    def build(cls, prompts, max_new, keys, capacity: int, prompt_width: int,
              first: int = 0, index=None) -> PromptQueue:
        """The queue of `len(prompts) <= capacity` token-id prompts (each at most prompt_width
        long), max_new `[N]` ints (or one for all), keys `[N, 2]` uint32, padded to `capacity`
        entries (host); their job indices: `index` `[N]`, else first, first + 1, ..."""
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
        job_index = np.full((capacity,), -1, np.int32)
        job_index[:count] = np.arange(first, first + count) if index is None else index
        return cls(jnp.asarray(tokens), jnp.asarray(lengths), jnp.asarray(max_new_rows),
                   jnp.asarray(key_rows), jnp.int32(count), jnp.asarray(job_index))


@struct.dataclass
class ChunkOutputs:
    """The rows that ended during one call, in the order they ended (entries from `count` on
    are unused).

    prompt: `[Q + B]` int32 the row's job index (-1: unused); tokens `[Q + B, W]` int32 the
    row's buffer (prompt, then `num_tokens - length` new tokens); num_tokens `[Q + B]`,
    stop_reason `[Q + B]` int32 (`loop.STOP_REASONS`); metrics: `SpecMetrics` `[Q + B]` when
    speculating, else None; count: `[]` int32 the rows.
    """

    prompt: jax.Array
    tokens: jax.Array
    num_tokens: jax.Array
    stop_reason: jax.Array
    metrics: SpecMetrics | None
    count: jax.Array


@struct.dataclass
class SlotCounters:
    """How the slots spent one call (`[]` int32 each).

    decode_steps: decoding steps over all B slots; busy_slot_steps: slot-steps of running
    rows (utilisation = busy / (decode_steps * B)); refills: refill passes (each a prefill of
    `policy.rows` rows, or of B when every slot was free); prefilled: prompts started.
    """

    decode_steps: jax.Array
    busy_slot_steps: jax.Array
    refills: jax.Array
    prefilled: jax.Array


@struct.dataclass
class Slots:
    """The B slots, from one call to the next.

    state: the slots' `DecodeState` (rows, cache); drafter_state: the drafter's state (its rows
    and its job-level carry), None for plain decoding; metrics: `SpecMetrics` `[B]` of the
    running rows, or None; prompt: `[B]` int32 the job index of each slot's row (-1: free).
    """

    state: DecodeState
    drafter_state: object
    metrics: SpecMetrics | None
    prompt: jax.Array


@struct.dataclass
class RefillCarry:
    """One call's loop state: the slots, the queue's progress and the rows ended so far.

    next_prompt: `[]` int32 the first queue entry not started yet.
    """

    slots: Slots
    next_prompt: jax.Array
    outputs: ChunkOutputs
    counters: SlotCounters


# ---- building blocks ---------------------------------------------------------------------------


def empty_slots(cache: KVCache, width: int) -> DecodeState:
    """B slots holding no prompt (done, one padding token): `[B]` from the cache's rows."""
    batch = cache.lengths.shape[0]
    return init_state(jnp.zeros((batch, 1), jnp.int32), jnp.ones((batch,), jnp.int32),
                      jnp.zeros((batch,), jnp.int32), cache, jnp.zeros((batch, 2), jnp.uint32), width)


def start_slots(drafter, drafter_params, cache: KVCache, drafter_carry=(), *, width: int) -> Slots:
    """A job's B free slots (B = the cache's rows, buffers of width W): the drafter's state
    starts from its job-level carry (`drafter.init_carry` or an earlier job's)."""
    state = empty_slots(cache, width)
    batch = state.done.shape[0]
    if drafter is None:
        return Slots(state, None, None, jnp.full((batch,), -1, jnp.int32))
    drafter_state = drafter.resume(drafter.init(drafter_params, batch, width), drafter_carry)
    return Slots(state, drafter_state, SpecMetrics.for_drafter(batch, drafter),
                 jnp.full((batch,), -1, jnp.int32))


def empty_outputs(capacity: int, width: int, drafter) -> ChunkOutputs:
    """Room for `capacity` ended rows (metrics sized for the drafter, None without one)."""
    zeros = jnp.zeros((capacity,), jnp.int32)
    metrics = None if drafter is None else SpecMetrics.for_drafter(capacity, drafter)
    return ChunkOutputs(jnp.full((capacity,), -1, jnp.int32), jnp.zeros((capacity, width), jnp.int32),
                        zeros, zeros, metrics, jnp.zeros((), jnp.int32))


def harvest(carry: RefillCarry) -> RefillCarry:
    """Appends every ended slot's row to the outputs (in slot order); those slots are free."""
    slots, outputs = carry.slots, carry.outputs
    ended = slots.state.done & (slots.prompt >= 0)
    rank = jnp.cumsum(ended) - 1
    dest = jnp.where(ended, outputs.count + rank, outputs.prompt.shape[0])  # Q + B: dropped
    state = slots.state
    rows = (slots.prompt, state.tokens, state.num_tokens, state.stop_reason, slots.metrics)
    kept = (outputs.prompt, outputs.tokens, outputs.num_tokens, outputs.stop_reason, outputs.metrics)
    written = jax.tree.map(lambda out, row: out.at[dest].set(row, mode="drop"), kept, rows)
    outputs = ChunkOutputs(*written, count=outputs.count + jnp.sum(ended).astype(jnp.int32))
    return carry.replace(outputs=outputs,
                         slots=slots.replace(prompt=jnp.where(ended, -1, slots.prompt)))


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


def prompts_left(carry: RefillCarry, queue: PromptQueue) -> jax.Array:
    """`[]` int32: the call's queued prompts not started yet."""
    return queue.size - carry.next_prompt


def wants_refill(carry: RefillCarry, queue: PromptQueue, policy: RefillPolicy) -> jax.Array:
    """`[]` bool: prompts are queued and at least min(min_free, prompts left) slots have ended
    (or none is running)."""
    left = prompts_left(carry, queue)
    done = carry.slots.state.done
    ended = jnp.sum(done)
    return (left > 0) & ((ended >= jnp.minimum(policy.min_free, left)) | jnp.all(done))


def keeps_running(carry: RefillCarry, queue: PromptQueue, last: jax.Array) -> jax.Array:
    """`[]` bool: a row is running or a prompt is queued, unless the call is not the job's last
    (`last` False), its queue is empty and a slot is free: then the next call's prompts fill it."""
    done = carry.slots.state.done
    left = prompts_left(carry, queue)
    pause = ~last & (left <= 0) & jnp.any(done)
    return (jnp.any(~done) | (left > 0)) & ~pause


def draining(carry: RefillCarry, queue: PromptQueue, last: jax.Array) -> jax.Array:
    """`[]` bool: no queued prompt will take the slot of a row that ends: the queue is empty
    and the call is the job's last (a call that is not stops at a free slot, and the next
    call's prompts fill it). Auto's pick reads it (`Drafter.draining`)."""
    return last & (prompts_left(carry, queue) <= 0)


# ---- the loop ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Decoder:
    """What one loop runs (static): the target, the drafter (None: plain decoding) and the
    policy."""

    target: TargetModel
    drafter: object
    policy: RefillPolicy

    def refill_pass(self, rows: int, params, drafter_params, queue: PromptQueue,
                    carry: RefillCarry, sampling: SamplingParams, criteria: StopCriteria) -> RefillCarry:
        """Harvests the ended slots and starts up to `rows` (static) queued prompts in free ones,
        prefilled as one batch of `rows` rows."""
        carry = harvest(carry)
        drafter, slots = self.drafter, carry.slots
        width = slots.state.tokens.shape[1]
        left = prompts_left(carry, queue)
        place = pick_slots(slots.state.done, left, rows)
        use = place < slots.state.done.shape[0]
        tokens, lengths, max_new, keys = queued_rows(queue, carry.next_prompt, use)
        cache = as_target(self.target).init_cache(rows, width)
        fresh = init_state(tokens, lengths, max_new, cache, keys, width)
        hidden_layers = () if drafter is None else drafter.hidden_layers
        fresh, prefill_out = prefill(self.target, params, fresh, tokens.shape[1], sampling,
                                     criteria, hidden_layers)
        drafter_state, metrics = slots.drafter_state, slots.metrics
        if drafter is not None:
            drafter_state = drafter.refill(drafter_params, drafter_state, fresh, prefill_out, place)
            metrics = put_rows(metrics, SpecMetrics.for_drafter(rows, drafter), place)
        started = jnp.sum(use).astype(jnp.int32)
        entry = jnp.clip(carry.next_prompt + jnp.arange(rows), 0, queue.capacity - 1)
        job_index = queue.index[entry]
        counters = carry.counters
        return carry.replace(
            slots=Slots(state=put_rows(slots.state, fresh, place), drafter_state=drafter_state,
                        metrics=metrics, prompt=slots.prompt.at[place].set(job_index, mode="drop")),
            next_prompt=carry.next_prompt + started,
            counters=counters.replace(refills=counters.refills + 1,
                                      prefilled=counters.prefilled + started),
        )

    def decode_step(self, params, drafter_params, carry: RefillCarry, sampling: SamplingParams,
                    criteria: StopCriteria, drains: jax.Array | bool = True) -> RefillCarry:
        """One decoding step over every slot (ended slots change nothing); auto may take
        several of its steps until its pick changes or a row ends (`drafters.auto`), counted
        from the state's step counter and the rows' step counts. drains: `draining`, which
        the drafter is told first."""
        slots, counters = carry.slots, carry.counters
        if self.drafter is None:
            state = ar_step(self.target, params, slots.state, sampling, criteria)
            counters = counters.replace(
                decode_steps=counters.decode_steps + 1,
                busy_slot_steps=counters.busy_slot_steps + jnp.sum(~slots.state.done).astype(jnp.int32))
            return carry.replace(slots=slots.replace(state=state), counters=counters)
        state, drafter_state, metrics = spec_step(
            self.target, params, self.drafter, drafter_params, slots.state,
            self.drafter.draining(slots.drafter_state, drains), slots.metrics, sampling, criteria)
        counters = counters.replace(
            decode_steps=counters.decode_steps + (state.step - slots.state.step).astype(jnp.int32),
            busy_slot_steps=counters.busy_slot_steps
            + jnp.sum(metrics.steps - slots.metrics.steps).astype(jnp.int32))
        return carry.replace(slots=slots.replace(state=state, drafter_state=drafter_state,
                                                 metrics=metrics), counters=counters)

    def run(self, params, drafter_params, queue: PromptQueue, slots: Slots,
            sampling: SamplingParams, criteria: StopCriteria, last):
        """(ChunkOutputs, SlotCounters, Slots) of one call over `queue`."""
        policy, batch = self.policy, slots.prompt.shape[0]
        width = slots.state.tokens.shape[1]
        if self.drafter is not None:
            drafter_params = self.drafter.loop_params(drafter_params)
        zero = jnp.zeros((), jnp.int32)
        carry = RefillCarry(slots=slots, next_prompt=zero,
                            outputs=empty_outputs(queue.capacity + batch, width, self.drafter),
                            counters=SlotCounters(zero, zero, zero, zero))

        def refill(rows, c):
            return self.refill_pass(rows, params, drafter_params, queue, c, sampling, criteria)

        def fill(c):
            return jax.lax.while_loop(lambda c: wants_refill(c, queue, policy),
                                      lambda c: refill(policy.rows, c), c)

        if policy.rows < batch and batch >= policy.batch_fill_from:  # all free: one batch
            carry = jax.lax.cond(jnp.all(carry.slots.state.done) & (queue.size > 0),
                                 lambda c: refill(batch, c), lambda c: c, carry)

        def body(c):
            c = fill(c)
            return self.decode_step(params, drafter_params, c, sampling, criteria,
                                    draining(c, queue, last))

        carry = jax.lax.while_loop(lambda c: keeps_running(c, queue, last), body, carry)
        carry = harvest(carry)
        return carry.outputs, carry.counters, carry.slots


def run_refill(target: TargetModel, params, drafter, drafter_params, queue: PromptQueue,
               slots: Slots, sampling: SamplingParams, criteria: StopCriteria, last=True, *,
               policy: RefillPolicy = RefillPolicy()):
    """The prompts of `queue` decoded in `slots` (`start_slots`, or an earlier call's), refilling
    slots as rows end, as ONE XLA program (`refill_program`).

    target: static, a `TargetModel` or a ModelConfig; drafter: static, None for plain decoding;
    the slots' buffer width W must hold P + max(max_new) (+ the tree's nodes + 1 when
    speculating), for the rows still running in them too; slots: donated. last: `[]` bool,
    True when no queue follows: the call runs until every row has ended; False: it stops once
    the queue is empty and a slot is free, the running rows carried to the next call.
    Returns (ChunkOutputs `[Q + B, ...]` of the rows that ended, SlotCounters, the slots).
    """
    return Decoder(target, drafter, policy).run(params, drafter_params, queue, slots, sampling,
                                                criteria, jnp.asarray(last, bool))


slots_program = program(start_slots, static_argnames=("drafter", "width"),
                        donate_argnames=("cache", "drafter_carry"))
refill_program = program(run_refill, static_argnames=("target", "drafter", "policy"),
                         donate_argnames=("slots",))
