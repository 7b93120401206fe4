"""Errors a user's input can cause; each message names the file, row or option."""
from __future__ import annotations


class InputError(ValueError):
    """A bad input file, row or option; the message names it."""
