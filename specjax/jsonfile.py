"""JSON files specjax writes and reads back (drafter.json, meta.json): a reader whose errors name
the file and the problem, and an atomic text writer."""
from __future__ import annotations

import json
import os
from pathlib import Path


def read_json_object(path: str | Path) -> dict:
    """The JSON object in `path`; a missing, unreadable or malformed file -> one-line
    ValueError naming it."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot read ({getattr(e, 'strerror', None) or e})") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(value, dict):  # a bad file, not a bad argument: ValueError as above
        raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def write_text_atomic(path: str | Path, text: str) -> None:
    """Writes `path` through a temporary sibling and a rename: a kill never leaves it torn."""
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text, encoding="utf-8")
    os.replace(partial, path)
