"""Batched decoding state and the plain autoregressive program (prefill + decode in ONE jit).

State invariants, per row b:
- `tokens[b, :num_tokens[b]]` = prompt then emitted tokens; the buffer is right-padded.
- while a row runs, `cache.lengths[b] == num_tokens[b] - 1`: the last emitted token (the
  *root* of the next step) is not in the KV cache yet.
- `done[b]` rows keep their outputs; later steps compute on them but change nothing.

`append_block` is shared with the speculative loop: it appends up to K tokens per row and ends
a row exactly at the first EOS, stop sequence or max_new_tokens inside the block, or at the
first token the target chose from non-finite logits (stop reason ERROR, that token dropped).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from specjax.accept import without_nonfinite_nodes
from specjax.commit import accepted_tokens, commit
from specjax.metrics import SpecMetrics
from specjax.models.cache import KVCache
from specjax.rng import as_row_keys, sample_rows, split_rows, step_keys
from specjax.sampling import SamplingParams
from specjax.target import TargetModel, as_target
from specjax.verify import verify
from specjax.xla_options import program

# stop_reason codes
RUNNING, EOS, STOP, LENGTH, ERROR = 0, 1, 2, 3, 4
STOP_REASONS = {RUNNING: "running", EOS: "eos", STOP: "stop", LENGTH: "length", ERROR: "error"}


def logits_finite(logits: jax.Array) -> jax.Array:
    """`[...]` bool: every logit of the row `[..., V]` is finite (False: NaN / Inf somewhere)."""
    return jnp.all(jnp.isfinite(logits), axis=-1)


@struct.dataclass
class StopCriteria:
    """Dynamic stopping rules shared by all rows.

    eos_ids: `[E]` int32, padded with -1.
    stop_seqs: `[NS, Ls]` int32 token sequences, right-aligned, left-padded with -1.
    stop_lens: `[NS]` int32 (0 = unused slot).
    """

    eos_ids: jax.Array
    stop_seqs: jax.Array
    stop_lens: jax.Array

    @classmethod
    def make(cls, eos_ids=(), stop_seqs=()):
        eos = list(eos_ids) or [-1]
        seqs = [list(s) for s in stop_seqs if len(s)] or [[-1]]
        width = max(len(s) for s in seqs)
        padded = [[-1] * (width - len(s)) + s for s in seqs]
        lens = [len(s) if s != [-1] else 0 for s in seqs]
        return cls(
            eos_ids=jnp.asarray(eos, jnp.int32),
            stop_seqs=jnp.asarray(padded, jnp.int32),
            stop_lens=jnp.asarray(lens, jnp.int32),
        )


@struct.dataclass
class DecodeState:
    tokens: jax.Array  # [B, W] int32
    num_tokens: jax.Array  # [B] int32
    prompt_lens: jax.Array  # [B] int32
    max_new: jax.Array  # [B] int32 (0 = padding row, done from the start)
    done: jax.Array  # [B] bool
    stop_reason: jax.Array  # [B] int32
    cache: KVCache
    row_keys: jax.Array  # [B, 2] uint32 each row's PRNG key (constant; see `next_keys`)
    step: jax.Array  # [] int32 decode steps taken

    @property
    def num_new(self) -> jax.Array:
        """`[B]` emitted tokens per row."""
        return self.num_tokens - self.prompt_lens

    def next_keys(self) -> jax.Array:
        """`[B, 2]` each row's key for its next draw: fold_in(row key, tokens it has emitted),
        so a row's randomness never depends on the other rows of its batch."""
        return step_keys(self.row_keys, self.num_new)

    @property
    def last_token(self) -> jax.Array:
        """`[B]` the last emitted token per row (the next step's root)."""
        return jnp.take_along_axis(self.tokens, (self.num_tokens - 1)[:, None], axis=1)[:, 0]


def _write_block(tokens: jax.Array, block: jax.Array, offsets: jax.Array) -> jax.Array:
    """Writes block `[B, K]` into tokens `[B, W]` at per-row offsets `[B]`."""
    return jax.vmap(lambda row, b, o: jax.lax.dynamic_update_slice(row, b, (o,)))(
        tokens, block.astype(tokens.dtype), offsets
    )


def _stop_hits(tokens: jax.Array, ends: jax.Array, starts: jax.Array, criteria: StopCriteria):
    """`[B, K]` bool: a stop sequence ends at position ends[b, k] (and starts >= starts[b])."""
    seq_len = criteria.stop_seqs.shape[1]
    offsets = jnp.arange(seq_len) - seq_len + 1  # [Ls], aligned so the window ends at `ends`
    idx = ends[:, :, None, None] + offsets[None, None, None, :]  # [B, K, 1, Ls]
    window = jnp.take_along_axis(
        tokens[:, None, None, :], jnp.clip(idx, 0, tokens.shape[1] - 1), axis=-1
    )  # [B, K, 1, Ls]
    in_seq = jnp.arange(seq_len)[None, :] >= (seq_len - criteria.stop_lens)[:, None]  # [NS, Ls]
    equal = (window == criteria.stop_seqs[None, None]) | ~in_seq[None, None]
    long_enough = (ends[:, :, None] - criteria.stop_lens[None, None, :] + 1) >= starts[:, None, None]
    return jnp.any(jnp.all(equal, axis=-1) & long_enough & (criteria.stop_lens > 0), axis=-1)


def append_block(
    state: DecodeState,
    block: jax.Array,
    counts: jax.Array,
    criteria: StopCriteria,
    finite: jax.Array | None = None,
) -> DecodeState:
    """Appends `block[b, :counts[b]]` (`[B, K]`, counts `[B]` >= 1) to each running row.

    A row ends exactly at the first EOS / stop sequence / max_new_tokens inside its block; the
    tokens after that point are not emitted. Done rows are left unchanged.
    finite: `[B, K]` bool, whether the target's logits that chose block token k were all
    finite (None: all were). A row reaching a token chosen from non-finite logits ends there
    with stop reason ERROR, that token NOT emitted (its choice was garbage, never an EOS).
    """
    active = ~state.done
    tokens = _write_block(state.tokens, block, state.num_tokens)
    k = jnp.arange(block.shape[1])[None, :]
    ends = state.num_tokens[:, None] + k  # [B, K] buffer position of each block token
    in_block = k < counts[:, None]
    is_eos = jnp.any(block[:, :, None] == criteria.eos_ids[None, None, :], axis=-1)
    is_stop = _stop_hits(tokens, ends, state.prompt_lens, criteria)
    is_length = ends - state.prompt_lens[:, None] + 1 >= state.max_new[:, None]
    is_error = jnp.zeros_like(in_block) if finite is None else ~finite
    ends_row = in_block & (is_eos | is_stop | is_length | is_error)
    first = jnp.argmax(ends_row, axis=1)  # [B]
    hit = jnp.any(ends_row, axis=1)
    pick = lambda x: jnp.take_along_axis(x, first[:, None], axis=1)[:, 0]
    emitted = jnp.where(hit, first + 1 - pick(is_error), counts)
    reason = jnp.where(pick(is_error), ERROR, jnp.where(
        pick(is_eos), EOS, jnp.where(pick(is_stop), STOP, LENGTH)))
    return state.replace(
        tokens=jnp.where(active[:, None], tokens, state.tokens),
        num_tokens=state.num_tokens + jnp.where(active, emitted, 0),
        done=state.done | (active & hit),
        stop_reason=jnp.where(active & hit, reason, state.stop_reason),
    )


def init_state(
    prompt_tokens: jax.Array,
    prompt_lens: jax.Array,
    max_new: jax.Array,
    cache: KVCache,
    key: jax.Array,
    width: int,
) -> DecodeState:
    """State before prefill; prompt_tokens `[B, P]` right-padded, buffer width W >= P.

    key: the rows' keys `[B, 2]` (`specjax.rng.job_row_keys`), or ONE key split across rows.
    """
    batch, prompt_width = prompt_tokens.shape
    tokens = jnp.zeros((batch, width), jnp.int32).at[:, :prompt_width].set(prompt_tokens)
    return DecodeState(
        tokens=tokens,
        num_tokens=prompt_lens.astype(jnp.int32),
        prompt_lens=prompt_lens.astype(jnp.int32),
        max_new=max_new.astype(jnp.int32),
        done=max_new <= 0,
        stop_reason=jnp.where(max_new <= 0, LENGTH, RUNNING).astype(jnp.int32),
        cache=cache,
        row_keys=as_row_keys(key, batch),
        step=jnp.int32(0),
    )


def prefill(
    target: TargetModel,
    params,
    state: DecodeState,
    prompt_width: int,
    sampling: SamplingParams,
    criteria: StopCriteria,
    hidden_layers: tuple[int, ...] = (),
):
    """Runs the prompts (`tokens[:, :prompt_width]`), samples the first token of each row.

    target: a `specjax.target.TargetModel` or a ModelConfig (the built-in Llama).
    Returns (state, forward output); the cache holds each row's prompt, lengths = prompt_lens.
    """
    batch = state.tokens.shape[0]
    prompt = state.tokens[:, :prompt_width]
    positions = jnp.broadcast_to(jnp.arange(prompt_width, dtype=jnp.int32), (batch, prompt_width))
    out = as_target(target).forward(
        params, prompt, positions, state.cache,
        hidden_layers=hidden_layers,
        logit_indices=(state.prompt_lens - 1)[:, None],
    )
    first = sample_rows(state.next_keys(), out.logits[:, 0], sampling)
    state = state.replace(cache=out.cache.replace(lengths=state.prompt_lens))
    ones = jnp.ones((batch,), jnp.int32)
    return append_block(state, first[:, None], ones, criteria, logits_finite(out.logits)), out


def ar_step(
    target: TargetModel, params, state: DecodeState, sampling: SamplingParams, criteria: StopCriteria
) -> DecodeState:
    """One plain decoding step: forward the root token, sample, append."""
    return ar_step_out(target, params, state, sampling, criteria)[0]


def ar_step_out(target: TargetModel, params, state: DecodeState, sampling: SamplingParams,
                criteria: StopCriteria, hidden_layers: tuple[int, ...] = ()):
    """`ar_step`, also returning what a drafter learns from it: (state, the sampled tokens
    `[B]`, the target's ForwardOutput over the root with `hidden_layers`)."""
    positions = state.cache.lengths[:, None]
    out = as_target(target).forward(params, state.last_token[:, None], positions, state.cache,
                                     hidden_layers=hidden_layers)
    next_token = sample_rows(state.next_keys(), out.logits[:, 0], sampling)
    cache = out.cache.advance(jnp.where(state.done, 0, 1))
    state = state.replace(cache=cache, step=state.step + 1)
    ones = jnp.ones_like(state.num_tokens)
    state = append_block(state, next_token[:, None], ones, criteria, logits_finite(out.logits))
    return state, next_token, out


@functools.partial(
    program, static_argnames=("target", "width"), donate_argnames=("cache",)
)
def generate_program(
    target: TargetModel,
    params,
    prompt_tokens: jax.Array,
    prompt_lens: jax.Array,
    max_new: jax.Array,
    cache: KVCache,
    key: jax.Array,
    sampling: SamplingParams,
    criteria: StopCriteria,
    *,
    width: int,
) -> DecodeState:
    """Prefill + decode until every row is done, as ONE XLA program.

    target: static, a `specjax.target.TargetModel` or a ModelConfig (the built-in Llama).
    prompt_tokens `[B, P]` right-padded (P is the prompt bucket), prompt_lens `[B]`, max_new
    `[B]` (0 marks a padding row), cache of capacity >= width (donated), key: the rows' PRNG
    keys `[B, 2]` (or one key split across rows; see `init_state`), width W = the token
    buffer size >= P + max(max_new). Returns the final DecodeState.
    """
    state = ar_start(target, params, prompt_tokens, prompt_lens, max_new, cache, key, sampling,
                     criteria, width=width)
    return ar_finish(target, params, state, sampling, criteria)


def ar_start(target: TargetModel, params, prompt_tokens: jax.Array, prompt_lens: jax.Array,
             max_new: jax.Array, cache: KVCache, key: jax.Array, sampling: SamplingParams,
             criteria: StopCriteria, *, width: int) -> DecodeState:
    """The first half of `generate_program`: the state after prefill (each row's first token)."""
    state = init_state(prompt_tokens, prompt_lens, max_new, cache, key, width)
    state, _ = prefill(target, params, state, prompt_tokens.shape[1], sampling, criteria)
    return state


def ar_finish(target: TargetModel, params, state: DecodeState, sampling: SamplingParams,
              criteria: StopCriteria) -> DecodeState:
    """The second half of `generate_program`: decodes until every row is done."""
    return jax.lax.while_loop(
        lambda s: jnp.any(~s.done),
        lambda s: ar_step(target, params, s, sampling, criteria),
        state,
    )


#: `generate_program` as two programs, so a caller can time prefill and decode apart (the
#: batch's time to first token, then the rest): `ar_finish_program(target, params,
#: ar_start_program(target, params, ...), sampling, criteria)` gives the same state
ar_start_program = program(ar_start, static_argnames=("target", "width"), donate_argnames=("cache",))
ar_finish_program = program(ar_finish, static_argnames=("target",), donate_argnames=("state",))


# ---------------------------------------------------------------------------------------------
# Speculative decoding
# ---------------------------------------------------------------------------------------------


def spec_step(
    target: TargetModel,
    params,
    drafter,
    drafter_params,
    state: DecodeState,
    drafter_state,
    metrics,
    sampling: SamplingParams,
    criteria: StopCriteria,
):
    """One speculative step: propose -> verify -> accept -> commit -> append -> drafter update.

    Returns (state, drafter_state, metrics). Shapes never change; per-row lengths advance by
    accepted + 1 (less where EOS / stop / max_new_tokens cuts the block). A drafter that picks
    its draft shape every step (`num_draft="auto"`, `drafters.auto.AutoDrafter`) runs its own
    `switched_step`: a chain of per-shape `while_loop`s over `fixed_spec_step`s of a few shapes
    and a plain step (one step or more per call: a branch keeps stepping while it stays the pick
    and no row ends).
    """
    switched_step = getattr(drafter, "switched_step", None)
    if switched_step is not None:
        return switched_step(target, params, drafter_params, state, drafter_state, metrics,
                             sampling, criteria)
    return fixed_spec_step(target, params, drafter, drafter_params, state, drafter_state, metrics,
                           sampling, criteria)


def fixed_spec_step(target: TargetModel, params, drafter, drafter_params, state: DecodeState,
                    drafter_state, metrics, sampling: SamplingParams, criteria: StopCriteria,
                    with_result: bool = False, live_depth: jax.Array | None = None):
    """`spec_step` on the drafter's own static tree (with_result: the step's AcceptResult too,
    as a fourth value). live_depth `[]` int32: only the draft nodes at most this deep count
    (the others are invalid, and the target's verify rows for them dead: `verify`)."""
    tree = drafter.tree
    batch = state.tokens.shape[0]
    propose_key, accept_key = split_rows(state.next_keys(), batch, 2)  # [B, 2] each
    draft, drafter_state = drafter.propose(drafter_params, drafter_state, state, propose_key, sampling)
    draft = without_nonfinite_nodes(draft)
    if live_depth is not None:
        draft = draft.replace(valid=draft.valid & (jnp.asarray(tree.node_depth) <= live_depth)[None, :])
    root = state.last_token
    target_out = verify(target, params, state.cache, root, draft, tree, drafter.hidden_layers,
                        live_depth)
    result = drafter.accept(drafter_params, accept_key, target_out.logits, draft, sampling)
    active = ~state.done
    cache = commit(target_out.cache, result, tree, active)
    block = accepted_tokens(jnp.concatenate([root[:, None], draft.tokens], axis=1), result)
    drafted = jnp.max(jnp.where(draft.valid, jnp.asarray(tree.node_depth)[None, :], 0), axis=1)
    metrics = metrics.record(active, drafted, result.num_accepted)
    state = state.replace(cache=cache, step=state.step + 1)
    path_finite = jnp.take_along_axis(logits_finite(target_out.logits), result.path, axis=1)
    state = append_block(state, block, result.num_accepted + 1, criteria, path_finite)
    drafter_state = drafter.update(drafter_params, drafter_state, state, result, target_out)
    if with_result:
        return state, drafter_state, metrics, result
    return state, drafter_state, metrics


@functools.partial(
    program, static_argnames=("target", "drafter", "width"),
    donate_argnames=("cache", "drafter_carry"),
)
def spec_generate_program(
    target: TargetModel,
    params,
    drafter,
    drafter_params,
    prompt_tokens: jax.Array,
    prompt_lens: jax.Array,
    max_new: jax.Array,
    cache: KVCache,
    key: jax.Array,
    sampling: SamplingParams,
    criteria: StopCriteria,
    drafter_carry=(),
    *,
    width: int,
):
    """Prefill + speculative decoding until every row is done, as ONE XLA program.

    Same inputs as `generate_program` plus a static drafter and its params; the cache and
    token buffer need `tree.num_nodes + 1` entries of margin beyond P + max_new.
    drafter_carry: the drafter's job-level state (`drafter.init_carry` for a job's first
    batch, else the previous batch's returned carry; donated).
    Returns (DecodeState, SpecMetrics, the drafter's carry for the next batch).
    """
    started = spec_start(target, params, drafter, drafter_params, prompt_tokens, prompt_lens,
                         max_new, cache, key, sampling, criteria, drafter_carry, width=width)
    state, metrics, drafter_state = spec_finish(target, params, drafter, drafter_params, started,
                                                sampling, criteria)
    return state, metrics, drafter.carry(drafter_state)


def spec_start(target: TargetModel, params, drafter, drafter_params, prompt_tokens: jax.Array,
               prompt_lens: jax.Array, max_new: jax.Array, cache: KVCache, key: jax.Array,
               sampling: SamplingParams, criteria: StopCriteria, drafter_carry=(), *, width: int):
    """The first half of `spec_generate_program`: (state, drafter state, metrics) after prefill
    (each row's first token, the drafter's prefill)."""
    batch = prompt_tokens.shape[0]
    state = init_state(prompt_tokens, prompt_lens, max_new, cache, key, width)
    drafter_state = drafter.resume(drafter.init(drafter_params, batch, width), drafter_carry)
    state, prefill_out = prefill(
        target, params, state, prompt_tokens.shape[1], sampling, criteria, drafter.hidden_layers
    )
    drafter_state = drafter.prefill(drafter_params, drafter_state, state, prefill_out)
    return state, drafter_state, SpecMetrics.for_drafter(batch, drafter)


def spec_finish(target: TargetModel, params, drafter, drafter_params, started,
                sampling: SamplingParams, criteria: StopCriteria):
    """The second half of `spec_generate_program`: speculative steps from `spec_start`'s
    (state, drafter state, metrics) until every row is done -> (state, metrics, drafter state);
    `drafter.carry(drafter state)` is what the job's next batch resumes from."""
    drafter_params = drafter.loop_params(drafter_params)

    def body(carry):
        s, ds, m = carry
        return spec_step(target, params, drafter, drafter_params, s, ds, m, sampling, criteria)

    state, drafter_state, metrics = jax.lax.while_loop(lambda c: jnp.any(~c[0].done), body, started)
    return state, metrics, drafter_state


#: `spec_generate_program` as two programs (see `ar_start_program`)
spec_start_program = program(spec_start, static_argnames=("target", "drafter", "width"),
                             donate_argnames=("cache", "drafter_carry"))
spec_finish_program = program(spec_finish, static_argnames=("target", "drafter"),
                              donate_argnames=("started",))
