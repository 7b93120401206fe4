"""The drafter interface: a static (hashable) description plus four pure functions.

A drafter is a frozen dataclass (a jit static argument) whose methods are pure functions of
(drafter params pytree, drafter state pytree, the decoding state). All run inside the one
jitted speculative program:

    state = drafter.init(params, batch_size, width)                 # before prefill
    state = drafter.prefill(params, state, decode, target_out)      # after the target's prefill
    draft, state = drafter.propose(params, state, decode, key, sampling)
    state = drafter.update(params, state, decode, result, target_out)  # after commit

Job-level state that outlives one batch (e.g. suffix statistics) is the drafter's *carry*:
`init_carry(params)` at the start of a job, `resume(state, carry)` right after `init`, and
`carry(state)` of the final batch state, which the next batch of the job resumes from.

A refilling loop (`specjax.refill`) starts new prompts in the slots of rows that ended:
`refill(params, state, decode_rows, target_out_rows, slots)` returns the batch state with rows
`slots` started afresh (default: init + resume + prefill of the new rows, written over the old
rows leaf by leaf; the job-level carry is kept across refills).

`decode` is the current `specjax.loop.DecodeState` (tokens buffer, num_tokens, done, ...;
the root of the next step is `decode.last_token`, at position `decode.num_tokens - 1`).
`target_out` is the target's ForwardOutput (layer_hidden holds `hidden_layers`).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from specjax.accept import accept
from specjax.gather import put_rows
from specjax.sampling import SamplingParams
from specjax.tree import TreeSpec
from specjax.types import AcceptResult, Draft

DrafterState = Any


@dataclasses.dataclass(frozen=True)
class Drafter:
    """Base class. Subclasses set `tree` and override what they need."""

    tree: TreeSpec
    #: target layers whose output hidden states prefill/update receive in target_out
    hidden_layers: tuple[int, ...] = ()
    #: the state's pytree (structure, shapes) is the same whatever `tree` is, so the same
    #: state serves every draft shape: what `num_draft="auto"` needs (`drafters.auto`)
    shape_free_state: ClassVar[bool] = False
    #: `num_draft="auto"`'s plain steps (`drafters.auto`) run a chain-of-1 proposal to observe
    #: whether the first draft token would have been accepted: worth it when a proposal is a
    #: lookup next to a target step (n-gram, suffix). A drafter that runs a model to propose sets
    #: it False: its plain steps only `sync`, so they cost what a plain decoding step does
    observe_plain_steps: ClassVar[bool] = True
    #: the state follows from the token buffer alone (its prefill reads no target output and it
    #: keeps no cache of its own: n-gram, suffix), so auto's cost profile may stand a context in
    #: by writing tokens instead of running the target over them (`auto_costs.started_state`)
    state_from_tokens: ClassVar[bool] = False

    @property
    def name(self) -> str:
        return type(self).__name__

    @property
    def deepest_draft(self) -> int | None:
        """The deepest tree the drafter can fill (None: any depth; a Medusa head: its head
        count, a DFlash / DSpark block: block_size - 1)."""
        return None

    def check_target(self, target_cfg) -> None:
        """Raises ValueError when the drafter cannot serve this target (e.g. another vocab)."""

    def init(self, params, batch_size: int, width: int) -> DrafterState:
        """Initial state for a batch whose token buffer has `width` entries per row."""
        return ()

    def init_carry(self, params) -> Any:
        """The job-level state at the start of a job (() = the drafter keeps none)."""
        return ()

    def resume(self, state: DrafterState, carry) -> DrafterState:
        """A fresh batch state (from `init`) with a carried job-level state put back."""
        return state

    def carry(self, state: DrafterState) -> Any:
        """The job-level part of a batch state, handed to the job's next batch."""
        return ()

    def loop_params(self, params):
        """The params the drafter's calls inside a decoding loop read, derived from its params
        once before the loop (every method also takes `params` as given). A slice of a
        loop-invariant input stays inside XLA's `while_loop` and is redone every step: layerskip
        cuts the target's stacked layers to its first K here. Default: params as they are."""
        return params

    def prefill(self, params, state: DrafterState, decode, target_out) -> DrafterState:
        return state

    def refill(self, params, state: DrafterState, decode, target_out, slots: jax.Array) -> DrafterState:
        """The batch state (B rows) with rows `slots` `[R]` started afresh on new prompts (a
        slot >= B: new row r unused). decode: the R new rows' DecodeState after the target's
        prefill, target_out: that prefill's output (`[R, P, ...]`).

        Default: `init` + `resume` (the job's carry so far) + `prefill` of the R rows, written
        over the batch's rows by `specjax.gather.put_rows` (every leaf with a batch axis; a
        `KVCache` by its rows); the carry comes from the new rows' prefill, so what the
        drafter learned from the new prompts stays. Override it when a state leaf has no
        batch axis and is not part of the carry.
        """
        rows, width = decode.tokens.shape
        fresh = self.resume(self.init(params, rows, width), self.carry(state))
        fresh = self.prefill(params, fresh, decode, target_out)
        return put_rows(self.resume(state, self.carry(fresh)), fresh, slots)

    def propose(
        self, params, state: DrafterState, decode, key: jax.Array, sampling: SamplingParams
    ) -> tuple[Draft, DrafterState]:
        raise NotImplementedError

    def update(
        self, params, state: DrafterState, decode, result: AcceptResult, target_out
    ) -> DrafterState:
        return state

    def draining(self, state: DrafterState, draining: jax.Array) -> DrafterState:
        """The state told, before a refilling loop's decoding step, whether the job is draining
        (`[]` bool: no queued prompt will take the slot of a row that ends, so the job ends
        with its slowest row; a static batch always is). Default: unchanged (only auto's pick
        reads it, `drafters.auto`)."""
        return state

    def sync(self, params, state: DrafterState, decode) -> DrafterState:
        """The state after a plain step the drafter proposed nothing for (auto's D = 0 branch
        when `observe_plain_steps` is False), before its `update`; decode: the state after the
        step (one token more per running row). Default: unchanged (a proposal that leaves the
        state alone, as the learned heads' do)."""
        return state

    def accept(
        self, params, key: jax.Array, target_logits: jax.Array, draft: Draft, sampling: SamplingParams
    ) -> AcceptResult:
        """The acceptance rule the loop applies to this drafter's drafts (`specjax.accept`).

        Only measurement drafters override it (`drafters.forced`: acceptance drawn from a
        profile, to measure the system rather than the drafter).
        """

        return accept(key, target_logits, draft, self.tree, sampling)


@functools.cache
def _candidate_levels(tree: TreeSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """nodes, parents (verify index), ranks `[Dmax, C]`: row d = the nodes of depth d + 1,
    padded to the widest level C with node N (dropped on scatter), parent 0 and rank 0."""
    width = max(len(level) for level in tree.levels)
    nodes = np.full((tree.max_depth, width), tree.num_nodes, np.int32)
    parents = np.zeros((tree.max_depth, width), np.int32)
    ranks = np.zeros((tree.max_depth, width), np.int32)
    for d, level in enumerate(tree.levels):
        nodes[d, : len(level)] = level
        parents[d, : len(level)] = [tree.parents[i] + 1 for i in level]
        ranks[d, : len(level)] = [tree.ranks[i] for i in level]
    return nodes, parents, ranks


def candidates_to_draft(cand_tokens: jax.Array, cand_valid: jax.Array, tree: TreeSpec) -> Draft:
    """Lays K candidate continuations out on a static tree (a trie, ranked by candidate order).

    cand_tokens, cand_valid: `[B, K, Dmax]`; candidate 0 is the most preferred. A node with
    rank r among its siblings takes the r-th distinct next token among the candidates that
    agree with the node's path so far (in candidate order). A chain takes candidate 0.
    The levels are one `lax.scan` (all nodes of a level at once), so the program holds one
    level's code whatever the tree.
    Returns a Draft without probabilities (deterministic drafter: q is one-hot).
    """
    batch, num_cand, _ = cand_tokens.shape
    nodes, parents, ranks = _candidate_levels(tree)
    earlier = jnp.tril(jnp.ones((num_cand, num_cand), bool), k=-1)  # [K, K] c' < c
    # consistent[:, v]: [B, K] candidates agreeing with verify node v's path (v = 0: the root);
    # the carries are made `like` the inputs, so they vary over a shard_map axis as they do
    like = lambda shape, dtype: jnp.zeros_like(cand_tokens, dtype, shape=shape)
    consistent = like((batch, tree.num_nodes + 1, num_cand), bool).at[:, 0].set(True)
    tokens = like((batch, tree.num_nodes), jnp.int32)
    valid = like((batch, tree.num_nodes), bool)

    def level(carry, t):
        consistent, tokens, valid = carry
        ok = consistent[:, t["parents"]] & cand_valid[:, None, :, t["depth"]]  # [B, C, K]
        tok = cand_tokens[:, :, t["depth"]]  # [B, K]
        same = tok[:, :, None] == tok[:, None, :]  # [B, K, K']
        seen_before = jnp.any(same[:, None] & earlier & ok[:, :, None, :], axis=-1)
        first = ok & ~seen_before
        distinct_rank = jnp.cumsum(first, axis=-1) - 1
        chosen = first & (distinct_rank == t["ranks"][None, :, None])  # at most one per node
        node_valid = jnp.any(chosen, axis=-1)  # [B, C]
        node_token = jnp.sum(jnp.where(chosen, tok[:, None, :], 0), axis=-1)
        agree = ok & (tok[:, None, :] == node_token[..., None]) & node_valid[..., None]
        return (consistent.at[:, t["nodes"] + 1].set(agree, mode="drop"),
                tokens.at[:, t["nodes"]].set(node_token.astype(jnp.int32), mode="drop"),
                valid.at[:, t["nodes"]].set(node_valid, mode="drop")), None

    xs = {"nodes": jnp.asarray(nodes), "parents": jnp.asarray(parents),
          "ranks": jnp.asarray(ranks), "depth": jnp.arange(tree.max_depth)}
    (_, tokens, valid), _ = jax.lax.scan(level, (consistent, tokens, valid), xs)
    return Draft(tokens=tokens, valid=valid)
