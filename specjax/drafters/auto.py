"""`num_draft="auto"`: the draft shape picked every step, inside the program.

`AutoDrafter` wraps a drafter whose state does not depend on its draft tree
(`Drafter.shape_free_state`: n-gram, suffix, a draft model, layerskip and every learned head,
EAGLE-3, MTP, Medusa, DFlash, DSpark; not the measurement drafter `forced`). Its step (`switched_step`, which `loop.spec_step`
runs for it) is ONE `lax.switch` over a few chain lengths `lengths` (0 = a plain decoding
step), every branch the whole step of that shape on the same operands:

- D > 0: `loop.fixed_spec_step` of the inner drafter re-shaped to a chain of D (the state is
  the same pytree for every D, so each branch reads and writes it as it is);
- D = 0: `loop.ar_step_out`, plus the inner drafter's chain-of-1 proposal, to observe
  whether its first token would have been accepted (no verify cost), and its `update` with
  the root's row as the accepted path. The proposal also keeps stateful drafters in step: a
  draft model re-feeds the last two committed tokens there, so its cache stays valid below
  `num_tokens - 2` as after any spec step; the learned heads ingest the root's features.

The candidate chain lengths are those the drafter can produce: `auto_lengths` up to
`auto_max_draft(drafter)` (a Medusa head: its head count, DFlash / DSpark: block_size - 1).

Each step picks the branch with the highest predicted tokens/s (`specjax.costmodel`, the
tuner's model): E[tokens per step](D) from the running estimate of this job's conditional
acceptance per depth, times the active rows, over the branch's measured step cost
(`AutoParams.step_s`, from `specjax.auto_costs`). Greedy and sampled outputs stay exact: each
branch is a lossless step, and the pick depends only on earlier steps.

The estimate (`AutoState.conditional` `[Dmax]`) is an exponential moving average, one update
per observation: a row whose first j draft tokens were accepted observes depth j (accepted or
not; an empty draft position counts as not). Depths no step observes drift back to the prior,
so a shape ruled out early is tried again later.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from specjax.costmodel import chain_tokens_per_steps, throughput
from specjax.drafters.base import Drafter
from specjax.loop import DecodeState, ar_step_out, fixed_spec_step
from specjax.rng import split_rows
from specjax.tree import chain
from specjax.types import AcceptResult

#: candidate chain lengths of auto (plus the tile-aligned ones in range, `auto_lengths`)
BASE_LENGTHS = (0, 1, 2, 4, 8)
TILE_ROWS = 128


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
    """inner: the inner drafter's params; step_s `[S]` f32: each branch's step seconds at this
    batch size (dynamic: new costs never recompile)."""

    inner: Any
    step_s: jax.Array


@struct.dataclass
class AutoState:
    """inner: the inner drafter's state; conditional `[Dmax]` f32: the running estimate of
    P(draft token j + 1 accepted | the first j were)."""

    inner: Any
    conditional: jax.Array


@dataclasses.dataclass(frozen=True)
class AutoDrafter(Drafter):
    """An inner drafter (any tree) driven at the chain length each step predicts fastest.
    `tree`: the chain of max(lengths) (what margins and metrics size by)."""

    inner: Drafter | None = None
    lengths: tuple[int, ...] = BASE_LENGTHS
    prior: float = 0.5  # the estimate before any observation, and where unobserved depths drift
    decay: float = 0.9  # EMA weight kept per observation
    relax: float = 0.01  # per step, unobserved depths move this much of the way to the prior
    rotate: bool = False  # test hook: branch = step % S (visits every branch) instead of the pick

    def __post_init__(self):
        if self.inner is None or not self.inner.shape_free_state:
            raise ValueError("auto needs a drafter whose state does not depend on its tree "
                             f"(Drafter.shape_free_state), got {self.inner and self.inner.name}")
        if 0 not in self.lengths or sorted(set(self.lengths)) != list(self.lengths):
            raise ValueError(f"auto lengths must be sorted, distinct and include 0, got {self.lengths}")
        if self.tree.max_depth != max(self.lengths) or self.tree.num_nodes != max(self.lengths):
            raise ValueError(f"auto's tree must be a chain of {max(self.lengths)}, got {self.tree.name}")

    @classmethod
    def wrap(cls, inner: Drafter, lengths: tuple[int, ...] = BASE_LENGTHS, **options) -> AutoDrafter:
        """`inner` (any tree) driven by auto over `lengths`."""
        top = chain(max(lengths))
        inner = dataclasses.replace(inner, tree=top)
        return cls(tree=top, hidden_layers=inner.hidden_layers, inner=inner, lengths=lengths, **options)

    @property
    def name(self) -> str:
        return self.inner.name

    def shaped(self, num_draft: int) -> Drafter:
        """The inner drafter on a chain of num_draft >= 1."""
        return dataclasses.replace(self.inner, tree=chain(num_draft))

    # ---- the drafter interface, delegated to the inner drafter ----

    def check_target(self, target_cfg) -> None:
        self.inner.check_target(target_cfg)

    def init(self, params: AutoParams, batch_size: int, width: int) -> AutoState:
        return AutoState(self.inner.init(params.inner, batch_size, width),
                         jnp.full((self.tree.max_depth,), self.prior, jnp.float32))

    def init_carry(self, params: AutoParams):
        return self.inner.init_carry(params.inner)

    def resume(self, state: AutoState, carry) -> AutoState:
        return state.replace(inner=self.inner.resume(state.inner, carry))

    def carry(self, state: AutoState):
        return self.inner.carry(state.inner)

    def prefill(self, params: AutoParams, state: AutoState, decode, target_out) -> AutoState:
        return state.replace(inner=self.inner.prefill(params.inner, state.inner, decode, target_out))

    def refill(self, params: AutoParams, state: AutoState, decode, target_out, slots) -> AutoState:
        """The inner drafter's refill; the job's acceptance estimate is kept."""
        return state.replace(inner=self.inner.refill(params.inner, state.inner, decode, target_out, slots))

    def propose(self, params, state, decode, key, sampling):
        raise TypeError("auto picks its shape per step: run it through loop.spec_step")

    # ---- the step ----

    def predicted(self, params: AutoParams, state: AutoState, active: jax.Array):
        """(`[S]` predicted tokens/s of each branch, `[S]` its E[tokens per step]) for the
        active rows `[B]`: the cost model of `specjax.costmodel`."""
        per_step = chain_tokens_per_steps(state.conditional, self.lengths)
        rows = jnp.sum(active.astype(jnp.float32))
        return throughput(per_step, rows, params.step_s), per_step

    def switched_step(self, target, params, drafter_params: AutoParams, state: DecodeState,
                      drafter_state: AutoState, metrics, sampling, criteria, branch=None):
        """`loop.spec_step` for auto: the picked branch (or `branch` `[]`, for profiling) ->
        (state, drafter state, metrics), the estimate and the shape metrics updated."""
        active = ~state.done
        tokens_per_s, per_step = self.predicted(drafter_params, drafter_state, active)
        if branch is not None:
            index = branch
        elif self.rotate:
            index = state.step % len(self.lengths)
        else:
            index = jnp.argmax(tokens_per_s).astype(jnp.int32)
        branches = [functools.partial(self._branch, d, target, params, drafter_params.inner,
                                      sampling, criteria) for d in self.lengths]
        state, inner, metrics, reached, hits = jax.lax.switch(
            index, branches, state, drafter_state.inner, metrics)
        metrics = metrics.record_shape(active, jnp.asarray(self.lengths)[index], per_step[index],
                                       drafter_params.step_s[index])
        conditional = updated_estimate(drafter_state.conditional, reached, hits, self.prior,
                                       self.decay, self.relax)
        return state, AutoState(inner, conditional), metrics

    def _branch(self, num_draft: int, target, params, inner_params, sampling, criteria,
                state: DecodeState, inner_state, metrics):
        """One step of a chain of num_draft (0: plain) -> (state, inner state, metrics,
        reached `[Dmax]`, hits `[Dmax]`: rows that observed depth j, and accepted it)."""
        active = ~state.done
        if num_draft == 0:
            return self._plain_branch(target, params, inner_params, sampling, criteria, state,
                                      inner_state, metrics)
        before = metrics.accepted
        state, inner_state, metrics = fixed_spec_step(
            target, params, self.shaped(num_draft), inner_params, state, inner_state, metrics,
            sampling, criteria)
        reached, hits = observations(active, metrics.accepted - before, num_draft, self.tree.max_depth)
        return state, inner_state, metrics, reached, hits

    def _plain_branch(self, target, params, inner_params, sampling, criteria, state: DecodeState,
                      inner_state, metrics):
        """A plain step; the chain-of-1 draft only observes depth 0 (and the drafter updates)."""
        active = ~state.done
        drafter = self.shaped(1)
        propose_key = split_rows(state.next_keys(), state.tokens.shape[0], 2)[0]
        draft, inner_state = drafter.propose(inner_params, inner_state, state, propose_key, sampling)
        state, token, out = ar_step_out(target, params, state, sampling, criteria, drafter.hidden_layers)
        zeros = jnp.zeros_like(token)
        result = AcceptResult(path=jnp.zeros((token.shape[0], 2), jnp.int32), num_accepted=zeros,
                              next_token=token)
        inner_state = drafter.update(inner_params, inner_state, state, result, out)
        metrics = metrics.record(active, zeros, zeros)
        hit = draft.valid[:, 0] & (draft.tokens[:, 0] == token)
        reached, hits = observations(active, hit.astype(jnp.int32), 1, self.tree.max_depth)
        return state, inner_state, metrics, reached, hits


def observations(active: jax.Array, accepted: jax.Array, num_draft: int, max_depth: int):
    """(reached `[Dmax]`, hits `[Dmax]`) f32 of one step of a chain of num_draft: rows `[B]`
    active whose first j draft tokens were accepted (j < num_draft), and of them those that
    accepted token j + 1 too (accepted `[B]`)."""
    depth = jnp.arange(max_depth)[None, :]
    seen = active[:, None] & (depth < num_draft) & (accepted[:, None] >= depth)
    hit = seen & (accepted[:, None] > depth)
    return jnp.sum(seen, axis=0).astype(jnp.float32), jnp.sum(hit, axis=0).astype(jnp.float32)


def updated_estimate(conditional: jax.Array, reached: jax.Array, hits: jax.Array, prior: float,
                     decay: float, relax: float) -> jax.Array:
    """`[Dmax]` the EMA of conditional acceptance after `reached` observations per depth, `hits`
    of them accepted (one EMA update per observation); unobserved depths relax to the prior."""
    keep = decay ** reached
    observed = keep * conditional + (1.0 - keep) * hits / jnp.maximum(reached, 1.0)
    relaxed = conditional + relax * (prior - conditional)
    return jnp.where(reached > 0, observed, relaxed)
