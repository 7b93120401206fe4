"""Row gathers shared by the acceptance rules and the drafters (below both in the layers)."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def take_rows(x: jax.Array, index: jax.Array) -> jax.Array:
    """`x[b, index[b]]` for x `[B, T, ...]`, index `[B]` -> `[B, ...]`."""
    idx = index.reshape(index.shape + (1,) * (x.ndim - 1))
    return jnp.take_along_axis(x, idx, axis=1)[:, 0]
