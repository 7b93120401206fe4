"""Prompt files in, generation rows out: the JSONL I/O that the CLI and the measurement tools share.

Reading: `read_prompts` takes `{"prompt"}` rows and Spec-Bench / MT-bench rows
(`{"question_id", "category", "turns"}`, first turn), splitting bytes on b"\n" so a bad byte
is named by file:line. Writing (`specjax generate --out`): durable appends of whole rows, and a
byte-safe scan and repair of the file for `--resume`.

Each batch's rows go out as one write of whole lines, then fsync; a write that fails (a full
disk, ...) is cut back to its last whole line, so the file never ends in a torn row. A file
that does anyway (a crash mid-write, a copy cut short) is repaired before resuming: the scan
splits bytes on b"\n" before decoding anything, so a tail cut inside a multi-byte character is
dropped like any torn tail; complete lines that are not rows are reported by number. The
repair rewrites the file atomically (temp file + os.replace) with the good rows only, and
saves the dropped bytes to OUT.dropped; their rows are generated again.
"""
from __future__ import annotations

import codecs
import contextlib
import dataclasses
import errno
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from specjax.errors import InputError

#: the fields every row that generate writes has (a line without them is not a finished row)
ROW_FIELDS = frozenset({"id", "prompt", "completion", "token_ids", "num_new_tokens", "stop_reason"})


@dataclasses.dataclass(frozen=True)
class OutputScan:
    """An output file read for --resume.

    rows: the finished rows' lines (bytes, newline included), in file order.
    ids: their ids. corrupt: (1-based line number, line bytes) of complete lines that are not rows.
    torn: the bytes after the last newline (a partial row), b"" when none.
    """

    rows: tuple[bytes, ...] = ()
    ids: frozenset = frozenset()
    corrupt: tuple[tuple[int, bytes], ...] = ()
    torn: bytes = b""

    @property
    def damaged(self) -> bool:
        return bool(self.corrupt or self.torn)

    @property
    def dropped(self) -> bytes:
        """What a repair drops: the corrupt lines and the torn tail, as they were in the file."""
        return b"".join(line + b"\n" for _, line in self.corrupt) + self.torn


def row_of_line(line: bytes) -> dict | None:
    """The row a complete output line holds, or None: not UTF-8, not JSON, not an object with
    ROW_FIELDS, or an id that is not a string or a number."""
    try:
        row = json.loads(line.decode("utf-8"))
    except ValueError:  # UnicodeDecodeError and JSONDecodeError are both ValueErrors
        return None
    if not isinstance(row, dict) or not ROW_FIELDS <= row.keys():
        return None
    return row if isinstance(row["id"], (str, int, float)) else None


def scan_output(path: str | os.PathLike) -> OutputScan:
    """The rows, corrupt lines and torn tail of output file `path` (empty when it is missing)."""
    path = Path(path)
    if not path.exists():
        return OutputScan()
    if not path.is_file():
        raise InputError(f"--resume needs --out to be a regular file: {path}")
    data = path.read_bytes()
    body, torn = data[: data.rfind(b"\n") + 1], data[data.rfind(b"\n") + 1:]
    rows, ids, corrupt = [], set(), []
    for number, line in enumerate(body.split(b"\n")[:-1], 1):
        row = row_of_line(line)
        if row is None:
            corrupt.append((number, line))
        else:
            rows.append(line + b"\n")
            ids.add(row["id"])
    return OutputScan(tuple(rows), frozenset(ids), tuple(corrupt), torn)


def current_umask() -> int:
    """The process's umask (read by setting it and putting it back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def rewrite_atomically(path: str | os.PathLike, data: bytes) -> None:
    """Replaces the file `path` by `data` at once: a temp file beside it (same mode), fsynced,
    then os.replace; a crash leaves the old file or the new one, never a mix. A new file gets
    the default mode."""
    path = Path(path).resolve()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if path.exists():
            shutil.copymode(path, tmp)
        else:
            os.chmod(tmp, 0o666 & ~current_umask())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def repair_output(path: str | os.PathLike, scan: OutputScan) -> Path:
    """Rewrites `path` with `scan`'s rows only; the dropped bytes are appended to PATH.dropped
    (returned) first, so nothing of the file is lost."""
    saved = Path(f"{path}.dropped")
    with open(saved, "ab") as f:
        f.write(scan.dropped)
    rewrite_atomically(path, b"".join(scan.rows))
    return saved


def damage_report(path: str | os.PathLike, scan: OutputScan) -> str:
    """One line saying what the repair of `path` drops."""
    parts = []
    if scan.corrupt:
        numbers = ", ".join(str(n) for n, _ in scan.corrupt[:20]) + (" ..." if len(scan.corrupt) > 20 else "")
        parts.append(f"{len(scan.corrupt)} corrupt line(s) (line {numbers})")
    if scan.torn:
        parts.append(f"a torn last line ({len(scan.torn)} bytes)")
    return f"resume: {path}: dropping {' and '.join(parts)}; their rows are generated again"


def trim_torn_tail(path: str | os.PathLike) -> None:
    """Cuts a partial last line of `path` (bytes after the last newline) so appended rows start
    on a line of their own; works on bytes, so a cut inside a character is no problem."""
    path = Path(path)
    if not path.is_file():
        return
    with open(path, "r+b") as f:
        data = f.read()
        if data and not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)


def row_line(row: dict) -> bytes:
    """One output row as a UTF-8 JSON line; text that UTF-8 cannot hold (lone surrogates) is
    written as JSON escapes instead."""
    try:
        return (json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8")
    except UnicodeEncodeError:
        return (json.dumps(row) + "\n").encode("ascii")


def open_output(path: str | os.PathLike) -> int:
    """A file descriptor appending to `path` (created when missing)."""
    try:
        return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    except OSError as e:
        raise InputError(f"cannot open {path} for writing: {e.strerror}") from None


def fsync_if_supported(fd: int) -> None:
    """os.fsync, except on a pipe or character device (--out /dev/stdout), which cannot sync."""
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise


def append_rows(fd: int, rows: Sequence[dict], path: str | os.PathLike) -> None:
    """Appends `rows` to the open output `fd` as one write of whole lines, then fsyncs. When
    that fails the file is cut back to its last whole line and an InputError names `path`."""
    data = b"".join(row_line(r) for r in rows)
    start = os.lseek(fd, 0, os.SEEK_END)
    written = 0
    try:
        while written < len(data):
            written += os.write(fd, data[written:])
        fsync_if_supported(fd)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, start + data[:written].rfind(b"\n") + 1)
        raise InputError(f"cannot write {path}: {e.strerror}; the rows already in it are kept "
                         f"and --resume generates the rest") from None


def prompt_row(record, where: str) -> dict:
    """Normalises one JSONL record to {"id", "category", "prompt"}.

    Accepts {"prompt": ...} (optional "id", "category") and Spec-Bench / MT-bench rows
    {"question_id", "category", "turns": [...]} (first turn); either may give its own
    "max_new_tokens" (an int >= 1; kept in the row only when given).
    """
    if not isinstance(record, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "prompt" in record:
        prompt = record["prompt"]
    elif "turns" in record:
        turns = record["turns"]
        if not isinstance(turns, list) or not turns:
            raise InputError(f"{where}: 'turns' must be a non-empty list")
        prompt = turns[0]
    else:
        raise InputError(f"{where}: needs a 'prompt' or a 'turns' field")
    if not isinstance(prompt, str) or not prompt.strip():
        raise InputError(f"{where}: the prompt is empty")
    row_id = record.get("id", record.get("question_id", record.get("task_id")))
    if row_id is not None and (isinstance(row_id, bool) or not isinstance(row_id, (str, int))):
        raise InputError(f"{where}: the id must be a string or an integer, got {row_id!r}")
    row = {"id": row_id, "category": record.get("category"), "prompt": prompt}
    if "max_new_tokens" in record:
        max_new = record["max_new_tokens"]
        if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1:
            raise InputError(f"{where}: max_new_tokens must be an integer >= 1, got {max_new!r}")
        row["max_new_tokens"] = max_new
    return row

def read_prompts(path: str | os.PathLike, on_bad: Callable[[str], None] | None = None) -> list[dict]:
    """Rows of a JSONL prompt file; ids default to the 0-based line number. A bad row (not
    UTF-8, not JSON, no prompt, a bad field) is an InputError naming its line, or, given
    on_bad, skipped after on_bad(that message)."""
    rows = []
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise InputError(f"cannot read prompts file {path}: {e.strerror}") from None
    for number, raw in enumerate(data.removeprefix(codecs.BOM_UTF8).split(b"\n"), 1):
        where = f"{path}:{number}"
        try:
            row = line_row(raw, where)
        except InputError as e:
            if on_bad is None:
                raise
            on_bad(str(e))
            continue
        if row is None:
            continue
        row["id"] = number - 1 if row["id"] is None else row["id"]
        row["where"] = where
        rows.append(row)
    if not rows:
        raise InputError(f"{path}: no prompts")
    return rows

def line_row(raw: bytes, where: str) -> dict | None:
    """The prompt row of one line of a prompt file (None: a blank line)."""
    line = decoded_line(raw, where)
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise InputError(f"{where}: not valid JSON ({e.msg})") from None
    return prompt_row(record, where)

def decoded_line(raw: bytes, where: str) -> str:
    """One line of a text file as str; an InputError names `where` when it is not UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{where}: not UTF-8 text (byte {e.start + 1} of the line)") from None

def check_unique_ids(rows: Sequence[dict]) -> None:
    """--resume tells rows apart by id: an InputError names the first id that two rows share."""
    first_seen: dict = {}
    for row in rows:
        if row["id"] in first_seen:
            raise InputError(f"{row['where']}: id {row['id']!r} is also the id of "
                             f"{first_seen[row['id']]}; --resume needs unique ids")
        first_seen[row["id"]] = row["where"]

def output_row(row: dict, gen) -> dict:
    out = {
        "id": row["id"],
        "category": row.get("category"),
        "prompt": row["prompt"],
        "completion": gen.completion,
        "token_ids": gen.token_ids,
        "num_new_tokens": gen.num_new_tokens,
        "stop_reason": gen.stop_reason,
        "time_s": round(gen.time_s, 4),
    }
    if gen.times is not None:  # the batch's: time_s = prefill_s + decode_s, compile_s apart
        out.update(compile_s=round(gen.times.compile_s, 4), prefill_s=round(gen.times.prefill_s, 4),
                   decode_s=round(gen.times.decode_s, 4))
    if gen.spec is not None:
        out["spec"] = gen.spec
    return out
