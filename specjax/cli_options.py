"""Option types and output checks shared by every CLI subcommand, applied before any model loads.

The `type=` functions make argparse refuse a bad value with the option's name and exit 2
("argument --batch-size: must be an integer >= 1, got -1"); `check_output_path` refuses an
output the run could not write before the work starts. Later modules import these too.
"""
from __future__ import annotations

import argparse
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from specjax.tree import check_num_draft


class InputError(ValueError):
    """A bad input file, row or option; the message names it."""


def _parsed(text: str, kind: type):
    try:
        return kind(text)
    except ValueError:
        noun = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"expected {noun}, got {text!r}") from None


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= `low`."""
    def parse(text: str) -> int:
        value = _parsed(text, int)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {value}")
        return value

    parse.__name__ = f"int_at_least_{low}"
    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def finite_float(text: str) -> float:
    """An argparse type: a finite number (no nan, no inf)."""
    value = _parsed(text, float)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    value = finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def probability(text: str) -> float:
    """An argparse type: a number in (0, 1] (top-p)."""
    value = finite_float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def num_draft(text: str) -> int:
    """An argparse type: a draft length in [1, MAX_DRAFT_NODES] (`specjax.tree.check_num_draft`)."""
    try:
        return check_num_draft(_parsed(text, int), "a draft length")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def seed(text: str) -> int:
    """An argparse type: a PRNG seed, an integer in [0, 2**32)."""
    value = _parsed(text, int)
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 2**32), got {value}")
    return value


def non_empty_text(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def check_output_path(path: str | os.PathLike, option: str, folder: bool = False) -> None:
    """Raises InputError naming `option` and `path` when a run could not write its output there:
    the parent folder is missing, the path is a folder where a file is wanted (or the reverse),
    or the file / folder refuses writes. Creates nothing that outlives the check."""
    target = Path(path)
    if target.exists() and target.is_dir() != folder:
        raise InputError(f"{option} {path}: {'is a folder' if target.is_dir() else 'is not a folder'}")
    where = target if folder and target.is_dir() else target.parent
    if not where.is_dir():
        raise InputError(f"{option} {path}: folder {where} does not exist")
    try:
        if target.exists() and not folder:
            # O_NONBLOCK: a FIFO without a reader fails here instead of hanging
            os.close(os.open(target, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK))
        else:
            tempfile.TemporaryFile(dir=where).close()
    except OSError as e:
        raise InputError(f"{option} {path}: cannot write there ({e.strerror})") from None
