"""Where specjax keeps what it downloads, compiles and measures."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """`$SPECJAX_CACHE`, or `~/.cache/specjax`."""
    return Path(os.environ.get("SPECJAX_CACHE") or Path.home() / ".cache" / "specjax").expanduser()
