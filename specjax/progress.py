"""Progress bars of long runs (generate, bench, tune, self-distillation, training): tqdm on
stderr, shown only when stderr is a terminal (`disable=None`), so logs and pipes stay clean."""
from __future__ import annotations

import sys
from collections.abc import Iterable

from tqdm import tqdm


def progress_bar(iterable: Iterable | None = None, *, enabled: bool = True, **options) -> tqdm:
    """A tqdm bar on stderr; `enabled=False` turns it off even on a terminal. `options` are
    tqdm's (total, desc, unit, initial, ...)."""
    return tqdm(iterable, file=sys.stderr, disable=None if enabled else True, **options)


def say(line: str) -> None:
    """Prints a line on stderr above any progress bar on the terminal (tqdm.write)."""
    tqdm.write(line, file=sys.stderr)
