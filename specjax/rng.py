"""Per-row PRNG keys: a row's random draws depend only on (seed, its prompt's key id, its step).

On the host, `job_row_keys(job_key, key_ids)` gives every prompt of a job its own key
fold_in(job key, key id) `[N, 2]` uint32 (the job key: `seed_key(seed)` or the caller's own key
as `raw_key(key)`); the key id is the prompt's index in the job or a
stable id the caller gives (`prompt_key_id`: ints as they are, strings by CRC-32, never Python's
salted hash()). Inside a program, a row draws a step's randomness from
fold_in(row key, tokens the row has emitted so far) (`step_keys`), so the same prompt with the
same seed samples the same tokens at any batch size, at any position in the job, and after a
resume.

The drawing helpers take either a batch of row keys `[B, 2]` (typed keys: `[B]`) or ONE key,
which is split into one key per row (`as_row_keys`; the form unit tests use).
"""
from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.sampling import SamplingParams, sample

KEY_ID_SPACE = 2**32  # key ids are folded in as uint32


def prompt_key_id(prompt_id) -> int:
    """A prompt's stable id -> its key id in [0, 2^32): an int modulo 2^32, a str by the CRC-32
    of its UTF-8 text. Raises TypeError for anything else."""
    if isinstance(prompt_id, str):
        return zlib.crc32(prompt_id.encode("utf-8"))
    if isinstance(prompt_id, (int, np.integer)) and not isinstance(prompt_id, (bool, np.bool_)):
        return int(prompt_id) % KEY_ID_SPACE
    raise TypeError(f"a prompt id must be an int or a str, got {type(prompt_id).__name__} {prompt_id!r}")


def seed_key(seed: int) -> np.ndarray:
    """`[2]` uint32: PRNGKey(seed), the job key of an int seed in [0, 2^32)."""
    return np.asarray(jax.random.PRNGKey(seed))


def raw_key(key) -> np.ndarray:
    """`[2]` uint32: a JAX PRNG key as raw data, from a raw `[2]` uint32 key or a typed threefry
    key (`jax.random.key(...)`). TypeError / ValueError for anything else."""
    if isinstance(key, jax.Array) and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    data = np.asarray(key)
    if data.dtype != np.uint32:
        raise TypeError(f"key must be a JAX PRNG key (jax.random.key / PRNGKey), got an array of "
                        f"{data.dtype}")
    if data.shape != (2,):
        raise ValueError(f"key must be ONE threefry PRNG key (raw shape (2,)), got raw shape {data.shape}")
    return data


def job_row_keys(job_key: np.ndarray, key_ids: Sequence[int]) -> np.ndarray:
    """`[N, 2]` uint32 row keys fold_in(job_key, key_ids[i]); job_key `[2]` uint32 (`seed_key`,
    `raw_key`), key ids in [0, 2^32)."""
    if len(key_ids) == 0:
        return np.zeros((0, 2), np.uint32)
    ids = np.asarray(key_ids, np.uint32)
    return np.asarray(jax.vmap(jax.random.fold_in, in_axes=(None, 0))(jnp.asarray(job_key), ids))


def _is_one_key(key: jax.Array) -> bool:
    typed = jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    return key.ndim == (0 if typed else 1)


def as_row_keys(key: jax.Array, batch: int) -> jax.Array:
    """`[B, 2]` row keys: `key` itself when it holds B keys, else ONE key split B ways."""
    if _is_one_key(key):
        return jax.random.split(key, batch)
    if key.shape[0] != batch:
        raise ValueError(f"got {key.shape[0]} row keys for a batch of {batch} rows")
    return key


def step_keys(row_keys: jax.Array, counters: jax.Array) -> jax.Array:
    """`[B, 2]` fold_in(row_keys[b], counters[b]): row b's key for its step `counters[b]` `[B]`."""
    return jax.vmap(jax.random.fold_in)(row_keys, counters.astype(jnp.uint32))


def split_rows(key: jax.Array, batch: int, num: int) -> jax.Array:
    """`[num, B, 2]`: each row's key split `num` ways (index the first axis for one use)."""
    keys = jax.vmap(lambda k: jax.random.split(k, num))(as_row_keys(key, batch))
    return jnp.swapaxes(keys, 0, 1)


def per_row(key: jax.Array, batch: int, draw: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """`[B, ...]`: draw(row b's key) for each row, i.e. row b's noise never depends on the
    others (draw: one key -> an array of the per-row shape)."""
    return jax.vmap(draw)(as_row_keys(key, batch))


def sample_rows(key: jax.Array, logits: jax.Array, sampling: SamplingParams) -> jax.Array:
    """`[B]` int32 tokens from logits `[B, V]`, row b drawn with its own key (argmax when greedy)."""
    keys = as_row_keys(key, logits.shape[0])
    return jax.vmap(sample, in_axes=(0, 0, None))(keys, logits, sampling)
