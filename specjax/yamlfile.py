"""A user's YAML file (`--tree`, `--tuned`, ...): one reader whose errors name the file and the
problem, so no caller shows a YAML traceback."""
from __future__ import annotations

import os
from pathlib import Path

import yaml


def _yaml_problem(error: yaml.YAMLError) -> str:
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or " ".join(str(error).split())
    return problem if mark is None else f"{problem} at line {mark.line + 1}, column {mark.column + 1}"


def read_yaml_mapping(path: str | os.PathLike, what: str) -> dict:
    """The top-level mapping of the YAML file `path`. A ValueError names `what` (e.g. "tree file"),
    the path and the problem: unreadable, not UTF-8, malformed, empty, or not a mapping."""
    label = f"{what} {path}"
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except OSError as e:
        raise ValueError(f"cannot read {label}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{label}: not UTF-8 text (byte {e.start + 1})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"{label}: malformed YAML ({_yaml_problem(e)})") from None
    if data is None:
        raise ValueError(f"{label}: the file is empty")
    if not isinstance(data, dict):
        raise ValueError(f"{label}: expected a mapping of fields, got {type(data).__name__}")
    return data


def field_problem(error: Exception) -> str:
    """What a KeyError / TypeError / ValueError raised while reading a mapping's fields says."""
    return f"missing field {error}" if isinstance(error, KeyError) else " ".join(str(error).split())
