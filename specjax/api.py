"""User-facing generation: validation, bucketing, batching, host-side text handling.

`generate_ids` works on token ids with any (cfg, params); `generate` adds a tokenizer, chat
templates and stop strings. Both run each batch as ONE jitted program (`loop.generate_program`)
whose shapes are bucketed (powers of two), so calls with other prompt lengths or
max_new_tokens inside the same buckets do not compile again.
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

MIN_BUCKET = 16


class PromptError(ValueError):
    """A prompt that cannot be generated from (empty, too long, ids outside the vocabulary)."""


@dataclasses.dataclass(frozen=True)
class TokenResult:
    """One row's output at the token level."""

    token_ids: list[int]  # emitted tokens (EOS included when it ended the row)
    stop_reason: str  # "eos" | "stop" | "length"
    time_s: float  # wall time of the batch this row ran in
    spec: dict | None = None  # speculative metrics of the row, when speculating


@dataclasses.dataclass(frozen=True)
class Generation:
    """One prompt's output at the text level."""

    prompt: str
    completion: str
    token_ids: list[int]
    num_new_tokens: int
    stop_reason: str
    time_s: float
    spec: dict | None = None


def bucket(n: int, minimum: int = MIN_BUCKET) -> int:
    """Smallest power of two >= max(n, minimum)."""
    return max(minimum, 1 << max(0, int(n) - 1).bit_length())


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
) -> list[TokenResult]:
    """Runs one batch (len(prompts) <= batch_size; the rest are padding rows) to completion.

    Plain decoding when drafter is None, else speculative decoding with that drafter.
    """
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
        state, metrics = spec_generate_program(
            cfg, params, drafter, drafter_params, *args, width=width
        )
    out_tokens, num_tokens, reasons, metrics = jax.device_get(
        (state.tokens, state.num_tokens, state.stop_reason, metrics)
    )
    elapsed = time.perf_counter() - start
    spec = row_summaries(metrics, len(prompts)) if metrics is not None else None
    return [
        TokenResult(
            token_ids=out_tokens[i, lengths[i] : num_tokens[i]].tolist(),
            stop_reason=STOP_REASONS[int(reasons[i])],
            time_s=elapsed,
            spec=spec[i] if spec else None,
        )
        for i in range(len(prompts))
    ]


def generate_ids(
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
) -> list[TokenResult]:
    """Generates from token-id prompts; one result per prompt, in order.

    Prompts are processed in batches of `batch_size` rows (default: all at once, rounded to a
    bucket); each batch is one jitted prefill+decode program, speculative when a drafter
    (`specjax.drafters`) is given.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    max_len = max_len or cfg.max_position_embeddings
    validate_prompts(prompts, cfg.vocab_size, max_new_tokens, max_len)
    sampling = SamplingParams.make(temperature, top_k, top_p)
    criteria = StopCriteria.make(cfg.eos_token_ids if eos_ids is None else eos_ids, stop_token_seqs)
    batch_size = batch_size or bucket(len(prompts), minimum=1)
    results: list[TokenResult] = []
    for start, chunk in batches(prompts, batch_size):
        key = jax.random.fold_in(jax.random.PRNGKey(seed), start)
        results += run_batch(
            cfg, params, chunk, max_new_tokens=max_new_tokens, sampling=sampling,
            criteria=criteria, key=key, batch_size=batch_size, drafter=drafter,
            drafter_params=drafter_params,
        )
    return results
