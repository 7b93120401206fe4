"""Logit processing and sampling, all in f32.

Temperature, top-k and top-p are dynamic values (a pytree), so changing them never recompiles;
only greedy or not is static when `SamplingParams.make` built the params (`greedy`): a greedy
program then holds no sampling code (no PRNG draws, no top-k / top-p, no rejection sampling)
and a sampling program no greedy branch, which is most of a CPU compile's kernels.
The same `probabilities` transform is applied to the target's and the drafter's logits before
any acceptance rule, which is what makes speculative sampling exact.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct

from specjax.kernels.argmax_cpu import rows_argmax
from specjax.models.paths import cache_dir


def greedy_tokens(logits: jax.Array) -> jax.Array:
    """`[..., V]` -> int32 `[...]`: each row's argmax (the first of equal maxima; a row with a
    NaN: its first NaN), by the CPU kernel where it runs (`kernels.argmax_cpu`: XLA CPU's
    argmax reads ~0.5 GB/s, a wide verify's logits are several ms of a step), else jnp."""
    return rows_argmax(logits, cache_dir() / "kernels")


#: the logit of a token outside the support (top-k / top-p, a reduced draft vocabulary):
#: probability exactly 0, and detectable (`isfinite` is False); the one definition
MASKED_LOGIT = -jnp.inf


@struct.dataclass
class SamplingParams:
    """Dynamic sampling knobs (scalars, shared by every row of a batch).

    temperature: 0 means greedy (argmax); top_k: 0 means off; top_p: 1.0 means off.
    greedy: static (part of the jit cache key): True / False = whether temperature is 0, so
      only that branch is compiled (`branch`); None = decided at run time from temperature
      (one program serves both, e.g. params built by hand or vmapped over temperatures).
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    greedy: bool | None = struct.field(pytree_node=False, default=None)

    @classmethod
    def make(cls, temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None):
        """Validated params; ValueError naming the parameter when one is NaN, infinite or out of
        range (temperature >= 0, top_k an integer >= 0, top_p in (0, 1])."""
        if not (math.isfinite(temperature) and temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
        if top_k is not None and not (
            math.isfinite(top_k) and top_k >= 0 and int(top_k) == top_k
        ):
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {top_k}")
        if top_p is not None and not 0.0 < top_p <= 1.0:  # NaN fails the comparison too
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        return cls(
            temperature=jnp.float32(temperature),
            top_k=jnp.int32(top_k or 0),
            top_p=jnp.float32(1.0 if top_p is None else top_p),
            greedy=bool(temperature == 0),
        )

    @property
    def is_greedy(self) -> jax.Array | bool:
        """Greedy or not: the static `greedy` (a Python bool) when known, else `temperature <= 0`."""
        return self.temperature <= 0.0 if self.greedy is None else self.greedy

    def branch(self, greedy_fn, sampled_fn, *operands):
        """`lax.cond(is_greedy, greedy_fn, sampled_fn, *operands)`, or only the one branch when
        `greedy` is static (the other is never traced, so it costs no compile time)."""
        if self.greedy is None:
            return jax.lax.cond(self.is_greedy, greedy_fn, sampled_fn, *operands)
        return (greedy_fn if self.greedy else sampled_fn)(*operands)


def _top_k_top_p(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Masks (-inf) logits `[..., V]` outside top-k, then outside the top-p nucleus. f32."""
    vocab = logits.shape[-1]
    sorted_desc = -jnp.sort(-logits, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take(sorted_desc, k - 1, axis=-1)[..., None]
    sorted_desc = jnp.where(jnp.arange(vocab) < k, sorted_desc, MASKED_LOGIT)
    sorted_probs = jax.nn.softmax(sorted_desc, axis=-1)
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    keep_count = jnp.maximum(jnp.sum(mass_before < top_p, axis=-1, keepdims=True), 1)
    nucleus_min = jnp.take_along_axis(sorted_desc, keep_count - 1, axis=-1)
    threshold = jnp.maximum(kth, nucleus_min)
    return jnp.where(logits >= threshold, logits, MASKED_LOGIT)


def processed_logits(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """Temperature, then top-k, then top-p, on f32 logits `[..., V]`. Unfiltered tokens are -inf.

    Static greedy params (`SamplingParams.greedy`): the f32 logits unfiltered, as `sample` and
    `probabilities` use them (the argmax, which no filter removes)."""
    if params.greedy:
        return logits.astype(jnp.float32)
    logits = logits.astype(jnp.float32) / jnp.where(params.is_greedy, 1.0, params.temperature)
    needs_filter = (params.top_k > 0) | (params.top_p < 1.0)
    return jax.lax.cond(
        needs_filter,
        lambda x: _top_k_top_p(x, params.top_k, params.top_p),
        lambda x: x,
        logits,
    )


def probabilities(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """The distribution a token is drawn from, `[..., V]` f32: one-hot argmax when greedy."""

    def greedy(x):
        return jax.nn.one_hot(jnp.argmax(x, axis=-1), x.shape[-1], dtype=jnp.float32)

    def sampled(x):
        return jax.nn.softmax(processed_logits(x, params), axis=-1)

    return params.branch(greedy, sampled, logits.astype(jnp.float32))


def sample(key: jax.Array, logits: jax.Array, params: SamplingParams) -> jax.Array:
    """Draws token ids `[...]` int32 from logits `[..., V]` (argmax when greedy)."""

    def sampled(x):
        return jax.random.categorical(key, processed_logits(x, params), axis=-1).astype(jnp.int32)

    return params.branch(greedy_tokens, sampled, logits.astype(jnp.float32))
