"""The `specjax` command line: `specjax.cli.main` builds the parser from one module per
subcommand (generate, bench, profile, tune, train-drafter); `options` holds their shared
argument helpers."""
from __future__ import annotations

from specjax.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
