"""Speculative decoding counters with vLLM's definitions.

Per row: steps (verify passes), drafted (draft tokens offered, counted along the longest valid
path per step), accepted, and accepted_per_pos[j] = steps in which the draft token at depth j+1
was accepted. Derived:
  acceptance length  AL = 1 + accepted / steps
  acceptance rate       = accepted / drafted
  joint per position    = accepted_per_pos[j] / steps        (P(first j+1 accepted))
  conditional per pos.  = accepted_per_pos[j] / accepted_per_pos[j-1]  (j = 0: / steps)
  accepted-length histogram[k] = steps that accepted exactly k draft tokens
                              = accepted_per_pos[k-1] - accepted_per_pos[k]  (exact: the
                                counter at j counts the steps with more than j accepted)
"""
from __future__ import annotations

from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class SpecMetrics:
    steps: jax.Array  # [B] int32
    drafted: jax.Array  # [B] int32
    accepted: jax.Array  # [B] int32
    accepted_per_pos: jax.Array  # [B, Dmax] int32

    @classmethod
    def zeros(cls, batch_size: int, max_depth: int) -> SpecMetrics:
        zero = jnp.zeros((batch_size,), jnp.int32)
        return cls(zero, zero, zero, jnp.zeros((batch_size, max_depth), jnp.int32))

    def record(self, active: jax.Array, drafted: jax.Array, accepted: jax.Array) -> SpecMetrics:
        """Adds one step for active rows `[B]`: drafted `[B]`, accepted `[B]` tokens."""
        on = active.astype(jnp.int32)
        depth = jnp.arange(self.accepted_per_pos.shape[1])[None, :]
        return SpecMetrics(
            steps=self.steps + on,
            drafted=self.drafted + on * drafted,
            accepted=self.accepted + on * accepted,
            accepted_per_pos=self.accepted_per_pos + on[:, None] * (depth < accepted[:, None]),
        )


def length_histogram(steps: int, per_pos: Iterable[int]) -> list[int]:
    """`[Dmax + 1]` steps that accepted exactly k = 0..Dmax draft tokens."""
    at_least = [int(steps)] + [int(x) for x in per_pos] + [0]
    return [a - b for a, b in zip(at_least[:-1], at_least[1:])]


def summarize(steps: int, drafted: int, accepted: int, per_pos: Iterable[int]) -> dict:
    """The derived statistics of a set of counters (one row, or a job's sums)."""
    per_pos = [int(x) for x in per_pos]
    previous = [steps] + per_pos[:-1]
    return {
        "steps": int(steps),
        "drafted": int(drafted),
        "accepted": int(accepted),
        "acceptance_length": 1.0 + accepted / steps if steps else 0.0,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "accepted_per_position": per_pos,
        "joint_acceptance": [a / steps if steps else 0.0 for a in per_pos],
        "conditional_acceptance": [a / p if p else 0.0 for a, p in zip(per_pos, previous)],
        "accepted_length_histogram": length_histogram(steps, per_pos),
    }


def row_summaries(metrics: SpecMetrics, num_rows: int) -> list[dict]:
    """Per-row summaries for the first num_rows rows (host arrays)."""
    m = jax.tree.map(np.asarray, metrics)
    return [
        summarize(m.steps[i], m.drafted[i], m.accepted[i], m.accepted_per_pos[i])
        for i in range(num_rows)
    ]


def job_summary(rows: Iterable[dict]) -> dict:
    """Sums row counters (as returned by row_summaries) into one job-level summary."""
    rows = list(rows)
    if not rows:
        return summarize(0, 0, 0, [])
    width = max(len(r["accepted_per_position"]) for r in rows)
    per_pos = np.zeros(width, np.int64)
    for r in rows:
        per_pos[: len(r["accepted_per_position"])] += r["accepted_per_position"]
    return summarize(
        sum(r["steps"] for r in rows), sum(r["drafted"] for r in rows),
        sum(r["accepted"] for r in rows), per_pos,
    )
