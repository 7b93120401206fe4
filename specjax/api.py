"""User-facing generation: validation, bucketing, batching, host-side text handling.

`generate_ids` works on token ids with any (cfg, params); `generate` adds a tokenizer, chat
templates and stop strings. Both run each batch as ONE jitted program (`loop.generate_program`)
whose shapes are bucketed (2^k or 3·2^(k-2) lengths, power-of-two batches), so calls with
other prompt lengths or max_new_tokens inside the same buckets do not compile again.
"""
from __future__ import annotations

import dataclasses
import os
import reprlib
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet

import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters.base import Drafter
from specjax.loop import STOP_REASONS, StopCriteria, generate_program, spec_generate_program
from specjax.metrics import row_summaries
from specjax.models.cache import init_cache
from specjax.models.config import ModelConfig
from specjax.rng import KEY_ID_SPACE, job_row_keys, prompt_key_id
from specjax.sampling import SamplingParams
from specjax.schedule import load_schedule, scheduled
from specjax.tree import TreeSpec, check_num_draft

MIN_BUCKET = 16


class PromptError(ValueError):
    """A prompt that cannot be generated from (empty, too long, ids outside the vocabulary)."""


# ---------------------------------------------------------------------------------------------
# Argument checks: all run before any model load or compile, and name the row or argument
# ---------------------------------------------------------------------------------------------


def _describe(value) -> str:
    """`type value` for an error message, the value shortened."""
    return f"{type(value).__name__} {reprlib.repr(value)}"


def _is_integer(value) -> bool:
    """An int or a numpy integer (not a bool, not a float however round)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_int(value, what: str, low: int, high: int | None = None) -> int:
    """`value` as an int in [low, high) (no upper bound when high is None); TypeError when it is
    not an integer, ValueError when out of range, both naming `what`."""
    bounds = f">= {low}" if high is None else f"in [{low}, {high})"
    if not _is_integer(value):
        raise TypeError(f"{what} must be an integer {bounds}, got {_describe(value)}")
    if value < low or (high is not None and value >= high):
        raise ValueError(f"{what} must be an integer {bounds}, got {value}")
    return int(value)


def check_drafter(drafter) -> None:
    """None or a Drafter whose tree is a TreeSpec within `specjax.tree.MAX_DRAFT_NODES`."""
    if drafter is None:
        return
    if not isinstance(drafter, Drafter):
        raise TypeError("the drafter must be a specjax Drafter (specjax.drafters.registry."
                        f"make_drafter) or None, got {_describe(drafter)}")
    if not isinstance(drafter.tree, TreeSpec):
        raise TypeError(f"the drafter's tree must be a specjax.tree.TreeSpec, got {_describe(drafter.tree)}")
    check_num_draft(drafter.tree.num_nodes, "the drafter's tree size (draft nodes)")


def check_options(*, max_new_tokens, batch_size, seed, max_len, drafter) -> None:
    """Range checks of a job's scalar options (batch_size / max_len None = the default)."""
    check_int(max_new_tokens, "max_new_tokens", 1)
    if batch_size is not None:
        check_int(batch_size, "batch_size", 1)
    check_int(seed, "seed", 0, KEY_ID_SPACE)
    if max_len is not None:
        check_int(max_len, "max_len", 1)
    check_drafter(drafter)


def _rows(values, what: str, expected: str) -> list:
    """An ordered container (list, tuple, array, iterator) as a list, else a TypeError naming
    the argument `what` and what was `expected` (a str, bytes, dict or set is refused)."""
    unordered = (str, bytes, bytearray, Mapping, AbstractSet)
    if isinstance(values, unordered) or not isinstance(values, Iterable):
        raise TypeError(f"{what} must be {expected}, got {_describe(values)}")
    return list(values)


def row_labels(labels, count: int) -> list[str]:
    """The names of `count` rows in errors: `labels` (one per row) or "prompt i"."""
    if labels is None:
        return [f"prompt {i}" for i in range(count)]
    labels = _rows(labels, "labels", "a sequence of str (one per prompt)")
    if len(labels) != count:
        raise ValueError(f"labels has {len(labels)} entries for {count} prompts")
    return [str(label) for label in labels]


def row_key_ids(prompt_ids, count: int) -> list[int]:
    """Each row's PRNG key id (`specjax.rng.prompt_key_id`): from `prompt_ids` (a stable int or
    str per prompt), else the row's index in the job."""
    if prompt_ids is None:
        return list(range(count))
    ids = _rows(prompt_ids, "prompt_ids", "a sequence of ints or strs (one per prompt)")
    if len(ids) != count:
        raise ValueError(f"prompt_ids has {len(ids)} entries for {count} prompts")
    key_ids = []
    for i, prompt_id in enumerate(ids):
        try:
            key_ids.append(prompt_key_id(prompt_id))
        except TypeError:
            raise TypeError(f"prompt_ids[{i}] must be an int or a str, got {_describe(prompt_id)}") from None
    return key_ids


def text_prompts(prompts, labels) -> tuple[list[str], list[str]]:
    """(prompts as a list of non-blank str, their labels); a single str is one prompt.
    TypeError / PromptError name the first bad row."""
    rows = [prompts] if isinstance(prompts, str) else _rows(prompts, "prompts", "a str or a sequence of str")
    labels = row_labels(labels, len(rows))
    for text, name in zip(rows, labels):
        if not isinstance(text, str):
            raise TypeError(f"{name} must be a str, got {_describe(text)}")
        if not text.strip():
            raise PromptError(f"{name} is empty: nothing to condition on")
    return rows, labels


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
        raise TypeError(f"{name} must be a sequence of integer token ids, got {_describe(row)}")
    ids = list(row)
    for position, t in enumerate(ids):
        if not _is_integer(t):
            raise TypeError(f"{name} has a non-integer token id at position {position}: "
                            f"{_describe(t)} (token ids must be integers)")
    return [int(t) for t in ids]


def id_prompts(prompts, labels) -> tuple[list[list[int]], list[str]]:
    """(prompts as lists of int token ids, their labels); TypeError names the first bad row."""
    rows = _rows(prompts, "prompts", "a sequence of token-id sequences")
    labels = row_labels(labels, len(rows))
    return [as_token_ids(row, name) for row, name in zip(rows, labels)], labels


def stop_strings(stop) -> list[str]:
    """The non-empty stop strings of `stop` (None, one str, or a sequence of str)."""
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else _rows(stop, "stop", "a str or a sequence of str")
    for i, s in enumerate(stops):
        if not isinstance(s, str):
            raise TypeError(f"stop[{i}] must be a str, got {_describe(s)}")
    return [s for s in stops if s]


@dataclasses.dataclass(frozen=True)
class TokenResult:
    """One row's output at the token level."""

    token_ids: list[int]  # emitted tokens (EOS included when it ended the row)
    # "eos" | "stop" | "length" | "error"; "error": the target's logits for the next token were
    # NaN / Inf (a damaged checkpoint or an overflow), token_ids hold the tokens chosen before
    stop_reason: str
    time_s: float  # wall time of the batch this row ran in
    spec: dict | None = None  # speculative metrics of the row, when speculating


@dataclasses.dataclass(frozen=True)
class Generation:
    """One prompt's output at the text level."""

    prompt: str
    completion: str
    token_ids: list[int]
    num_new_tokens: int
    stop_reason: str  # "eos" | "stop" | "length" | "error" (see TokenResult.stop_reason)
    time_s: float
    spec: dict | None = None


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


def draft_margin(tree: TreeSpec | None) -> int:
    """Cache entries a row needs beyond prompt + max_new_tokens: what one speculative step
    writes past the committed length (the root and every draft node); 0 without a tree."""
    return 0 if tree is None else tree.num_nodes + 1


def draft_tree(drafter, schedule, batch_size: int) -> TreeSpec | None:
    """The draft tree batches of `batch_size` run with: the schedule's pick for that batch size
    (None = plain decoding), else the drafter's (None without one). Loads no model."""
    if schedule is not None:
        return load_schedule(schedule).pick(batch_size).tree_spec
    return None if drafter is None else drafter.tree


def validate_prompts(
    prompts: Sequence[Sequence[int]], vocab_size: int, max_new_tokens: int, max_len: int,
    labels: Sequence[str] | None = None, margin: int = 0,
) -> None:
    """Raises PromptError naming the first bad row: empty, ids outside the vocabulary, or
    prompt + max_new_tokens + margin (`draft_margin`) more than max_len."""
    for i, ids in enumerate(prompts):
        name = labels[i] if labels else f"prompt {i}"
        if len(ids) == 0:
            raise PromptError(f"{name} is empty: nothing to condition on")
        bad = [t for t in ids if not 0 <= int(t) < vocab_size]
        if bad:
            raise PromptError(f"{name} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
        need = len(ids) + max_new_tokens + margin
        if need > max_len:
            drafts = f" + {margin} for drafting" if margin else ""
            raise PromptError(
                f"{name} has {len(ids)} tokens; with max_new_tokens={max_new_tokens}{drafts} it "
                f"needs {need} cache entries, more than max_len={max_len}"
            )


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


def run_batch(
    cfg: ModelConfig,
    params,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    sampling: SamplingParams,
    criteria: StopCriteria,
    row_keys: np.ndarray,
    batch_size: int,
    drafter=None,
    drafter_params=None,
    drafter_carry=(),
) -> tuple[list[TokenResult], object]:
    """Runs one batch (len(prompts) <= batch_size; the rest are padding rows) to completion.

    Plain decoding when drafter is None, else speculative decoding with that drafter.
    row_keys: `[len(prompts), 2]` uint32, each prompt's PRNG key (`specjax.rng.job_row_keys`).
    Returns (results, the drafter's carry for the job's next batch); drafter_carry is this
    batch's (`drafter.init_carry(drafter_params)` for the first; donated).
    """
    if drafter is not None:
        drafter.check_target(cfg)
    prompt_width = bucket(max(len(p) for p in prompts))
    margin = draft_margin(None if drafter is None else drafter.tree)
    width = prompt_width + bucket(max_new_tokens) + margin
    tokens, lengths = _pad_batch(prompts, batch_size, prompt_width)
    max_new = np.zeros((batch_size,), np.int32)
    max_new[: len(prompts)] = max_new_tokens
    args = (jnp.asarray(tokens), jnp.asarray(lengths), jnp.asarray(max_new),
            init_cache(cfg, batch_size, width), jnp.asarray(_pad_keys(row_keys, batch_size)),
            sampling, criteria)
    start = time.perf_counter()
    if drafter is None:
        state, metrics = generate_program(cfg, params, *args, width=width), None
    else:
        state, metrics, drafter_carry = spec_generate_program(
            cfg, params, drafter, drafter_params, *args, drafter_carry, width=width
        )
    out_tokens, num_tokens, reasons, metrics = jax.device_get(
        (state.tokens, state.num_tokens, state.stop_reason, metrics)
    )
    elapsed = time.perf_counter() - start
    spec = row_summaries(metrics, len(prompts)) if metrics is not None else None
    results = [
        TokenResult(
            token_ids=out_tokens[i, lengths[i] : num_tokens[i]].tolist(),
            stop_reason=STOP_REASONS[int(reasons[i])],
            time_s=elapsed,
            spec=spec[i] if spec else None,
        )
        for i in range(len(prompts))
    ]
    return results, drafter_carry


def iter_generate_ids(
    cfg: ModelConfig,
    params,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    eos_ids: Sequence[int] | None = None,
    stop_token_seqs: Sequence[Sequence[int]] = (),
    batch_size: int | None = None,
    max_len: int | None = None,
    drafter=None,
    drafter_params=None,
    schedule=None,
    labels: Sequence[str] | None = None,
    prompt_ids: Sequence[int | str] | None = None,
    model=None,
    dtype: str = "float32",
) -> Iterator[tuple[int, list[TokenResult]]]:
    """Yields (index of the batch's first prompt, its TokenResults) as each batch finishes.

    prompts: a sequence of token-id sequences (ints or numpy integers; floats are refused).
    Prompts are processed in batches of `batch_size` rows (default: all at once, rounded to a
    bucket); each batch is one jitted prefill+decode program, speculative when a drafter
    (`specjax.drafters`) is given; a drafter's job-level state is carried across batches.
    schedule: a `specjax.schedule.Schedule` (or its YAML path) whose bucket for `batch_size`
    sets the drafter's draft shape (0 = no speculation); with drafter=None the schedule's own
    drafter spec is built for `model`. labels name the prompts in errors.
    prompt_ids: a stable int or str per prompt (default: its index in `prompts`); a row samples
    with fold_in(PRNGKey(seed), its id) only, so the same prompt, id and seed give the same
    tokens at any batch size or position, e.g. when a job is resumed with the remaining rows.
    Every argument is checked when this is called (TypeError / ValueError / PromptError naming
    the row or argument), before anything compiles; the batches run as the result is iterated.
    """
    prompts, labels = id_prompts(prompts, labels)
    check_options(max_new_tokens=max_new_tokens, batch_size=batch_size, seed=seed, max_len=max_len,
                  drafter=drafter)
    key_ids = row_key_ids(prompt_ids, len(prompts))
    sampling = SamplingParams.make(temperature, top_k, top_p)
    criteria = StopCriteria.make(cfg.eos_token_ids if eos_ids is None else eos_ids, stop_token_seqs)
    batch_size = batch_size or batch_bucket(len(prompts))
    margin = draft_margin(draft_tree(drafter, schedule, batch_size))
    validate_prompts(prompts, cfg.vocab_size, max_new_tokens, max_len or cfg.max_position_embeddings,
                     labels, margin)
    return _run_job(
        cfg, params, prompts, job_row_keys(seed, key_ids), batch_size=batch_size,
        drafter=drafter, drafter_params=drafter_params, schedule=schedule, model=model,
        dtype=dtype, max_new_tokens=max_new_tokens, sampling=sampling, criteria=criteria,
    )


def _run_job(cfg, params, prompts, row_keys: np.ndarray, *, batch_size: int, drafter,
             drafter_params, schedule, model, dtype: str, **batch_options):
    """The batches of a checked job, as `iter_generate_ids` yields them. row_keys `[N, 2]`: each
    prompt's PRNG key; batch_options: run_batch's max_new_tokens, sampling, criteria."""
    drafter, drafter_params = scheduled(drafter, drafter_params, schedule, batch_size, model, dtype)
    carry = () if drafter is None else drafter.init_carry(drafter_params)
    for start, chunk in batches(prompts, batch_size):
        results, carry = run_batch(
            cfg, params, chunk, row_keys=row_keys[start : start + len(chunk)],
            batch_size=batch_size, drafter=drafter, drafter_params=drafter_params,
            drafter_carry=carry, **batch_options,
        )
        yield start, results


def generate_ids(cfg: ModelConfig, params, prompts: Sequence[Sequence[int]], **kwargs) -> list[TokenResult]:
    """Generates from token-id prompts; one TokenResult per prompt, in order (see
    `iter_generate_ids` for the options)."""
    return [r for _, batch in iter_generate_ids(cfg, params, prompts, **kwargs) for r in batch]


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


def _loaded(model, dtype: str):
    """A loaded model (cfg, params, tokenizer) from itself or a name / path to load."""
    if isinstance(model, (str, os.PathLike)):
        from specjax.models.hub import load_model

        return load_model(model, dtype=dtype)
    if not all(hasattr(model, part) for part in ("cfg", "params", "tokenizer")):
        raise TypeError("model must be a name, a path or a loaded model (specjax.models."
                        f"load_model), got {_describe(model)}")
    return model


def iter_generate(
    model,
    prompts: Sequence[str],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    stop: Sequence[str] | None = None,
    chat: bool = True,
    batch_size: int = 8,
    draft=None,
    drafter_params=None,
    dtype: str = "float32",
    max_len: int | None = None,
    labels: Sequence[str] | None = None,
    schedule=None,
    prompt_ids: Sequence[int | str] | None = None,
) -> Iterator[tuple[int, list[Generation]]]:
    """Yields (index of the batch's first prompt, its Generations) as each batch finishes.

    model: a loaded model (cfg, params, tokenizer) or a name/path for `specjax.models.load_model`.
    prompts: a str (one prompt) or a sequence of str.
    stop: a stop string or a sequence of them.
    draft: None (plain decoding) or a Drafter (see `specjax.drafters.registry.make_drafter`).
    labels: names of the prompts for error messages (default "prompt i").
    schedule: a tuned `specjax.schedule.Schedule` or its YAML path: the bucket of batch_size
      picks the draft shape (with draft=None, the schedule's own drafter spec is built).
    prompt_ids: a stable int or str per prompt (default: its index), which alone with the seed
      sets the row's sampling (see `iter_generate_ids`); `specjax generate` passes the row ids.
    The prompts' types and every option are checked before the model loads (TypeError /
    ValueError / PromptError naming the row or argument); the prompts' lengths once tokenized.
    """
    prompts, labels = text_prompts(prompts, labels)
    stops = stop_strings(stop)
    check_options(max_new_tokens=max_new_tokens, batch_size=batch_size, seed=seed, max_len=max_len,
                  drafter=draft)
    row_key_ids(prompt_ids, len(prompts))
    SamplingParams.make(temperature, top_k, top_p)
    model = _loaded(model, dtype)
    cfg, params, tokenizer = model.cfg, model.params, model.tokenizer
    eos_ids = tuple(dict.fromkeys(tuple(cfg.eos_token_ids) + tuple(tokenizer.eos_token_ids)))
    ids = [tokenizer.encode_chat(p) if chat else tokenizer.encode(p) for p in prompts]
    batches_of_results = iter_generate_ids(
        cfg, params, ids, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
        top_p=top_p, seed=seed, eos_ids=eos_ids, stop_token_seqs=tokenizer.stop_sequences(stops),
        batch_size=batch_size, max_len=max_len, drafter=draft, drafter_params=drafter_params,
        schedule=schedule, labels=labels, prompt_ids=prompt_ids, model=model, dtype=dtype,
    )
    return _generations(tokenizer, prompts, batches_of_results, stops, eos_ids)


def _generations(tokenizer, prompts: list[str], batches_of_results, stops: list[str], eos_ids):
    """(start, Generations) of each batch of (start, TokenResults), stop strings applied."""
    for start, results in batches_of_results:
        out = []
        for j, res in enumerate(results):
            text, token_ids, reason = truncate_at_stop(tokenizer, res.token_ids, res.stop_reason, stops, eos_ids)
            out.append(Generation(
                prompt=prompts[start + j], completion=text, token_ids=token_ids,
                num_new_tokens=len(token_ids), stop_reason=reason, time_s=res.time_s, spec=res.spec,
            ))
        yield start, out


def generate(model, prompts: str | Sequence[str], **kwargs) -> list[Generation]:
    """Generates a completion for each prompt (text in, text out); see `iter_generate`.

    >>> generate("smollm2-135m", ["Name three primes."], max_new_tokens=32)
    """
    return [g for _, batch in iter_generate(model, prompts, **kwargs) for g in batch]
