"""User-facing generation: validation, bucketing, batching, host-side text handling.

`generate_ids` works on token ids with any (cfg, params); `generate` adds a tokenizer, chat
templates and stop strings. Both run each batch as ONE jitted program (`loop.generate_program`)
whose shapes are bucketed (2^k or 3·2^(k-2) lengths, power-of-two batches), so calls with
other prompt lengths or max_new_tokens inside the same buckets do not compile again.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.loop import STOP_REASONS, StopCriteria, generate_program, spec_generate_program
from specjax.metrics import row_summaries
from specjax.models.cache import init_cache
from specjax.models.config import ModelConfig
from specjax.sampling import SamplingParams
from specjax.schedule import scheduled

MIN_BUCKET = 16


class PromptError(ValueError):
    """A prompt that cannot be generated from (empty, too long, ids outside the vocabulary)."""


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


def validate_prompts(
    prompts: Sequence[Sequence[int]], vocab_size: int, max_new_tokens: int, max_len: int,
    labels: Sequence[str] | None = None,
) -> None:
    """Raises PromptError naming the first bad row."""
    for i, ids in enumerate(prompts):
        name = labels[i] if labels else f"prompt {i}"
        if len(ids) == 0:
            raise PromptError(f"{name} is empty: nothing to condition on")
        bad = [t for t in ids if not 0 <= int(t) < vocab_size]
        if bad:
            raise PromptError(f"{name} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
        if len(ids) + max_new_tokens > max_len:
            raise PromptError(
                f"{name} has {len(ids)} tokens; with max_new_tokens={max_new_tokens} it needs "
                f"{len(ids) + max_new_tokens} cache entries, more than max_len={max_len}"
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


def run_batch(
    cfg: ModelConfig,
    params,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    sampling: SamplingParams,
    criteria: StopCriteria,
    key: jax.Array,
    batch_size: int,
    drafter=None,
    drafter_params=None,
    drafter_carry=(),
) -> tuple[list[TokenResult], object]:
    """Runs one batch (len(prompts) <= batch_size; the rest are padding rows) to completion.

    Plain decoding when drafter is None, else speculative decoding with that drafter.
    Returns (results, the drafter's carry for the job's next batch); drafter_carry is this
    batch's (`drafter.init_carry(drafter_params)` for the first; donated).
    """
    if drafter is not None:
        drafter.check_target(cfg)
    prompt_width = bucket(max(len(p) for p in prompts))
    margin = 0 if drafter is None else drafter.tree.num_nodes + 1
    width = prompt_width + bucket(max_new_tokens) + margin
    tokens, lengths = _pad_batch(prompts, batch_size, prompt_width)
    max_new = np.zeros((batch_size,), np.int32)
    max_new[: len(prompts)] = max_new_tokens
    args = (jnp.asarray(tokens), jnp.asarray(lengths), jnp.asarray(max_new),
            init_cache(cfg, batch_size, width), key, sampling, criteria)
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
    model=None,
    dtype: str = "float32",
) -> Iterator[tuple[int, list[TokenResult]]]:
    """Yields (index of the batch's first prompt, its TokenResults) as each batch finishes.

    Prompts are processed in batches of `batch_size` rows (default: all at once, rounded to a
    bucket); each batch is one jitted prefill+decode program, speculative when a drafter
    (`specjax.drafters`) is given; a drafter's job-level state is carried across batches.
    schedule: a `specjax.schedule.Schedule` (or its YAML path) whose bucket for `batch_size`
    sets the drafter's draft shape (0 = no speculation); with drafter=None the schedule's own
    drafter spec is built for `model`. labels name the prompts in errors.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    max_len = max_len or cfg.max_position_embeddings
    validate_prompts(prompts, cfg.vocab_size, max_new_tokens, max_len, labels)
    sampling = SamplingParams.make(temperature, top_k, top_p)
    criteria = StopCriteria.make(cfg.eos_token_ids if eos_ids is None else eos_ids, stop_token_seqs)
    batch_size = batch_size or batch_bucket(len(prompts))
    drafter, drafter_params = scheduled(drafter, drafter_params, schedule, batch_size, model, dtype)
    carry = () if drafter is None else drafter.init_carry(drafter_params)
    for start, chunk in batches(prompts, batch_size):
        key = jax.random.fold_in(jax.random.PRNGKey(seed), start)
        results, carry = run_batch(
            cfg, params, chunk, max_new_tokens=max_new_tokens, sampling=sampling,
            criteria=criteria, key=key, batch_size=batch_size, drafter=drafter,
            drafter_params=drafter_params, drafter_carry=carry,
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
    if isinstance(model, str):
        from specjax.models.hub import load_model

        return load_model(model, dtype=dtype)
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
) -> Iterator[tuple[int, list[Generation]]]:
    """Yields (index of the batch's first prompt, its Generations) as each batch finishes.

    model: a loaded model (cfg, params, tokenizer) or a name/path for `specjax.models.load_model`.
    draft: None (plain decoding) or a Drafter (see `specjax.drafters.registry.make_drafter`).
    labels: names of the prompts for error messages (default "prompt i").
    schedule: a tuned `specjax.schedule.Schedule` or its YAML path: the bucket of batch_size
      picks the draft shape (with draft=None, the schedule's own drafter spec is built).
    """
    model = _loaded(model, dtype)
    cfg, params, tokenizer = model.cfg, model.params, model.tokenizer
    stops = [s for s in (stop or []) if s]
    eos_ids = tuple(dict.fromkeys(tuple(cfg.eos_token_ids) + tuple(tokenizer.eos_token_ids)))
    labels = labels or [f"prompt {i}" for i in range(len(prompts))]
    for i, text in enumerate(prompts):
        if not text or not text.strip():
            raise PromptError(f"{labels[i]} is empty: nothing to condition on")
    ids = [tokenizer.encode_chat(p) if chat else tokenizer.encode(p) for p in prompts]
    batches_of_results = iter_generate_ids(
        cfg, params, ids, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
        top_p=top_p, seed=seed, eos_ids=eos_ids, stop_token_seqs=tokenizer.stop_sequences(stops),
        batch_size=batch_size, max_len=max_len, drafter=draft, drafter_params=drafter_params,
        schedule=schedule, labels=labels, model=model, dtype=dtype,
    )
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
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    return [g for _, batch in iter_generate(model, prompts, **kwargs) for g in batch]
