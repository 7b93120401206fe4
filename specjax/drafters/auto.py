"""`num_draft="auto"`: the draft shape picked every step, inside the program.

`AutoDrafter` wraps a drafter whose state does not depend on its draft tree
(`Drafter.shape_free_state`: n-gram, suffix, a draft model, layerskip and every learned head,
EAGLE-3, MTP, Medusa, DFlash, DSpark; not the measurement drafter `forced`). Its step (`switched_step`, which `loop.spec_step`
runs for it) runs one of a few chain lengths `lengths` (0 = a plain decoding step), every
branch the whole step of that shape on the same operands:

- D > 0: `loop.fixed_spec_step` of the inner drafter re-shaped to a chain of D (the state is
  the same pytree for every D, so each branch reads and writes it as it is);
- D = 0: `loop.ar_step_out` and the inner drafter's `update` with the root's row as the
  accepted path (the learned heads ingest the root's features there). A drafter whose
  proposal is a lookup (`Drafter.observe_plain_steps`: n-gram, suffix) also proposes a chain
  `watch_depth` long and watches it, one depth a step: a fresh chain's first token against
  the token this step samples, then while they agree the next depths against the next plain
  steps' tokens (what a spec step of that chain would have accepted; no verify cost), so a
  job decoding plain learns every depth's acceptance for free, and its first step is plain
  (`plain_first`) rather than one priced from the prior. One that runs a model to propose
  only `sync`s instead (a draft model feeds the token before the
  root, layerskip copies it from the target's cache, so the draft cache stays valid below
  `num_tokens - 2` as after any spec step), and the step costs what a plain decoding step
  does: running the proposal there made layerskip:8's plain branch 1.7x a plain step, and auto
  0.53x plain decoding where it rightly picked D = 0.

The candidate chain lengths are those the drafter can produce: `auto_lengths` up to
`auto_max_draft(drafter)` (a Medusa head: its head count, DFlash / DSpark: block_size - 1).

The branches are a chain of `while_loop`s, one per shape: the picked branch keeps stepping in
its own loop while it stays the pick and no row ends. Not a `lax.switch`: XLA gives each
branch of a conditional its own copy of what it writes in place (the whole KV cache, in and
out, at every change of shape), while the loops carry it in place. A lookup drafter's chains
share one loop where that loop's verify is narrow (`merged`: B x (1 + the longest chain) <=
`merge_rows`, one row of a chain of 8): its proposal costs the same at any length, so the loop proposes
the longest chain and verifies it with the pick's length as data (`loop.fixed_spec_step`'s
live_depth): the nodes deeper than the pick are invalid, and their verify rows dead, which the
CPU kernels skip (`specjax.verify`). One target forward serves every chain length: the
program compiles two forwards (the plain step's and the chains') instead of one per shape,
and a chain of D costs about what a static chain of D does at B = 1 (`benchmarks/auto_merged.py`);
not at B = 8, where the dead rows' XLA work made a merged chain of 1 cost 1.34x a static one.

Each step picks the branch with the highest predicted tokens/s (`specjax.costmodel`, the
tuner's model): the sum over the active rows of each row's E[tokens per step](D), from the
running estimate of that row's conditional acceptance per depth, over the branch's measured
step cost at the program's cache width (`AutoParams.costs_at`, from `specjax.auto_costs`).
While the job drains (`AutoState.draining`: a static batch, a refilling job's last call once
its queue is empty) the pick is the soonest predicted end of the slowest running row instead
(`finish_rates`): no prompt takes the slot of a row that ends early then.
Greedy and sampled outputs stay exact: each branch is a lossless step, and the pick depends
only on earlier steps.

The estimates are exponential moving averages, one update per observation: a row whose first
j draft tokens were accepted observes depth j (accepted or not; an empty draft position counts
as not). Each row keeps its own (`AutoState.conditional` `[B, Dmax]`: acceptance follows the
content, so a job mixing categories, or one prompt that repeats itself among others that do
not, is predicted row by row), and the job keeps one over all its rows' observations
(`AutoState.job` `[Dmax, R]`), which a refilled row starts from. Until a row's observations
outweigh where it started (the prior, or the job's estimate, counted as `prior_weight`
observations), its estimate is their mean with it (a Beta posterior's mean), so its first
steps are not spent on a shape the prior over-rates. Depths no step observes drift back to the
prior, so a shape ruled out early is tried again later. A draft shape is picked over plain
decoding only when predicted `min_gain` (5 %) faster: the margin the cost profile's and the
estimate's noise must clear before speculating can cost more than it saves.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.costmodel import chain_tokens_per_steps, throughput, tree_tokens_per_step
from specjax.drafters.base import Drafter
from specjax.gather import put_rows
from specjax.loop import DecodeState, ar_step_out, fixed_spec_step
from specjax.rng import split_rows
from specjax.tree import TreeSpec, chain, from_paths
from specjax.types import AcceptResult

#: candidate chain lengths of auto (plus the tile-aligned ones in range, `auto_lengths`)
BASE_LENGTHS = (0, 1, 2, 4, 8)
TILE_ROWS = 128


def envelope(max_depth: int, trees: tuple[TreeSpec, ...] = ()) -> TreeSpec:
    """Auto's own `tree`: a chain of max_depth, widened by depth-1 leaves to as many nodes as
    its largest tree branch has: what the cache margin (nodes) and the metrics (depth) size by."""
    nodes = max([max_depth] + [t.num_nodes for t in trees])
    if nodes == max_depth:
        return chain(max_depth)
    paths = [[0] * d for d in range(1, max_depth + 1)] + [[r] for r in range(1, nodes - max_depth + 1)]
    return from_paths(paths, name=f"auto{max_depth}x{nodes}")


def auto_max_draft(drafter: Drafter, longest: int = max(BASE_LENGTHS)) -> int:
    """The longest chain auto compiles for `drafter`: `longest`, or less when the drafter
    cannot draft that deep (`Drafter.deepest_draft`)."""
    deepest = drafter.deepest_draft
    return longest if deepest is None else max(1, min(longest, deepest))


def auto_lengths(group_size: int | None, max_draft: int = max(BASE_LENGTHS)) -> tuple[int, ...]:
    """The chain lengths auto compiles: `BASE_LENGTHS` up to max_draft, max_draft itself (a
    drafter's deepest chain, e.g. a Medusa head's head count), plus 128/G - 1 and the D with
    G(1 + D) a multiple of 128 where they fall in 1..max_draft (G: query heads per KV head)."""
    extra = {max_draft}
    if group_size:
        extra |= {TILE_ROWS // group_size - 1} | {
            d for d in range(1, max_draft + 1) if group_size * (1 + d) % TILE_ROWS == 0}
    return tuple(sorted({d for d in BASE_LENGTHS + tuple(extra) if 0 <= d <= max_draft}))


@struct.dataclass
class AutoParams:
    """inner: the inner drafter's params; step_s f32: each branch's step seconds at this batch
    size, `[S]` at any cache width, or `[2, S]` at the two cache widths `widths` `[2]` (a line
    through them gives the cost at the program's width, `costs_at`). Dynamic: new costs never
    recompile."""

    inner: Any
    step_s: jax.Array
    widths: jax.Array | None = None

    def costs_at(self, width: int) -> jax.Array:
        """`[S]` each branch's step seconds in a program whose cache holds `width` tokens: on
        the line through the two profiled widths, at the narrower one's cost below it (what a
        step costs on top of its attention does not shrink with the cache)."""
        if self.widths is None:
            return self.step_s
        (narrow, wide), (cost_narrow, cost_wide) = self.widths, self.step_s
        slope = (cost_wide - cost_narrow) / jnp.maximum(wide - narrow, 1.0)
        return cost_narrow + slope * jnp.maximum(width - narrow, 0.0)


@struct.dataclass
class AutoState:
    """inner: the inner drafter's state; conditional `[B, Dmax]` f32: each row's running
    estimate of P(draft token j + 1 accepted | the first j were)."""

    inner: Any
    conditional: jax.Array
    siblings: jax.Array  # [B, Dmax, R - 1] the same for the candidates of rank 1..R-1 (trees)
    job: jax.Array  # [Dmax, R] the job's estimate over all its rows (ranks 0..R-1): a new row's start
    seen: jax.Array  # [B, Dmax, R] observations behind each row's estimate (capped: `updated_estimate`)
    job_seen: jax.Array  # [Dmax, R] the same for the job's
    #: [B, Dmax] int32 the chain a lookup drafter proposed at a row's last fresh plain step
    #: (-1: no token), which its next plain steps check token by token (`AutoDrafter.watch`)
    watched: jax.Array
    watch_at: jax.Array  # [B] int32 the depth of `watched` the row's next plain step checks (0: a fresh chain)
    #: [] bool: no queued prompt takes a slot whose row ends (a static batch; a refilling job's
    #: last call once its queue is empty): the job ends with its slowest row (`finish_rates`)
    draining: jax.Array

    @property
    def unobserved(self) -> jax.Array:
        """`[]` bool: the job has observed nothing yet (its first step: `plain_first`)."""
        return self.job_seen[0, 0] == 0


@dataclasses.dataclass(frozen=True)
class AutoDrafter(Drafter):
    """An inner drafter (any tree) driven at the draft shape each step predicts fastest: a
    chain of one of `lengths` or one of the draft trees `trees` (depth <= max(lengths)).
    `tree`: `envelope(max(lengths), trees)` (what margins and metrics size by)."""

    inner: Drafter | None = None
    lengths: tuple[int, ...] = BASE_LENGTHS
    trees: tuple[TreeSpec, ...] = ()
    prior: float = 0.5  # the estimate before any observation, and where unobserved depths drift
    prior_weight: float = 2.0  # the prior (or a refilled row's start, the job's) counts as this many observations
    decay: float = 0.9  # EMA weight kept per observation, once the observations outweigh the prior
    relax: float = 0.01  # per step, unobserved depths move this much of the way to the prior
    min_gain: float = 0.05  # a draft shape must beat plain decoding's predicted tokens/s by this fraction
    #: how deep a lookup drafter's plain steps observe (None: max(lengths); 1: depth 0 only)
    watch: int | None = None
    #: a lookup drafter's plain steps propose a fresh chain to watch on every this-many-th
    #: step only (and at the job's first): the suffix's proposal (its table's catch-up) costs
    #: ~1 ms of a ~30 ms SmolLM2 step at B = 4 on the CPU
    watch_every: int = 4
    #: a lookup drafter's job starts with a plain step (its first observations cost nothing)
    plain_first: bool = True
    rotate: bool = False  # test hook: branch = step % S (visits every branch) instead of the pick
    #: a lookup drafter's chains run in one loop at the longest chain, the pick's length as data
    #: (`merged`); False: a loop (and a target forward) per chain length, for A/B runs
    merge: bool = True
    #: ... where the merged verify holds at most this many rows (B x (1 + the longest chain)):
    #: its dead rows cost XLA's per-row work (norms, rope, SwiGLU, cache writes, the logits'
    #: checks), about even with a loop per length at B = 1 (9 rows), 1.34x a static chain of 1's
    #: step at B = 8 (72 rows; SmolLM2 f32, `benchmarks/auto_overhead.py`)
    merge_rows: int = 16

    def __post_init__(self):
        if self.inner is None or not self.inner.shape_free_state:
            raise ValueError("auto needs a drafter whose state does not depend on its tree "
                             f"(Drafter.shape_free_state), got {self.inner and self.inner.name}")
        if self.watch is not None and not 1 <= self.watch <= max(self.lengths, default=0):
            raise ValueError(f"auto's watch must be in 1..{max(self.lengths)}, got {self.watch}")
        if not self.watch_every >= 1:
            raise ValueError(f"auto's watch_every must be >= 1, got {self.watch_every}")
        if not self.merge_rows >= 1:
            raise ValueError(f"auto's merge_rows must be >= 1, got {self.merge_rows}")
        if not self.min_gain >= 0.0:
            raise ValueError(f"auto's min_gain must be >= 0, got {self.min_gain}")
        if 0 not in self.lengths or sorted(set(self.lengths)) != list(self.lengths):
            raise ValueError(f"auto lengths must be sorted, distinct and include 0, got {self.lengths}")
        deep = [t.name for t in self.trees if t.max_depth > max(self.lengths)]
        if deep:
            raise ValueError(f"auto's trees must be at most {max(self.lengths)} deep: {deep}")
        if self.tree != envelope(max(self.lengths), self.trees):
            raise ValueError(f"auto's tree must be envelope({max(self.lengths)}, trees), got {self.tree}")

    @classmethod
    def wrap(cls, inner: Drafter, lengths: tuple[int, ...] = BASE_LENGTHS,
             trees: tuple[TreeSpec, ...] = (), **options) -> AutoDrafter:
        """`inner` (any tree) driven by auto over the chains `lengths` and the trees `trees`."""
        inner = dataclasses.replace(inner, tree=chain(max(lengths)))
        trees = tuple(trees)
        return cls(tree=envelope(max(lengths), trees), hidden_layers=inner.hidden_layers,
                   inner=inner, lengths=lengths, trees=trees, **options)

    @property
    def num_ranks(self) -> int:
        """R: the candidate ranks the acceptance estimate tracks (1 + the trees' largest)."""
        return 1 + max([max(t.ranks) for t in self.trees] or [0])

    @property
    def num_shapes(self) -> int:
        return len(self.lengths) + len(self.trees)

    @property
    def slots(self) -> tuple[int, ...]:
        """Each branch's `SpecMetrics.shape_steps` slot: D for a chain, Dmax + 1 + i for tree i."""
        top = self.tree.max_depth
        return tuple(self.lengths) + tuple(top + 1 + i for i in range(len(self.trees)))

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def watch_depth(self) -> int:
        """How deep a plain step observes: the chain `watch` (default max(lengths)) long that
        a lookup drafter proposes there (`_plain_branch`); 0 for one that runs a model."""
        if not self.inner.observe_plain_steps:
            return 0
        return int(self.watch or max(self.lengths))

    def shaped(self, num_draft: int) -> Drafter:
        """The inner drafter on a chain of num_draft >= 1."""
        return dataclasses.replace(self.inner, tree=chain(num_draft))

    # ---- the drafter interface, delegated to the inner drafter ----

    def check_target(self, target_cfg) -> None:
        self.inner.check_target(target_cfg)

    def init(self, params: AutoParams, batch_size: int, width: int) -> AutoState:
        job = jnp.full((self.tree.max_depth, self.num_ranks), self.prior, jnp.float32)
        rows = jnp.broadcast_to(job, (batch_size,) + job.shape)
        return AutoState(self.inner.init(params.inner, batch_size, width), rows[..., 0],
                         rows[..., 1:], job, jnp.zeros_like(rows), jnp.zeros_like(job),
                         *unwatched(batch_size, self.tree.max_depth), jnp.ones((), bool))

    def init_carry(self, params: AutoParams):
        return self.inner.init_carry(params.inner)

    def loop_params(self, params: AutoParams) -> AutoParams:
        return params.replace(inner=self.inner.loop_params(params.inner))

    def resume(self, state: AutoState, carry) -> AutoState:
        return state.replace(inner=self.inner.resume(state.inner, carry))

    def carry(self, state: AutoState):
        return self.inner.carry(state.inner)

    def prefill(self, params: AutoParams, state: AutoState, decode, target_out) -> AutoState:
        return state.replace(inner=self.inner.prefill(params.inner, state.inner, decode, target_out))

    def refill(self, params: AutoParams, state: AutoState, decode, target_out, slots) -> AutoState:
        """The inner drafter's refill; the new rows' acceptance estimates start from the job's
        (weighted as the prior is: no observation of the row's own yet)."""
        fresh = jnp.broadcast_to(state.job, slots.shape + state.job.shape)
        rows = put_rows((state.conditional, state.siblings, state.seen, state.watched, state.watch_at),
                        (fresh[..., 0], fresh[..., 1:], jnp.zeros_like(fresh),
                         *unwatched(slots.shape[0], self.tree.max_depth)), slots)
        return state.replace(inner=self.inner.refill(params.inner, state.inner, decode, target_out, slots),
                             conditional=rows[0], siblings=rows[1], seen=rows[2],
                             watched=rows[3], watch_at=rows[4])

    def draining(self, state: AutoState, draining: jax.Array) -> AutoState:
        return state.replace(draining=jnp.asarray(draining, bool))

    def propose(self, params, state, decode, key, sampling):
        raise TypeError("auto picks its shape per step: run it through loop.spec_step")

    # ---- the step ----

    def row_tokens(self, state: AutoState) -> jax.Array:
        """`[B, S]` each row's E[tokens per step] of each branch, from its own estimate."""

        def row(conditional, siblings):  # [Dmax], [Dmax, R - 1] -> [S]
            per_step = chain_tokens_per_steps(conditional, self.lengths)
            if not self.trees:
                return per_step
            return jnp.concatenate([per_step, jnp.stack([
                tree_tokens_per_step(conditional, siblings, t) for t in self.trees])])

        return jax.vmap(row)(state.conditional, state.siblings)

    def predicted(self, params: AutoParams, state: AutoState, active: jax.Array, width: int = 0):
        """(`[S]` predicted tokens/s of each branch, `[S]` its E[tokens per step] per active
        row) for the active rows `[B]` of a program with a `width`-token cache: the cost model
        of `specjax.costmodel`, each row's E[tokens per step] from its own estimate."""
        on = active.astype(jnp.float32)
        rows = jnp.sum(on)
        per_step = on @ self.row_tokens(state) / jnp.maximum(rows, 1.0)
        return throughput(per_step, rows, params.costs_at(width)), per_step

    def finish_rates(self, params: AutoParams, state: AutoState, decode: DecodeState) -> jax.Array:
        """`[S]` 1 / the predicted seconds until every running row has its tokens, per branch:
        min over the running rows of E[tokens per step] / tokens left, over the step cost.
        While a job drains, a row that ends early frees a slot nothing takes, so its steps are
        worth nothing once the slowest row is behind: a draft shape that speeds most rows up but
        not the slowest one only makes every step dearer (SmolLM2, B = 8, eight extraction
        prompts, suffix: auto took D = 1 for its predicted 1.15x tokens/s, the rows drifted
        apart and the batch took 38 steps of 1.31x the plain step's cost against plain
        decoding's 47: 0.94x plain)."""
        width = decode.tokens.shape[1]
        left = jnp.maximum(decode.max_new - decode.num_new, 1).astype(jnp.float32)
        rate = jnp.where((~decode.done)[:, None], self.row_tokens(state) / left[:, None], jnp.inf)
        return jnp.min(rate, axis=0) / params.costs_at(width)

    def pick(self, params: AutoParams, state: AutoState, decode: DecodeState):
        """(`[]` int32 the branch this step runs, `[S]` E[tokens per step] per active row): the
        highest predicted tokens/s, or while the job drains (`AutoState.draining`) the soonest
        predicted end of its running rows (`finish_rates`)."""
        tokens_per_s, per_step = self.predicted(params, state, ~decode.done, decode.tokens.shape[1])
        if self.rotate:
            return (decode.step % self.num_shapes).astype(jnp.int32), per_step
        rates = jnp.where(state.draining, self.finish_rates(params, state, decode), tokens_per_s)
        index = jnp.argmax(handicapped(rates, self.min_gain)).astype(jnp.int32)
        if self.plain_first and self.watch_depth:  # nothing observed yet: a free look first
            index = jnp.where(state.unobserved, 0, index)
        return index, per_step

    def switched_step(self, target, params, drafter_params: AutoParams, state: DecodeState,
                      drafter_state: AutoState, metrics, sampling, criteria, branch=None,
                      steps: int = 1):
        """`loop.spec_step` for auto -> (state, drafter state, metrics), the estimates and the
        shape metrics updated after every step.

        The branches are a chain of `while_loop`s, one per shape, run one after the other:
        branch i's loop steps while i is the pick, no row has ended (the caller may refill the
        slot) and some row runs. One call is one step or more, each picked exactly as a call
        per step would pick it; a pick of an earlier branch waits for the next call. A chain
        of loops rather than a `lax.switch`: XLA gives each branch of a conditional its own
        copy of what it writes in place (jaxlib 0.10.2, copy insertion: the whole KV cache and
        the drafter's state, in and out again, at every entry; `benchmarks/switch_copies.py`),
        while a loop carries its buffers in place. `branch` `[]` (profiling): that branch for
        exactly `steps` `[]` steps."""
        update = functools.partial(updated_estimate, prior=self.prior, decay=self.decay,
                                   relax=self.relax, prior_weight=self.prior_weight)
        width = state.tokens.shape[1]

        def body(index: int | None, carry):
            state, auto_state, metrics, count, _, per_step, picked = carry
            active = ~state.done
            if index is None:  # a chain of the pick's length in the merged loop (`merged`)
                index = picked
                state, inner, metrics, reached, hits = self._branch(
                    jnp.asarray(self.lengths, jnp.int32)[index], target, params, drafter_params.inner,
                    sampling, criteria, state, auto_state.inner, metrics)
                watched, watch_at = auto_state.watched, jnp.zeros_like(auto_state.watch_at)
            elif index == 0:  # lengths[0] == 0: plain decoding, watching the lookup's chain
                state, inner, metrics, reached, hits, watched, watch_at = self._plain_branch(
                    target, params, drafter_params.inner, sampling, criteria, state,
                    auto_state.inner, metrics, auto_state.watched, auto_state.watch_at,
                    first=auto_state.unobserved)
            else:  # a spec step: the next plain step watches a fresh chain
                one = (functools.partial(self._branch, self.lengths[index]) if index < len(self.lengths)
                       else functools.partial(self._tree_branch, self.trees[index - len(self.lengths)]))
                state, inner, metrics, reached, hits = one(target, params, drafter_params.inner, sampling,
                                                           criteria, state, auto_state.inner, metrics)
                watched, watch_at = auto_state.watched, jnp.zeros_like(auto_state.watch_at)
            metrics = metrics.record_shape(active, jnp.asarray(self.slots)[index], per_step[index],
                                           drafter_params.costs_at(width)[index])
            rows, seen = update(jnp.concatenate([auto_state.conditional[..., None],
                                                 auto_state.siblings], -1), auto_state.seen, reached, hits)
            job, job_seen = update(auto_state.job, auto_state.job_seen, reached.sum(0), hits.sum(0))
            auto_state = AutoState(inner, rows[..., 0], rows[..., 1:], job, seen, job_seen,
                                   watched, watch_at, auto_state.draining)
            count = count + 1
            next_index, per_step = self.pick(drafter_params, auto_state, state)  # the next step's
            if branch is not None:
                go, next_index = count < steps, branch
            else:
                ended = jnp.any(active & state.done)  # a row ended: its slot may be refilled
                go = ~ended & jnp.any(~state.done)
            return state, auto_state, metrics, count, go, per_step, next_index

        index, per_step = self.pick(drafter_params, drafter_state, state)
        if branch is not None:
            index = jnp.asarray(branch, jnp.int32)
        go = jnp.asarray(True) if branch is None else steps > 0
        carry = (state, drafter_state, metrics, jnp.zeros((), jnp.int32), go, per_step, index)
        chains = len(self.lengths)
        merged = self.merged(state.tokens.shape[0])
        for i in range(self.num_shapes):
            if merged and 0 < i < chains:
                if i == 1:
                    carry = jax.lax.while_loop(lambda c: c[4] & (c[6] >= 1) & (c[6] < chains),
                                               functools.partial(body, None), carry)
                continue
            carry = jax.lax.while_loop(lambda c, i=i: c[4] & (c[6] == i),
                                       functools.partial(body, i), carry)
        return carry[:3]

    def merged(self, batch_size: int) -> bool:
        """Whether the chains run in one loop at `batch_size` rows, at the longest chain with the
        pick's length as data (`fixed_spec_step`'s live_depth): a lookup drafter's proposal
        costs the same at any length, and the target's kernels skip the rows of the nodes
        deeper than the pick; where that verify holds at most `merge_rows` rows."""
        return (self.merge and bool(self.inner.observe_plain_steps) and len(self.lengths) > 2
                and self.merged_verify_rows(batch_size) <= self.merge_rows)

    def merged_verify_rows(self, batch_size: int) -> int:
        """Rows of the merged loop's verify at `batch_size` rows: each row's root and the
        longest chain."""
        return batch_size * (1 + max(self.lengths))

    def _branch(self, num_draft: int | jax.Array, target, params, inner_params, sampling, criteria,
                state: DecodeState, inner_state, metrics):
        """One step of a chain of num_draft >= 1 (traced: the longest chain, its nodes deeper
        than num_draft dead) -> (state, inner state, metrics,
        reached `[B, Dmax, R]`, hits `[B, Dmax, R]`: whether each row observed depth j's
        candidate of rank r, and accepted it; a chain observes rank 0 only)."""
        active = ~state.done
        before = metrics.accepted
        traced = isinstance(num_draft, jax.Array)  # the merged loop's pick
        drafter = self.shaped(max(self.lengths) if traced else num_draft)
        state, inner_state, metrics = fixed_spec_step(
            target, params, drafter, inner_params, state, inner_state, metrics,
            sampling, criteria, live_depth=num_draft if traced else None)
        reached, hits = observations(active, metrics.accepted - before, num_draft, self.tree.max_depth)
        return state, inner_state, metrics, *self._ranked(reached, hits)

    def _ranked(self, reached, hits):
        """`[B, Dmax]` rank-0 observations -> `[B, Dmax, R]` (none of the other ranks)."""
        pad = lambda x: jnp.pad(x[..., None], ((0, 0), (0, 0), (0, self.num_ranks - 1)))
        return pad(reached), pad(hits)

    def _tree_branch(self, tree: TreeSpec, target, params, inner_params, sampling, criteria,
                     state: DecodeState, inner_state, metrics):
        """One step of the draft tree `tree` -> `_branch`'s values (every rank observed)."""
        active = ~state.done
        drafter = dataclasses.replace(self.inner, tree=tree)
        state, inner_state, metrics, result = fixed_spec_step(
            target, params, drafter, inner_params, state, inner_state, metrics, sampling, criteria,
            with_result=True)
        reached, hits = tree_observations(active, result.path, result.num_accepted, tree,
                                          self.tree.max_depth, self.num_ranks)
        return state, inner_state, metrics, reached, hits

    def _plain_branch(self, target, params, inner_params, sampling, criteria, state: DecodeState,
                      inner_state, metrics, watched: jax.Array, watch_at: jax.Array,
                      first: jax.Array | bool = True):
        """A plain step, the drafter kept in step (`update` with the root as the accepted path)
        -> `_branch`'s values and the watched chains (`AutoState.watched`, `.watch_at`).

        A lookup drafter (`observe_plain_steps`) proposes a chain `watch_depth` long and its
        plain steps observe it for free, one token a step: a row with no chain under watch
        checks a fresh one's token at depth 0 against the token this step samples; while
        they agree, its next plain steps check depths 1, 2, ... of the same chain against the
        tokens they sample (what a spec step of that chain would have accepted, greedy; with
        sampling, accepted with the same probability p(token)); a miss, the chain's end or a
        spec step ends the watch. Fresh chains are proposed on every `watch_every`-th step
        (`DecodeState.step`) and where `first` `[]` (nothing observed yet), inside a loop of
        0 or 1 trips (not a `lax.cond`, which would copy the drafter's state); a row waiting for
        one observes nothing meanwhile. So a job that decodes plain still learns each depth's
        acceptance at a fraction of the proposal's cost, and need not pay spec steps to
        explore. A drafter that runs a model to propose only `sync`s instead and observes
        nothing (the estimate relaxes to the prior, so a drafter that stopped paying is tried
        again now and then)."""
        active = ~state.done
        depth, max_depth = self.watch_depth, self.tree.max_depth
        if depth:
            propose_key = split_rows(state.next_keys(), state.tokens.shape[0], 2)[0]

            def propose(carry):
                draft, inner = self.shaped(depth).propose(inner_params, carry[0], state,
                                                          propose_key, sampling)
                fresh = jnp.pad(jnp.where(draft.valid, draft.tokens, -1),
                                ((0, 0), (0, max_depth - depth)), constant_values=-1)
                return inner, fresh, jnp.zeros((), bool)

            proposing = jnp.any(active & (watch_at == 0)) & (first | (state.step % self.watch_every == 0))
            inner_state, fresh, _ = jax.lax.while_loop(
                lambda carry: carry[2], propose,
                (inner_state, jnp.full(watched.shape, -1, jnp.int32), proposing))
        drafter = self.shaped(1)
        state, token, out = ar_step_out(target, params, state, sampling, criteria, drafter.hidden_layers)
        if not depth:
            inner_state = drafter.sync(inner_params, inner_state, state)
        zeros = jnp.zeros_like(token)
        result = AcceptResult(path=jnp.zeros((token.shape[0], 2), jnp.int32), num_accepted=zeros,
                              next_token=token)
        inner_state = drafter.update(inner_params, inner_state, state, result, out)
        metrics = metrics.record(active, zeros, zeros)
        if not depth:
            reached = hits = jnp.zeros((token.shape[0], max_depth), jnp.float32)
            return state, inner_state, metrics, *self._ranked(reached, hits), watched, watch_at
        reached, hits, watched, watch_at = watched_observations(active & ((watch_at > 0) | proposing),
                                                                token, fresh, watched, watch_at, depth)
        return state, inner_state, metrics, *self._ranked(reached, hits), watched, watch_at


def unwatched(batch_size: int, max_depth: int):
    """(watched `[B, Dmax]` int32, watch_at `[B]` int32) with no chain under watch."""
    return (jnp.full((batch_size, max_depth), -1, jnp.int32), jnp.zeros((batch_size,), jnp.int32))


def watched_observations(active: jax.Array, token: jax.Array, fresh: jax.Array, watched: jax.Array,
                         watch_at: jax.Array, depth: int):
    """One plain step's observations of the chains under watch -> (reached `[B, Dmax]`, hits
    `[B, Dmax]` f32 0/1, watched, watch_at): each active row (`[B]`) checks its chain's token
    at depth watch_at `[B]` (a row at 0 takes its fresh chain `[B, Dmax]`, -1 = no token)
    against the token it sampled `[B]`; a hit moves the watch one deeper, up to `depth`, a
    miss ends it."""
    live = watch_at > 0
    watched = jnp.where(live[:, None], watched, fresh)
    at = jnp.where(live, watch_at, 0)
    expected = jnp.take_along_axis(watched, at[:, None], axis=1)[:, 0]
    hit = active & (expected >= 0) & (expected == token)
    here = jax.nn.one_hot(at, watched.shape[1], dtype=jnp.float32)
    reached = here * active[:, None]
    hits = here * hit[:, None]
    watch_at = jnp.where(hit & (at + 1 < depth), at + 1, 0).astype(jnp.int32)
    return reached, hits, watched, watch_at


def handicapped(tokens_per_s: jax.Array, min_gain: float) -> jax.Array:
    """`[S]` predicted tokens/s (branch 0: plain decoding) with every draft shape's divided by
    1 + min_gain: a shape is picked over plain decoding only when predicted that much faster
    (the margin the cost and acceptance estimates' noise must clear)."""
    return tokens_per_s.at[1:].divide(1.0 + min_gain)


def observations(active: jax.Array, accepted: jax.Array, num_draft: int, max_depth: int):
    """(reached `[B, Dmax]`, hits `[B, Dmax]`) f32 0/1 of one step of a chain of num_draft:
    whether row b (active `[B]`) had its first j draft tokens accepted (j < num_draft), and
    whether it accepted token j + 1 too (accepted `[B]`)."""
    depth = jnp.arange(max_depth)[None, :]
    seen = active[:, None] & (depth < num_draft) & (accepted[:, None] >= depth)
    hit = seen & (accepted[:, None] > depth)
    return seen.astype(jnp.float32), hit.astype(jnp.float32)


def tree_observations(active: jax.Array, path: jax.Array, num_accepted: jax.Array,
                      tree: TreeSpec, max_depth: int, num_ranks: int):
    """(reached `[B, Dmax, R]`, hits `[B, Dmax, R]`) f32 0/1 of one step of a draft tree, per
    row: at each depth j below the row's accepted count, the accepted node of rank r observes
    ranks 0..r (r hit, the ones above it missed); at depth num_accepted, the ranks of the last
    accepted node's children in the tree all missed. path `[B, 1 + tree depth]` (verify indices, 0 = root)."""
    depth_t = tree.max_depth
    rank_of = jnp.asarray(np.concatenate([[0], tree.node_ranks]), jnp.int32)  # verify index -> rank
    present = np.zeros((tree.num_nodes + 1, num_ranks), bool)  # verify row -> its children's ranks
    for v, kids in enumerate(tree.children):
        for c in kids:
            present[v, tree.ranks[c]] = True
    depth = jnp.arange(depth_t)[None, :]
    rank = jnp.arange(num_ranks)[None, None, :]
    accepted = (depth < num_accepted[:, None]) & active[:, None]  # [B, Dt]
    accepted_rank = rank_of[path[:, 1:]][..., None]  # [B, Dt, 1]
    missed_at = ((depth == num_accepted[:, None]) & active[:, None])[..., None]
    last = jnp.take_along_axis(path, jnp.clip(num_accepted, 0, depth_t)[:, None], axis=1)[:, 0]
    seen = (accepted[..., None] & (rank <= accepted_rank)) | (missed_at & jnp.asarray(present)[last][:, None, :])
    hit = accepted[..., None] & (rank == accepted_rank)
    pad = lambda x: jnp.pad(x.astype(jnp.float32), ((0, 0), (0, max_depth - depth_t), (0, 0)))
    return pad(seen), pad(hit)


def updated_estimate(conditional: jax.Array, seen: jax.Array, reached: jax.Array, hits: jax.Array,
                     prior: float, decay: float, relax: float, prior_weight: float):
    """(estimate, seen) of conditional acceptance (any shape, e.g. `[Dmax]` or `[B, Dmax, R]`)
    after `reached` more observations of each entry, `hits` of them accepted, `seen` before.

    The estimate starts as worth `prior_weight` observations: until the observations outweigh
    it enough, it is their mean with the start (a Beta posterior's mean, keeping
    (prior_weight + seen) / (prior_weight + seen + reached) of the old value); from then on an
    EMA keeping `decay` per observation, whichever keeps less. A row's first observations
    thus move it as far as they weigh: from 0.5 with weight 2, two misses give 0.25 (the EMA
    alone 0.405, and 7 misses to fall below 0.25), so a job does not spend its first steps on
    a shape the prior over-rates. `seen` stops counting at the EMA's window 1 / (1 - decay),
    past which the EMA keeps less anyway. Unobserved entries relax to the prior."""
    keep = jnp.minimum(decay ** reached,
                       (prior_weight + seen) / jnp.maximum(prior_weight + seen + reached, 1e-9))
    observed = keep * conditional + (1.0 - keep) * hits / jnp.maximum(reached, 1.0)
    relaxed = conditional + relax * (prior - conditional)
    seen = jnp.minimum(seen + reached, 1.0 / (1.0 - decay))
    return jnp.where(reached > 0, observed, relaxed), seen
