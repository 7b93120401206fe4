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

With `num_draft="auto"` (`specjax.drafters.auto`) a row also counts the steps it ran under each
chain length D = 0..Dmax (`shape_steps`; D = 0: a plain step) and the auto mode's predictions
for it: `predicted_tokens` (E[tokens per step] of the chosen shape, summed over its steps) and
`predicted_s` (its share of each step's predicted seconds: T(D) / active rows), so that summed
over rows, predicted tokens / predicted seconds is the job's predicted tokens/s.
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
    shape_steps: jax.Array  # [B, Dmax + 1] int32 steps under chain length D (auto mode)
    predicted_tokens: jax.Array  # [B] f32 (auto mode)
    predicted_s: jax.Array  # [B] f32 (auto mode)

    @classmethod
    def zeros(cls, batch_size: int, max_depth: int, num_trees: int = 0) -> SpecMetrics:
        """num_trees: auto's tree branches (`shape_steps` slots past the chain lengths)."""
        zero = jnp.zeros((batch_size,), jnp.int32)
        real = jnp.zeros((batch_size,), jnp.float32)
        return cls(zero, zero, zero, jnp.zeros((batch_size, max_depth), jnp.int32),
                   jnp.zeros((batch_size, max_depth + 1 + num_trees), jnp.int32), real, real)

    @classmethod
    def for_drafter(cls, batch_size: int, drafter) -> SpecMetrics:
        """Zeros sized for `drafter` (its tree's depth; auto's tree branches)."""
        return cls.zeros(batch_size, drafter.tree.max_depth, len(getattr(drafter, "trees", ())))

    def record(self, active: jax.Array, drafted: jax.Array, accepted: jax.Array) -> SpecMetrics:
        """Adds one step for active rows `[B]`: drafted `[B]`, accepted `[B]` tokens."""
        on = active.astype(jnp.int32)
        depth = jnp.arange(self.accepted_per_pos.shape[1])[None, :]
        return self.replace(
            steps=self.steps + on,
            drafted=self.drafted + on * drafted,
            accepted=self.accepted + on * accepted,
            accepted_per_pos=self.accepted_per_pos + on[:, None] * (depth < accepted[:, None]),
        )

    def record_shape(self, active: jax.Array, num_draft: jax.Array, tokens_per_step: jax.Array,
                     step_s: jax.Array) -> SpecMetrics:
        """Adds the auto mode's pick of one step for active rows `[B]`: its slot `[]` (the chain
        length D, or Dmax + 1 + i for auto's tree branch i), its predicted E[tokens per step]
        `[]` and step seconds `[]` (shared by the active rows)."""
        on = active.astype(jnp.int32)
        share = step_s / jnp.maximum(jnp.sum(on), 1)
        lengths = jnp.arange(self.shape_steps.shape[1])[None, :]
        return self.replace(
            shape_steps=self.shape_steps + on[:, None] * (lengths == num_draft),
            predicted_tokens=self.predicted_tokens + on * tokens_per_step,
            predicted_s=self.predicted_s + on * share,
        )


def length_histogram(steps: int, per_pos: Iterable[int]) -> list[int]:
    """`[Dmax + 1]` steps that accepted exactly k = 0..Dmax draft tokens."""
    at_least = [int(steps)] + [int(x) for x in per_pos] + [0]
    return [a - b for a, b in zip(at_least[:-1], at_least[1:])]


def shape_key(slot: int, max_depth: int | None) -> str:
    """The shape histogram's key of a `shape_steps` slot: "D" for a chain of D (0: a plain
    step), "tree{i}" for auto's tree branch i (`AutoDrafter.trees`)."""
    return str(slot) if max_depth is None or slot <= max_depth else f"tree{slot - max_depth - 1}"


def auto_summary(shape_steps, predicted_tokens: float, predicted_s: float,
                 max_depth: int | None = None) -> dict:
    """The auto mode's part of a summary: {"shape_histogram": {shape: steps} of the shapes
    used (`shape_key`), "predicted_tokens", "predicted_s", "predicted_tokens_per_s"}; {} when
    it never ran. shape_steps: steps per slot, or a {shape: steps} histogram."""
    if isinstance(shape_steps, dict):
        histogram = {str(k): int(n) for k, n in shape_steps.items() if n}
    else:
        histogram = {shape_key(d, max_depth): int(n) for d, n in enumerate(shape_steps) if n}
    if not histogram:
        return {}
    predicted_tokens, predicted_s = float(predicted_tokens), float(predicted_s)  # JSON: no numpy
    return {"shape_histogram": histogram,
            "predicted_tokens": predicted_tokens, "predicted_s": predicted_s,
            "predicted_tokens_per_s": predicted_tokens / predicted_s if predicted_s > 0 else 0.0}


def summarize(steps: int, drafted: int, accepted: int, per_pos: Iterable[int],
              shape_steps: Iterable[int] = (), predicted_tokens: float = 0.0,
              predicted_s: float = 0.0) -> dict:
    """The derived statistics of a set of counters (one row, or a job's sums); with the auto
    mode's counters, its shape histogram and predictions too (`auto_summary`)."""
    per_pos = [int(x) for x in per_pos]
    previous = [steps] + per_pos[:-1]
    return auto_summary(shape_steps, predicted_tokens, predicted_s, len(per_pos)) | {
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
        summarize(m.steps[i], m.drafted[i], m.accepted[i], m.accepted_per_pos[i],
                  m.shape_steps[i], m.predicted_tokens[i], m.predicted_s[i])
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
    shapes: dict[str, int] = {}
    for r in rows:
        for d, n in r.get("shape_histogram", {}).items():
            shapes[d] = shapes.get(d, 0) + int(n)
    order = lambda k: (k.startswith("tree"), int(k.removeprefix("tree")))
    shapes = {k: shapes[k] for k in sorted(shapes, key=order)}
    return summarize(
        sum(r["steps"] for r in rows), sum(r["drafted"] for r in rows),
        sum(r["accepted"] for r in rows), per_pos, shapes,
        sum(r.get("predicted_tokens", 0.0) for r in rows), sum(r.get("predicted_s", 0.0) for r in rows),
    )
