"""The one non-finite check of every weight loader: a NaN or Inf in a checkpoint is refused at load.

    check_finite(array, path, "tensor 'blk.3.attn_q.weight'")
    -> CheckpointError("model.gguf: tensor 'blk.3.attn_q.weight' has 1 NaN value(s)")

Loaders call it once per tensor as they read it (so the message can name it); it costs one
`isfinite` reduction over the tensor, and counts only when something is wrong.
"""
from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np


def nonfinite_counts(array) -> tuple[int, int]:
    """(NaN count, infinite count) of a float array (numpy, jax or ml_dtypes); (0, 0) if finite."""
    values = np.asarray(array)
    if values.dtype.kind in "biu":  # bool / integer tensors (ids, masks) cannot hold NaN
        return 0, 0
    finite = np.isfinite(values)
    if finite.all():
        return 0, 0
    nans = int(np.isnan(values).sum())
    return nans, int(values.size - finite.sum()) - nans


class CheckpointError(ValueError):
    """A checkpoint cannot be loaded: the message names the file and what is wrong with it."""

    def __init__(self, path, problem: str):
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


def describe_nonfinite(nans: int, infs: int) -> str:
    """'1 NaN value(s)', '2 infinite value(s)' or '1 NaN and 2 infinite value(s)'."""
    parts = [f"{nans} NaN" if nans else "", f"{infs} infinite" if infs else ""]
    return " and ".join(p for p in parts if p) + " value(s)"


def check_finite(array, path: str | os.PathLike, what: str) -> None:
    """Raises CheckpointError "{path}: {what} has N NaN value(s)" when `array` is not all finite.

    what: names the tensor as the file does, e.g. "tensor 'blk.3.attn_q.weight'".
    """
    nans, infs = nonfinite_counts(array)
    if nans or infs:
        raise CheckpointError(path, f"{what} has {describe_nonfinite(nans, infs)}")


def check_tree_finite(tree, path: str | os.PathLike, prefix: str = "") -> None:
    """`check_finite` on every leaf of a nested dict of arrays, naming leaves 'params/fc/kernel'."""
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            check_tree_finite(value, path, f"{prefix}/{key}" if prefix else str(key))
        return
    check_finite(tree, path, f"tensor {prefix!r}")
