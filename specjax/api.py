"""User-facing generation: validation, bucketing, batching, host-side text handling.

    out = specjax.generate(model, ["Name three primes."], draft="ngram", num_draft=4)

`generate` takes a loaded model (or a name / path to load), prompts as text, chat message lists
or token ids, and returns text; `generate_ids` works on token ids with any target model
(`specjax.target.TargetModel`, or a ModelConfig for the built-in Llama) and its params. By
default both run the prompts in chunks, each ONE program whose batch rows are slots refilled
with the next prompt as rows end (`run_chunks`, `specjax.refill`); with refill=False they run
each static batch as two jitted programs, prefill then decode (`loop.ar_start_program` /
`ar_finish_program`, or the spec pair: `loop.generate_program` split in two, so the results'
`times` hold compile, prefill and decode seconds apart), whose shapes are bucketed (2^k or
3·2^(k-2) lengths; batches of the prompts' power-of-two bucket, at most batch_size), so calls
with other prompt lengths or max_new_tokens inside the same buckets do not compile again. Every
argument is checked before a model loads or anything compiles (`specjax.options`).
"""
from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.auto_costs import auto_drafter
from specjax.compile_cache import use_compile_cache
from specjax.drafters.registry import make_drafter
from specjax.loop import (
    STOP_REASONS,
    StopCriteria,
    ar_finish_program,
    ar_start_program,
    spec_finish_program,
    spec_start_program,
)
from specjax.metrics import row_summaries
from specjax.models.config import ModelConfig, resolve_dtype
from specjax.models.hub import load_model
from specjax.options import (
    DraftChoice,
    GenerationConfig,
    as_rows,
    check_int,
    describe,
    draft_choice,
    is_integer,
    job_key,
    per_prompt_limits,
)
from specjax.refill import ChunkOutputs, PromptQueue, RefillPolicy, refill_program, slots_program
from specjax.rng import job_row_keys, prompt_key_id
from specjax.sampling import SamplingParams
from specjax.schedule import load_schedule, scheduled
from specjax.sharding import (
    as_mesh,
    empty_cache_on,
    fetch,
    loader_shardings,
    padded_rows,
    put,
    replicated,
    rows_sharding,
    shard_params,
)
from specjax.target import TargetModel, as_target
from specjax.timing import BatchTimes, SlotStats, build_and_run
from specjax.tree import TreeSpec

MIN_BUCKET = 16
#: a refilling job's chunk: prompts one program call serves, in batches of its slots
CHUNK_BATCHES = 8
#: how refilling jobs refill their slots (see `specjax.refill.RefillPolicy`)
REFILL_POLICY = RefillPolicy(rows=1, min_free=1)


class PromptError(ValueError):
    """A prompt that cannot be generated from (empty, too long, ids outside the vocabulary)."""


# ---------------------------------------------------------------------------------------------
# Prompt checks: all run before any model load or compile, and name the row or argument
# ---------------------------------------------------------------------------------------------


def check_refill(value, name: str = "refill") -> None:
    """value is True or False (TypeError naming the option otherwise)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {describe(value)}")


def check_sizes(batch_size: int | None, max_len: int | None) -> None:
    """batch_size and max_len are None (the default) or integers >= 1."""
    if batch_size is not None:
        check_int(batch_size, "batch_size", 1)
    if max_len is not None:
        check_int(max_len, "max_len", 1)


def row_labels(labels, count: int) -> list[str]:
    """The names of `count` rows in errors: `labels` (one per row) or "prompt i"."""
    if labels is None:
        return [f"prompt {i}" for i in range(count)]
    labels = as_rows(labels, "labels", "a sequence of str (one per prompt)")
    if len(labels) != count:
        raise ValueError(f"labels has {len(labels)} entries for {count} prompts")
    return [str(label) for label in labels]


def row_key_ids(prompt_ids, count: int) -> list[int]:
    """Each row's PRNG key id (`specjax.rng.prompt_key_id`): from `prompt_ids` (a stable int or
    str per prompt), else the row's index in the job."""
    if prompt_ids is None:
        return list(range(count))
    ids = as_rows(prompt_ids, "prompt_ids", "a sequence of ints or strs (one per prompt)")
    if len(ids) != count:
        raise ValueError(f"prompt_ids has {len(ids)} entries for {count} prompts")
    key_ids = []
    for i, prompt_id in enumerate(ids):
        try:
            key_ids.append(prompt_key_id(prompt_id))
        except TypeError:
            raise TypeError(f"prompt_ids[{i}] must be an int or a str, got {describe(prompt_id)}") from None
    return key_ids


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One checked text-level prompt: exactly one of `text`, `messages` (a chat) or `ids`.

    given: the prompt as the caller gave it (`Generation.prompt`).
    """

    given: Any
    text: str | None = None
    messages: tuple[dict, ...] | None = None
    ids: tuple[int, ...] | None = None

    def encode(self, tokenizer, chat: bool) -> list[int]:
        """Token ids: ids as they are, a chat through the tokenizer's chat template, text
        through the template too when `chat` (else as plain text)."""
        if self.ids is not None:
            return list(self.ids)
        if self.messages is not None:
            return tokenizer.encode_chat(list(self.messages))
        return tokenizer.encode_chat(self.text) if chat else tokenizer.encode(self.text)


def is_chat(value) -> bool:
    """A list / tuple whose first entry is a mapping: a chat (a list of messages)."""
    return isinstance(value, (list, tuple)) and bool(value) and isinstance(value[0], Mapping)


def chat_messages(messages, name: str) -> tuple[dict, ...]:
    """A chat's messages as dicts, each with a str "role" and a str "content" (TypeError naming
    the prompt and message otherwise)."""
    for j, message in enumerate(messages):
        if not (isinstance(message, Mapping) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise TypeError(f"{name}: message {j} must be a mapping with a str 'role' and a str "
                            f"'content', got {describe(message)}")
    return tuple(dict(m) for m in messages)


def text_level_prompt(row, name: str) -> Prompt:
    """One prompt of `generate`: a str, a chat (a list of {"role", "content"} messages) or a
    sequence of token ids. TypeError / PromptError naming the row."""
    if isinstance(row, str):
        if not row.strip():
            raise PromptError(f"{name} is empty: nothing to condition on")
        return Prompt(given=row, text=row)
    if is_chat(row):
        return Prompt(given=row, messages=chat_messages(row, name))
    if is_integer(row):
        raise TypeError(f"{name} must be a str, a chat (list of messages) or a sequence of token "
                        f"ids, got {describe(row)} (one token-id prompt is a list: [[1, 2, ...]])")
    if isinstance(row, (bytes, bytearray, Mapping)) or not isinstance(row, Iterable):
        raise TypeError(f"{name} must be a str, a chat (list of messages) or a sequence of token "
                        f"ids, got {describe(row)}")
    ids = as_token_ids(row, name)
    if not ids:
        raise PromptError(f"{name} is empty: nothing to condition on")
    return Prompt(given=row, ids=tuple(ids))


def text_level_prompts(prompts, labels) -> tuple[list[Prompt], list[str]]:
    """(the checked prompts, their labels); a single str or a single chat is one prompt.
    TypeError / PromptError name the first bad row."""
    if isinstance(prompts, str) or is_chat(prompts):
        rows = [prompts]
    else:
        rows = as_rows(prompts, "prompts", "a str, a chat or a sequence of prompts")
    labels = row_labels(labels, len(rows))
    return [text_level_prompt(row, name) for row, name in zip(rows, labels)], labels


def as_token_ids(row, name: str) -> list[int]:
    """One id prompt as a list of ints: a sequence of int / numpy integer ids or a 1-D integer
    array. Floats are refused, never truncated (TypeError naming the row and position)."""
    if hasattr(row, "dtype") and hasattr(row, "ndim"):  # numpy / jax arrays
        array = np.asarray(row)
        if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
            raise TypeError(f"{name} must be a 1-D array of integer token ids, got a "
                            f"{array.ndim}-D array of {array.dtype}")
        return array.tolist()
    if isinstance(row, (str, bytes, bytearray, Mapping)) or not isinstance(row, Iterable):
        raise TypeError(f"{name} must be a sequence of integer token ids, got {describe(row)}")
    ids = list(row)
    for position, t in enumerate(ids):
        if not is_integer(t):
            raise TypeError(f"{name} has a non-integer token id at position {position}: "
                            f"{describe(t)} (token ids must be integers)")
    return [int(t) for t in ids]


def id_prompts(prompts, labels) -> tuple[list[list[int]], list[str]]:
    """(prompts as lists of int token ids, their labels); TypeError names the first bad row."""
    rows = as_rows(prompts, "prompts", "a sequence of token-id sequences")
    labels = row_labels(labels, len(rows))
    return [as_token_ids(row, name) for row, name in zip(rows, labels)], labels


@dataclasses.dataclass(frozen=True)
class TokenResult:
    """One row's output at the token level."""

    token_ids: list[int]  # emitted tokens (EOS included when it ended the row)
    # "eos" | "stop" | "length" | "error"; "error": the target's logits for the next token were
    # NaN / Inf (a damaged checkpoint or an overflow), token_ids hold the tokens chosen before
    stop_reason: str
    time_s: float  # wall time of the batch this row ran in: prefill + decode, never compilation
    spec: dict | None = None  # speculative metrics of the row, when speculating
    times: BatchTimes | None = None  # the batch's compile, prefill and decode seconds


@dataclasses.dataclass(frozen=True)
class Generation:
    """One prompt's output at the text level."""

    prompt: str | list[dict] | list[int]  # as given: a str, a chat or token ids
    completion: str
    token_ids: list[int]
    num_new_tokens: int
    stop_reason: str  # "eos" | "stop" | "length" | "error" (see TokenResult.stop_reason)
    time_s: float  # prefill + decode of the row's batch (see TokenResult)
    spec: dict | None = None
    times: BatchTimes | None = None  # `specjax.timing.job_stats(generations)` sums a job's


def bucket(n: int, minimum: int = MIN_BUCKET) -> int:
    """Length bucket: the smallest 2^k or 3·2^(k-2) >= max(n, minimum).

    Half-way buckets keep the padding under a third of the bucket instead of up to half of
    it: prefill is compute-bound, so padded prompt tokens cost as much as real ones (a batch of
    8 chat prompts of 52-87 tokens pads to 96 instead of 128).
    """
    n = max(int(n), minimum, 1)
    power = 1 << (n - 1).bit_length()
    three_quarters = power // 4 * 3
    return three_quarters if power >= 4 and three_quarters >= n else power


def batch_bucket(n: int) -> int:
    """Smallest power of two >= n (the batch sizes programs are compiled for)."""
    return 1 << max(0, int(n) - 1).bit_length()


def batch_rows(batch_size: int | None, num_prompts: int) -> int:
    """Rows of the program that runs `num_prompts` prompts: their batch bucket, at most
    `batch_size` (None: no limit). One prompt runs as a batch of 1, three as a batch of 4, so
    padding rows are fewer than the prompts and only where the prompts do not fill a bucket."""
    rows = batch_bucket(num_prompts)
    return rows if batch_size is None else min(batch_size, rows)


def draft_margin(tree: TreeSpec | None) -> int:
    """Cache entries a row needs beyond prompt + max_new_tokens: what one speculative step
    writes past the committed length (the root and every draft node); 0 without a tree."""
    return 0 if tree is None else tree.num_nodes + 1


@dataclasses.dataclass(frozen=True)
class BatchShape:
    """The static shapes of a batch's programs (with the draft tree): a process compiles each
    distinct shape once, as two programs (prefill and decode)."""

    rows: int  # the batch dimension: the prompts and the padding rows
    prompt_width: int  # the bucket of the batch's longest prompt
    width: int  # token buffer and cache entries per row: prompt_width + bucket(max_new) + margin


def batch_shape(prompt_lengths: Sequence[int], rows: int, max_new_tokens: int,
                tree: TreeSpec | None) -> BatchShape:
    """The shape of the batch of prompts of these lengths, run as `rows` rows."""
    prompt_width = bucket(max(prompt_lengths))
    return BatchShape(rows, prompt_width, prompt_width + bucket(max_new_tokens) + draft_margin(tree))


def job_shapes(prompt_lengths: Sequence[int], batch_size: int | None, max_new_tokens: int,
               tree: TreeSpec | None = None) -> list[BatchShape]:
    """Each batch's shape of a job, decided on the host from the prompts' lengths alone: the
    job compiles `len(set(job_shapes(...)))` shapes (two programs each), each once."""
    job_rows = batch_rows(batch_size, len(prompt_lengths))
    return [batch_shape(chunk, batch_rows(job_rows, len(chunk)), max_new_tokens, tree)
            for _, chunk in batches(prompt_lengths, job_rows)]


def batch_tree(choice: DraftChoice, schedule, batch_size: int) -> TreeSpec | None:
    """The draft tree batches of `batch_size` run with: the schedule's pick for that batch size
    (None = plain decoding), else the chosen drafter's (None without one). Loads no model."""
    if schedule is not None:
        return load_schedule(schedule).pick(batch_size).tree_spec
    return choice.tree


def row_limits(max_new_tokens: int | Sequence[int], count: int) -> list[int]:
    """Each of `count` prompts' max_new_tokens: one int for all, or one per prompt."""
    if is_integer(max_new_tokens):
        return [int(max_new_tokens)] * count
    return [int(m) for m in max_new_tokens]


def prompt_problem(ids: Sequence[int], vocab_size: int, max_new_tokens: int, max_len: int,
                   margin: int = 0) -> str | None:
    """What is wrong with one token-id prompt, as the end of a sentence naming it ("is empty:
    ...", "has token ids outside ...", "has N tokens; ... more than max_len=M"), or None."""
    if len(ids) == 0:
        return "is empty: nothing to condition on"
    bad = [t for t in ids if not 0 <= int(t) < vocab_size]
    if bad:
        return f"has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}"
    need = len(ids) + max_new_tokens + margin
    if need > max_len:
        drafts = f" + {margin} for drafting" if margin else ""
        return (f"has {len(ids)} tokens; with max_new_tokens={max_new_tokens}{drafts} it needs "
                f"{need} cache entries, more than max_len={max_len}")
    return None


def validate_prompts(
    prompts: Sequence[Sequence[int]], vocab_size: int, max_new_tokens: int | Sequence[int],
    max_len: int, labels: Sequence[str] | None = None, margin: int = 0,
) -> None:
    """Raises PromptError naming the first bad row (`prompt_problem`: empty, ids outside the
    vocabulary, or prompt + its max_new_tokens (one for all, or one per prompt) + margin
    (`draft_margin`) more than max_len)."""
    for i, (ids, limit) in enumerate(zip(prompts, row_limits(max_new_tokens, len(prompts)))):
        problem = prompt_problem(ids, vocab_size, limit, max_len, margin)
        if problem is not None:
            raise PromptError(f"{labels[i] if labels else f'prompt {i}'} {problem}")


def text_prompt_problems(model, prompts, *, max_new_tokens: int | Sequence[int], chat: bool = True,
                         margin: int = 0, max_len: int | None = None) -> list[str | None]:
    """Each text-level prompt's problem for this loaded model once tokenized (`prompt_problem`),
    or None: what `generate` would refuse, for a caller that skips bad rows instead."""
    rows, _ = text_level_prompts(prompts, None)
    limit = max_len or model.cfg.max_position_embeddings
    return [prompt_problem(row.encode(model.tokenizer, chat), model.cfg.vocab_size, max_new, limit,
                           margin)
            for row, max_new in zip(rows, row_limits(max_new_tokens, len(rows)))]


def batches(items: Sequence, size: int) -> Iterator[tuple[int, Sequence]]:
    """(start index, slice) pairs of at most `size` items."""
    for start in range(0, len(items), size):
        yield start, items[start : start + size]


def _pad_batch(prompts: Sequence[Sequence[int]], batch_size: int, prompt_width: int):
    """Right-padded `[batch_size, prompt_width]` tokens and `[batch_size]` lengths (0 = pad row)."""
    tokens = np.zeros((batch_size, prompt_width), np.int32)
    lengths = np.ones((batch_size,), np.int32)
    for i, ids in enumerate(prompts):
        tokens[i, : len(ids)] = ids
        lengths[i] = len(ids)
    return tokens, lengths


def _pad_keys(row_keys: np.ndarray, batch_size: int) -> np.ndarray:
    """`[batch_size, 2]` uint32: the batch's row keys `[n, 2]`, then zero keys for padding rows."""
    padded = np.zeros((batch_size,) + row_keys.shape[1:], row_keys.dtype)
    padded[: len(row_keys)] = row_keys
    return padded


def batch_inputs(target: TargetModel | ModelConfig, prompts: Sequence[Sequence[int]],
                 shape: BatchShape, max_new_tokens: int | Sequence[int], row_keys: np.ndarray,
                 mesh=None):
    """(prompt tokens `[B, P]`, prompt lengths `[B]`, max_new `[B]`, empty cache, row keys
    `[B, 2]`) of a batch of `shape` (B = shape.rows; rows past the prompts are padding), on the
    default device, or split by rows over the mesh's dp (the cache also by KV heads over tp,
    created in its shards)."""
    rows = shape.rows
    tokens, lengths = _pad_batch(prompts, rows, shape.prompt_width)
    max_new = np.zeros((rows,), np.int32)
    max_new[: len(prompts)] = row_limits(max_new_tokens, len(prompts))
    row_arrays = (tokens, lengths, max_new, _pad_keys(row_keys, rows))
    if mesh is None:
        row_arrays = tuple(jnp.asarray(a) for a in row_arrays)
    else:
        row_arrays = tuple(put(a, rows_sharding(mesh)) for a in row_arrays)
    cache = empty_cache_on(mesh, as_target(target), rows, shape.width)
    return (*row_arrays[:3], cache, row_arrays[3])


def run_batch(
    target: TargetModel | ModelConfig,
    params,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int | Sequence[int],
    sampling: SamplingParams,
    criteria: StopCriteria,
    row_keys: np.ndarray,
    batch_size: int,
    drafter=None,
    drafter_params=None,
    drafter_carry=(),
    batch: int = 0,
    mesh=None,
) -> tuple[list[TokenResult], object]:
    """Runs one batch (len(prompts) <= batch_size; the rest are padding rows) to completion.

    target: a `specjax.target.TargetModel` or a ModelConfig (the built-in Llama).
    Plain decoding when drafter is None, else speculative decoding with that drafter.
    row_keys: `[len(prompts), 2]` uint32, each prompt's PRNG key (`specjax.rng.job_row_keys`).
    batch: the batch's index in its job (in its rows' `times`).
    Returns (results, the drafter's carry for the job's next batch); drafter_carry is this
    batch's (`drafter.init_carry(drafter_params)` for the first; donated). The batch runs as
    two programs, prefill then decode (`loop.ar_start_program` / `ar_finish_program` or the
    spec pair), each built before it runs, so its rows' `times` hold the three apart.
    mesh: None (one device) or a `jax.sharding.Mesh` with axes ("dp", "tp") that params and
    drafter_params are already placed on (`specjax.sharding.shard_params`): the batch's rows
    (rounded up to a multiple of dp with padding rows) are split over dp; the programs are the
    same, GSPMD partitions them.
    """
    if drafter is not None:
        drafter.check_target(target)
    shape = batch_shape([len(p) for p in prompts], padded_rows(batch_size, mesh),
                        max(row_limits(max_new_tokens, len(prompts))),
                        None if drafter is None else drafter.tree)
    width = shape.width
    inputs = batch_inputs(target, prompts, shape, max_new_tokens, row_keys, mesh)
    args = (*inputs, sampling, criteria)
    lengths = np.array([len(p) for p in prompts])
    if drafter is None:
        head, carry, start, finish = (target, params), (), ar_start_program, ar_finish_program
    else:
        head, carry = (target, params, drafter, drafter_params), (drafter_carry,)
        start, finish = spec_start_program, spec_finish_program
    started, start_compile_s, prefill_s = build_and_run(start, *head, *args, *carry, width=width)
    finished, finish_compile_s, decode_s = build_and_run(finish, *head, started, sampling, criteria)
    if drafter is None:
        state, metrics = finished, None
    else:  # the job-level part of the drafter's state (a selection: no computation)
        state, metrics, drafter_state = finished
        drafter_carry = drafter.carry(drafter_state)
    out_tokens, num_tokens, reasons, steps, metrics = fetch(
        (state.tokens, state.num_tokens, state.stop_reason, state.step, metrics)
    )
    real = slice(0, len(prompts))
    busy = (metrics.steps[real] if metrics is not None  # a row runs from its first step to its last
            else np.maximum(num_tokens[real] - lengths - 1, 0))  # AR: one token per step after prefill
    slot_stats = SlotStats(shape.rows, int(steps), int(np.sum(busy)), 0, len(prompts))
    times = BatchTimes(batch, start_compile_s + finish_compile_s, prefill_s, decode_s, slot_stats)
    spec = row_summaries(metrics, len(prompts)) if metrics is not None else None
    results = [
        TokenResult(
            token_ids=out_tokens[i, lengths[i] : num_tokens[i]].tolist(),
            stop_reason=STOP_REASONS[int(reasons[i])],
            time_s=times.run_s,
            spec=spec[i] if spec else None,
            times=times,
        )
        for i in range(len(prompts))
    ]
    return results, drafter_carry


def chunk_capacity(batch_size: int, num_prompts: int) -> int:
    """Queue entries of a refilling job's chunks (static, one program for every chunk): the
    bucket of the job's prompts, at most CHUNK_BATCHES batches of `batch_size` slots."""
    return min(CHUNK_BATCHES * batch_size, batch_bucket(num_prompts))


def chunk_results(outputs: ChunkOutputs, prompts: Sequence[Sequence[int]],
                  times: BatchTimes) -> dict[int, TokenResult]:
    """{job index: TokenResult} of the rows a refilling call ended (outputs on the host)."""
    count = int(outputs.count)
    spec = row_summaries(outputs.metrics, count) if outputs.metrics is not None else None
    results = {}
    for i in range(count):
        index = int(outputs.prompt[i])
        results[index] = TokenResult(
            token_ids=outputs.tokens[i, len(prompts[index]): outputs.num_tokens[i]].tolist(),
            stop_reason=STOP_REASONS[int(outputs.stop_reason[i])],
            time_s=times.run_s,
            spec=spec[i] if spec else None,
            times=times,
        )
    return results


def consecutive_runs(results: Mapping[int, TokenResult]) -> Iterator[tuple[int, list[TokenResult]]]:
    """(first index, results) of each run of consecutive indices of `results`, in index order."""
    run: list[TokenResult] = []
    first = None
    for index in sorted(results):
        if run and index != first + len(run):
            yield first, run
            run = []
        if not run:
            first = index
        run.append(results[index])
    if run:
        yield first, run


def run_chunks(
    target: TargetModel | ModelConfig,
    params,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int | Sequence[int],
    sampling: SamplingParams,
    criteria: StopCriteria,
    row_keys: np.ndarray,
    batch_size: int,
    capacity: int | None = None,
    drafter=None,
    drafter_params=None,
    drafter_carry=(),
    policy: RefillPolicy = REFILL_POLICY,
    mesh=None,
) -> Iterator[dict[int, TokenResult]]:
    """Runs a job's prompts through `batch_size` slots refilled as rows end, in chunks of
    `capacity` prompts (default `chunk_capacity`): ONE program call per chunk
    (`refill.refill_program`), built before it runs. The prompts go in `length_groups` (by the
    bucket of their length, shortest first, file order within), each group's in slots as wide as
    its longest prompt needs; within a group the slots (and rows still running in them) go from
    one call to the next, so they drain only at the group's end; the drafter's job-level carry
    goes from group to group.

    Same arguments as `run_batch` (max_new_tokens: one for all or one per prompt), plus the
    refill policy. Yields, per call, {job index: TokenResult} of the rows that ended in it;
    their `times` hold the call's compile seconds (a group's first call's also its slots'
    start), its whole run as decode_s (prefill_s 0: prefill runs inside the loop) and its
    `SlotStats`. mesh: as `run_batch`'s (the slots rounded up to a multiple of dp, split over
    it with the cache; the queue replicated: every device can start any prompt).
    """
    if drafter is not None:
        drafter.check_target(target)
    limits = row_limits(max_new_tokens, len(prompts))
    capacity = capacity or chunk_capacity(batch_size, len(prompts))
    rows = padded_rows(batch_size, mesh)
    tree = None if drafter is None else drafter.tree
    calls = 0
    extra = bucket(max(limits)) + draft_margin(tree)
    for group in length_groups([len(p) for p in prompts], 2 * rows, extra):
        shape = batch_shape([len(prompts[i]) for i in group], rows, max(limits), tree)
        cache = empty_cache_on(mesh, as_target(target), rows, shape.width)
        slots, start_compile_s, start_s = build_and_run(slots_program, drafter, drafter_params,
                                                        cache, drafter_carry, width=shape.width)
        placement = None if mesh is None else jax.tree.map(lambda x: x.sharding, slots)
        for first in range(0, len(group), capacity):
            members = group[first: first + capacity]
            queue = PromptQueue.build([prompts[i] for i in members], [limits[i] for i in members],
                                      row_keys[members], capacity, shape.prompt_width,
                                      index=members)
            if mesh is not None:
                queue = jax.tree.map(lambda x: put(x, replicated(mesh)), queue)
            last = first + capacity >= len(group)
            (outputs, counters, slots), compile_s, run_s = build_and_run(
                refill_program, target, params, drafter, drafter_params, queue, slots, sampling,
                criteria, last, policy=policy)
            if placement is not None:  # the next call's slots where the first call's were
                slots = jax.device_put(slots, placement)
            outputs, counters = fetch((outputs, counters))
            slot_stats = SlotStats(rows, *(int(x) for x in (
                counters.decode_steps, counters.busy_slot_steps, counters.refills, counters.prefilled)))
            times = BatchTimes(calls, compile_s + start_compile_s, 0.0, run_s + start_s, slot_stats)
            start_compile_s = start_s = 0.0
            calls += 1
            yield chunk_results(outputs, prompts, times)
        if drafter is not None:  # the job-level state goes on to the next group's slots
            drafter_carry = drafter.carry(slots.drafter_state)


#: a refilling job's length group takes in the next longer prompts while its slots' width stays
#: within this factor of what its shortest prompts need (wider slots cost every decoding step)
GROUP_WIDTH_GROWTH = 1.5


def length_groups(lengths: Sequence[int], min_size: int, extra: int = 0) -> list[list[int]]:
    """The prompts' indices (file order within a group) grouped by the power-of-two bucket of
    their length, shortest first. A group takes in the next longer bucket while it has fewer
    than min_size prompts, or while its slots' width (bucket + extra: the max_new_tokens bucket
    and the draft margin) stays within GROUP_WIDTH_GROWTH of its first bucket's; a small last
    group joins the one before. A refilling job runs each group in slots of its own width, so
    a long prompt widens only its group's slots (and their drain is one per group)."""
    by_bucket: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        by_bucket.setdefault(batch_bucket(n), []).append(i)
    groups: list[list[int]] = []
    pending: list[int] = []
    base = 0
    for size in sorted(by_bucket):
        if pending and len(pending) >= min_size and size + extra > GROUP_WIDTH_GROWTH * (base + extra):
            groups.append(sorted(pending))
            pending = []
        if not pending:
            base = size
        pending += by_bucket[size]
    if pending and len(pending) < min_size and groups:
        groups[-1] = sorted(groups[-1] + pending)
    elif pending:
        groups.append(sorted(pending))
    return groups


def drafter_dtype(dtype: str, target) -> str:
    """The dtype a drafter's own weights load in: `dtype`, where "auto" follows a built-in
    target's dtype (else `resolve_dtype("auto")`)."""
    if dtype == "auto" and isinstance(target, ModelConfig):
        return target.dtype
    return resolve_dtype(dtype)


def llama_config(model) -> ModelConfig | None:
    """The Llama config of a target (a ModelConfig, a `Llama`) or of a drafter that runs its own
    Llama (a draft model, layerskip), to check a mesh against; None for the others (their
    params are placed by the rules' fallback)."""
    cfg = model if isinstance(model, ModelConfig) else getattr(model, "cfg", None)
    return cfg if isinstance(cfg, ModelConfig) else None


def build_drafter(choice: DraftChoice, target, params, model, dtype: str):
    """(drafter, drafter params) of a checked `draft=`: a spec is built for the target through
    the registry (`model`: the loaded model with its tokenizer, when there is one)."""
    if choice.spec is None:
        return choice.drafter, choice.params
    return make_drafter(choice.spec, tree=choice.tree, target=model, target_cfg=target,
                        target_params=params, dtype=drafter_dtype(dtype, target), auto=choice.auto)


def renamed_drafter(draft, drafter):
    """`draft=`, or the value of its deprecated name `drafter=` (with a DeprecationWarning)."""
    if drafter is None:
        return draft
    warnings.warn("generate_ids(drafter=...) is deprecated: pass draft=", DeprecationWarning, stacklevel=3)
    if draft is not None:
        raise ValueError("give draft= only (drafter= is its deprecated name)")
    return drafter


def iter_generate_ids(
    target: TargetModel | ModelConfig,
    params,
    prompts: Sequence[Sequence[int]],
    *,
    draft=None,
    num_draft: int | None = None,
    tree: TreeSpec | str | None = None,
    drafter_params=None,
    config: GenerationConfig | None = None,
    max_new_tokens: int | Sequence[int] | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_ids: Sequence[int] | None = None,
    stop_token_seqs: Sequence[Sequence[int]] = (),
    seed: int | None = None,
    key: jax.Array | None = None,
    batch_size: int | None = None,
    max_len: int | None = None,
    schedule=None,
    labels: Sequence[str] | None = None,
    prompt_ids: Sequence[int | str] | None = None,
    model=None,
    dtype: str = "auto",
    drafter=None,
    mesh=None,
    refill: bool = True,
    ordered: bool = True,
) -> Iterator[tuple[int, list[TokenResult]]]:
    """Yields (index of the chunk's first prompt, its TokenResults) as each chunk (static
    batch, with refill=False) finishes.

    target: the target model: a `specjax.target.TargetModel`, or a ModelConfig for the built-in
      Llama; params: its params pytree.
    prompts: a sequence of token-id sequences (ints or numpy integers; floats are refused).
    draft: None (plain decoding), a drafter spec string (`specjax.drafters.registry`, e.g.
      "ngram", "suffix:1-6", "eagle3:DIR"), a Drafter, or a `(drafter, params)` pair.
    num_draft / tree: the draft shape, a chain of num_draft tokens or a tree (a TreeSpec, preset
      name or YAML path); default: a chain of 4 for a spec, a Drafter's own tree.
    drafter_params: the params of a Drafter given alone (default None).
    config: a GenerationConfig, in place of max_new_tokens, temperature, top_k, top_p and
      eos_ids (default: GenerationConfig()'s values; an option given both ways is an error).
      max_new_tokens may also be a sequence of ints, one per prompt.
      eos_ids: ids that end a row (None: the target's `eos_token_ids`; () = none).
    stop_token_seqs: token sequences that end a row (stop strings need `generate`).
    seed / key: the job's PRNG seed (int in [0, 2^32), default 0) or a JAX PRNG key; not both.
    batch_size: prompts per batch at most (default: all prompts at once); each batch runs as
      many rows as its prompts' bucket (`batch_rows`: 1 prompt -> 1 row, 3 -> 4, never more than
      batch_size); a drafter's job-level state is carried across batches.
    max_len: the longest row in cache entries (default: the target's max_position_embeddings).
    schedule: a `specjax.schedule.Schedule` (or its YAML path) whose bucket for the job's batch
      rows (`batch_rows(batch_size, len(prompts))`) sets the draft shape (0 = no speculation);
      with draft=None the schedule's own drafter spec is built.
    labels: names of the prompts in errors (default "prompt i").
    prompt_ids: a stable int or str per prompt (default: its index in `prompts`); a row samples
      with fold_in(job key, its id) only, so the same prompt, id and seed give the same tokens at
      any batch size or position, e.g. when a job is resumed with the remaining rows.
    model: the loaded model (with its tokenizer) when there is one, for drafter specs that need
      it; dtype: of a drafter's own weights ("auto": the target's).
    drafter: deprecated name of draft.
    mesh: None (one device, the default), "auto" (every local device on dp), "dp=N,tp=M", a
      `specjax.sharding.MeshSpec` or a `jax.sharding.Mesh` with axes ("dp", "tp"): params are
      split by `specjax.sharding.LLAMA_RULES` (tp), each batch's rows over dp (rounded up to a
      multiple of dp with padding rows); the tokens are the same as on one device.
    refill: continuous batching (default True): the prompts go to the device in chunks of up
      to CHUNK_BATCHES * batch_size, and the batch's rows are slots refilled with the next
      prompt as rows end, inside one program per chunk (`specjax.refill`); one (start, results)
      per run of consecutive prompts that ended; the slots go on from chunk to chunk. False:
      static batches of batch_size run to their slowest row, one (start, results) per batch.
      The tokens are the same either way.
    ordered: yield in prompt order (default True); False (refill only): each chunk's rows as
      soon as its call returns (runs may come out of order; a killed job loses fewer rows).
    Every argument is checked when this is called (TypeError / ValueError / PromptError naming
    the row or argument), before anything compiles; the batches run as the result is iterated.
    """
    prompts, labels = id_prompts(prompts, labels)
    max_new_tokens, limits = per_prompt_limits(max_new_tokens, len(prompts))
    generation = GenerationConfig.resolve(config, max_new_tokens=max_new_tokens,
                                          temperature=temperature, top_k=top_k, top_p=top_p,
                                          eos_ids=eos_ids)
    if generation.stop:
        raise ValueError("stop strings need the tokenizer: use specjax.generate, or pass their "
                         "token sequences as stop_token_seqs=")
    choice = draft_choice(renamed_drafter(draft, drafter), num_draft, tree, drafter_params,
                          sampled=generation.temperature > 0)
    return id_job(target, params, prompts, generation, job_key(seed, key), choice,
                  stop_token_seqs=stop_token_seqs, batch_size=batch_size, max_len=max_len,
                  schedule=schedule, labels=labels, prompt_ids=prompt_ids, model=model, dtype=dtype,
                  mesh=as_mesh(mesh), refill=refill, ordered=ordered, limits=limits)


def id_job(target, params, prompts: list[list[int]], generation: GenerationConfig,
           key: np.ndarray, choice: DraftChoice, *, stop_token_seqs, batch_size: int | None,
           max_len: int | None, schedule, labels: list[str], prompt_ids, model, dtype: str,
           mesh=None, refill: bool = True, ordered: bool = True, limits: list[int] | None = None):
    """The batches of a job whose options are checked (`iter_generate_ids` documents them),
    after the checks that need the target: prompt ids in its vocabulary, rows within max_len,
    a mesh that divides the model. key: the job's `[2]` uint32 PRNG key; mesh: a Mesh or None;
    limits: each prompt's max_new_tokens (None: the generation config's for all)."""
    check_sizes(batch_size, max_len)
    check_refill(refill)
    check_refill(ordered, "ordered")
    limits = limits or [generation.max_new_tokens] * len(prompts)
    use_compile_cache()  # the first job of the process sets the persistent cache up
    key_ids = row_key_ids(prompt_ids, len(prompts))
    target_model = as_target(target)
    eos_ids = target_model.eos_token_ids if generation.eos_ids is None else generation.eos_ids
    criteria = StopCriteria.make(eos_ids, stop_token_seqs)
    batch_size = batch_rows(batch_size, len(prompts))
    margin = draft_margin(batch_tree(choice, schedule, batch_size))
    validate_prompts(prompts, target_model.vocab_size, limits,
                     max_len or target_model.max_position_embeddings, labels, margin)
    params = shard_params(params, mesh, llama_config(target))
    drafter, drafter_params = build_drafter(choice, target, params, model, dtype)
    if choice.auto and schedule is None:
        drafter, drafter_params = auto_drafter(target, params, drafter, drafter_params, batch_size)
    return _run_job(
        target, params, prompts, job_row_keys(key, key_ids), batch_size=batch_size,
        drafter=drafter, drafter_params=drafter_params, schedule=schedule, model=model,
        dtype=drafter_dtype(dtype, target), mesh=mesh, max_new_tokens=limits,
        sampling=generation.sampling(), criteria=criteria, refill=refill, ordered=ordered,
    )


def _run_job(target, params, prompts, row_keys: np.ndarray, *, batch_size: int, drafter,
             drafter_params, schedule, model, dtype: str, mesh=None, refill: bool = False,
             ordered: bool = True, **batch_options):
    """The batches of a checked job, as `iter_generate_ids` yields them. row_keys `[N, 2]`: each
    prompt's PRNG key; batch_options: run_batch's max_new_tokens, sampling, criteria; refill:
    chunks of prompts through refilled slots (`_run_refill_job`) instead of static batches."""
    drafter, drafter_params = scheduled(drafter, drafter_params, schedule, batch_size, model, dtype)
    drafter_params = shard_params(drafter_params, mesh, llama_config(drafter))
    if refill:
        yield from _run_refill_job(target, params, prompts, row_keys, batch_size=batch_size,
                                   drafter=drafter, drafter_params=drafter_params, mesh=mesh,
                                   ordered=ordered, **batch_options)
        return
    carry = () if drafter is None else drafter.init_carry(drafter_params)
    limits = batch_options.pop("max_new_tokens")
    for index, (start, chunk) in enumerate(batches(prompts, batch_size)):
        results, carry = run_batch(
            target, params, chunk, row_keys=row_keys[start : start + len(chunk)],
            max_new_tokens=limits[start : start + len(chunk)],
            batch_size=batch_rows(batch_size, len(chunk)), drafter=drafter, drafter_params=drafter_params,
            drafter_carry=carry, batch=index, mesh=mesh, **batch_options,
        )
        yield start, results


def _run_refill_job(target, params, prompts, row_keys: np.ndarray, *, batch_size: int, drafter,
                    drafter_params, mesh=None, ordered: bool = True, **batch_options):
    """The runs of a checked job through `batch_size` refilled slots (`run_chunks`), as
    `iter_generate_ids` yields them: in prompt order (ordered), or each call's rows as they end."""
    carry = () if drafter is None else drafter.init_carry(drafter_params)
    pending: dict[int, TokenResult] = {}
    done = 0
    for ended in run_chunks(target, params, prompts, row_keys=row_keys, batch_size=batch_size,
                            drafter=drafter, drafter_params=drafter_params, drafter_carry=carry,
                            mesh=mesh, **batch_options):
        if not ordered:
            yield from consecutive_runs(ended)
            continue
        pending.update(ended)
        run = []
        while done + len(run) in pending:
            run.append(pending.pop(done + len(run)))
        if run:
            yield done, run
            done += len(run)


def generate_ids(target: TargetModel | ModelConfig, params, prompts: Sequence[Sequence[int]],
                 **options) -> list[TokenResult]:
    """Generates from token-id prompts; one TokenResult per prompt, in order (see
    `iter_generate_ids` for the options).

    >>> generate_ids(cfg, params, [[1, 2, 3]], draft="ngram", num_draft=4, max_new_tokens=32)
    """
    if "drafter" in options:  # the deprecated name, resolved here so the warning names the caller
        options["draft"] = renamed_drafter(options.get("draft"), options.pop("drafter"))
    return [r for _, batch in iter_generate_ids(target, params, prompts, **options) for r in batch]


# ---------------------------------------------------------------------------------------------
# Text level
# ---------------------------------------------------------------------------------------------


def truncate_at_stop(
    tokenizer, token_ids: list[int], stop_reason: str, stops: Sequence[str], eos_ids: Sequence[int]
) -> tuple[str, list[int], str]:
    """(completion text, token ids, stop reason) with EOS and stop strings handled exactly.

    The device stops on the token sequences of stop strings; a stop string produced by another
    tokenization is caught here in the text. The completion excludes the EOS token and the stop
    string; token_ids keep everything up to and including the token that completed the stop.
    """
    text_ids = token_ids[:-1] if stop_reason == "eos" and token_ids and token_ids[-1] in eos_ids else token_ids
    text = tokenizer.decode(text_ids)
    cut = min((i for i in (text.find(s) for s in stops if s) if i >= 0), default=-1)
    if cut < 0:
        return text, token_ids, stop_reason
    keep = next(
        n for n in range(1, len(text_ids) + 1)
        if any(s and s in tokenizer.decode(text_ids[:n]) for s in stops)
    )
    return text[:cut], token_ids[:keep], "stop"


def loaded(model, dtype: str, mesh=None, quantize: str | None = None):
    """A loaded model (cfg, params, tokenizer) from itself or a name / path to load
    (`specjax.models.hub.load_model`; on a mesh, each weight straight into its shards;
    `quantize`: its weight-only quantization, `docs/quantization.md`)."""
    if isinstance(model, (str, os.PathLike)):
        return load_model(model, dtype=dtype, shardings=loader_shardings(mesh), quantize=quantize)
    if not all(hasattr(model, part) for part in ("cfg", "params", "tokenizer")):
        raise TypeError("model must be a name, a path or a loaded model (specjax.load), got "
                        f"{describe(model)}")
    if quantize is not None:
        raise ValueError("quantize= applies to a model loaded by name or path; quantize a loaded "
                         "one with specjax.load(..., quantize=)")
    return model


def model_eos_ids(model) -> tuple[int, ...]:
    """The ids that end a row by default: the config's end tokens, then the tokenizer's."""
    return tuple(dict.fromkeys(tuple(model.cfg.eos_token_ids) + tuple(model.tokenizer.eos_token_ids)))


def iter_generate(
    model,
    prompts,
    *,
    draft=None,
    num_draft: int | None = None,
    tree: TreeSpec | str | None = None,
    drafter_params=None,
    config: GenerationConfig | None = None,
    max_new_tokens: int | Sequence[int] | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    stop: str | Sequence[str] | None = None,
    eos_ids: Sequence[int] | None = None,
    seed: int | None = None,
    key: jax.Array | None = None,
    chat: bool = True,
    batch_size: int = 8,
    dtype: str = "auto",
    max_len: int | None = None,
    labels: Sequence[str] | None = None,
    schedule=None,
    prompt_ids: Sequence[int | str] | None = None,
    mesh=None,
    refill: bool = True,
    ordered: bool = True,
) -> Iterator[tuple[int, list[Generation]]]:
    """Yields (index of the chunk's first prompt, its Generations) as each chunk (static batch,
    with refill=False) finishes.

    model: a loaded model (`specjax.load`: cfg, params, tokenizer) or a name / path to load.
    prompts: one prompt or a sequence of them; a prompt is a str, a chat (a list of
      {"role": ..., "content": ...} messages, any number of turns, rendered with the tokenizer's
      chat template) or a sequence of token ids (used as they are).
    draft: None (plain decoding), a drafter spec string (e.g. "ngram", "suffix", "eagle3:DIR";
      the kinds: `specjax.drafters.registry.available_drafters()`), a Drafter, or a
      `(drafter, params)` pair. num_draft / tree: the draft shape, a chain of num_draft tokens or
      a tree (TreeSpec, preset name or YAML path); default: a chain of 4 for a spec, a Drafter's
      own tree. drafter_params: the params of a Drafter given alone.
    config: a GenerationConfig in place of max_new_tokens (default 128), temperature (0 =
      greedy), top_k, top_p, stop (a stop string or several) and eos_ids (default: the model's
      and its tokenizer's end tokens); an option given both ways is an error. max_new_tokens
      may also be a sequence of ints, one per prompt.
    seed / key: the job's PRNG seed (int in [0, 2^32), default 0) or a JAX PRNG key; not both.
    chat: render str prompts with the chat template (default True; chats always are).
    batch_size: prompts per batch at most (default 8); a batch runs as many rows as its
      prompts' bucket (one prompt: a batch of 1).
    dtype: of the weights loaded for a name / path and for a drafter's own weights: "auto"
      (default: bfloat16 on GPU / TPU, float32 on CPU; a drafter follows the target), "float32",
      "bfloat16" or "float16".
    max_len: the longest row in cache entries (default: the model's max_position_embeddings).
    labels: names of the prompts in error messages (default "prompt i").
    schedule: a tuned `specjax.schedule.Schedule` or its YAML path: the bucket of the job's batch
      rows picks the draft shape (with draft=None, the schedule's own drafter spec is built).
    prompt_ids: a stable int or str per prompt (default: its index), which alone with the seed
      sets the row's sampling (see `iter_generate_ids`); `specjax generate` passes the row ids.
    mesh: None (one device), "auto", "dp=N,tp=M", a MeshSpec or a Mesh (see `iter_generate_ids`);
      a model given by name / path loads straight into its shards.
    refill: continuous batching in chunks (default True; see `iter_generate_ids`); False:
      static batches. ordered: prompt order (default), or each chunk's rows as its call
      returns (see `iter_generate_ids`).
    The prompts' types and every option are checked before the model loads (TypeError /
    ValueError / PromptError naming the row or argument); the prompts' lengths once tokenized.
    """
    rows, labels = text_level_prompts(prompts, labels)
    max_new_tokens, limits = per_prompt_limits(max_new_tokens, len(rows))
    generation = GenerationConfig.resolve(config, max_new_tokens=max_new_tokens,
                                          temperature=temperature, top_k=top_k, top_p=top_p,
                                          stop=stop, eos_ids=eos_ids)
    job = job_key(seed, key)
    choice = draft_choice(draft, num_draft, tree, drafter_params,
                          sampled=generation.temperature > 0)
    check_sizes(batch_size, max_len)
    check_refill(refill)
    row_key_ids(prompt_ids, len(rows))
    mesh = as_mesh(mesh)
    model = loaded(model, dtype, mesh)
    tokenizer = model.tokenizer
    if generation.eos_ids is None:
        generation = dataclasses.replace(generation, eos_ids=model_eos_ids(model))
    batches_of_results = id_job(
        model.cfg, model.params, [row.encode(tokenizer, chat) for row in rows], generation, job,
        choice, stop_token_seqs=tokenizer.stop_sequences(generation.stop), batch_size=batch_size,
        max_len=max_len, schedule=schedule, labels=labels, prompt_ids=prompt_ids, model=model,
        dtype=dtype, mesh=mesh, refill=refill, ordered=ordered, limits=limits,
    )
    return _generations(tokenizer, rows, batches_of_results, generation)


def _generations(tokenizer, rows: list[Prompt], batches_of_results, generation: GenerationConfig):
    """(start, Generations) of each batch of (start, TokenResults), stop strings applied."""
    for start, results in batches_of_results:
        out = []
        for j, res in enumerate(results):
            text, token_ids, reason = truncate_at_stop(tokenizer, res.token_ids, res.stop_reason,
                                                       generation.stop, generation.eos_ids)
            out.append(Generation(
                prompt=rows[start + j].given, completion=text, token_ids=token_ids,
                num_new_tokens=len(token_ids), stop_reason=reason, time_s=res.time_s, spec=res.spec,
                times=res.times,
            ))
        yield start, out


def generate(model, prompts, **options) -> list[Generation]:
    """Generates a completion for each prompt, in order; see `iter_generate` for the options.

    >>> generate("smollm2-135m", ["Name three primes."], draft="ngram", num_draft=4)
    >>> generate(model, [[{"role": "user", "content": "Hi"}]], config=GenerationConfig(max_new_tokens=32))
    """
    return [g for _, batch in iter_generate(model, prompts, **options) for g in batch]
