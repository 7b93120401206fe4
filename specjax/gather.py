"""Row gathers shared by the acceptance rules and the drafters (below both in the layers), and
`put_rows`, the row scatter the refilling loop and the drafters' `refill` share."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.models.cache import KVCache


def take_rows(x: jax.Array, index: jax.Array) -> jax.Array:
    """`x[b, index[b]]` for x `[B, T, ...]`, index `[B]` -> `[B, ...]`."""
    idx = index.reshape(index.shape + (1,) * (x.ndim - 1))
    return jnp.take_along_axis(x, idx, axis=1)[:, 0]


def put_rows(old, new, slots: jax.Array):
    """The pytree `old` (B rows) with row `slots[r]` replaced by row r of `new` (R rows), leaf
    by leaf; slots `[R]` int32, a slot >= B leaves row r of `new` unused (dropped).

    Batch axes: a `KVCache` keeps its rows on axis 1 of k / v (`[L, B, ...]`) and axis 0 of
    lengths; every other array on axis 0 (`[B, ...]` in old, `[R, ...]` in new). A 0-d leaf
    (a counter) keeps old's value; a leaf that is the very same array in both trees (a
    job-level carry put into both, e.g. the suffix table) is taken as it is. Any other leaf
    without a matching batch axis is a ValueError: it cannot be split into rows.
    """
    count = slots.shape[0]

    def put(a, b, axis: int):
        if a is b:
            return b
        if a.ndim == 0:
            return a
        if b.ndim != a.ndim or b.shape[axis] != count or (
                a.shape[:axis] + a.shape[axis + 1:] != b.shape[:axis] + b.shape[axis + 1:]):
            raise ValueError(f"put_rows: a leaf of shape {a.shape} has no batch axis {axis} "
                             f"matching the {count} new rows of shape {b.shape}")
        index = (slice(None),) * axis + (slots,)
        return a.at[index].set(b.astype(a.dtype), mode="drop")

    def leaf(a, b):
        if isinstance(a, KVCache):
            return KVCache(k=put(a.k, b.k, 1), v=put(a.v, b.v, 1), lengths=put(a.lengths, b.lengths, 0))
        return put(a, b, 0)

    return jax.tree.map(leaf, old, new, is_leaf=lambda x: isinstance(x, KVCache))
