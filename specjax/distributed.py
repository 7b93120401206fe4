"""Several processes, one job: `jax.distributed` set up with clear errors, and a job's rows split
across processes, each writing its own part of the output.

    spec = process_spec(coordinator="host0:1234", num_processes=2, process_id=1)
    initialize(spec)                       # before anything touches a device
    mine = process_share(rows, spec)       # rows[process_id::num_processes]
    part = part_path("out.jsonl", spec)    # out.process-1-of-2.jsonl
    merge_parts("out.jsonl", 2, order)     # one file, every id exactly once, in `order`

Where the values come from, first match wins: the arguments (`--coordinator HOST:PORT
--num-processes N --process-id I`), then the environment (`JAX_COORDINATOR_ADDRESS`,
`JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`); with none of them the run is one process. A cluster
JAX detects by itself (SLURM, Open MPI, TPU pod slices, Kubernetes) needs only
`--coordinator auto`.

Why each process writes its own part: `--resume` then needs nothing from the other
processes (each one skips the ids already in its part), and a killed process loses only its
last batch. `merge_parts` (`specjax merge`) makes the one output file afterwards.
"""
from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

from specjax.errors import InputError
from specjax.prompt_io import rewrite_atomically

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
AUTO = "auto"  # coordinator from JAX's cluster detection


@dataclasses.dataclass(frozen=True)
class ProcessSpec:
    """Where this process stands in a job of several: `coordinator` "HOST:PORT" (process 0
    serves it; "auto" = JAX's cluster detection), `num_processes`, this `process_id`; and how
    long to wait for the coordinator and the other processes (`timeout_s`)."""

    coordinator: str | None = None
    num_processes: int = 1
    process_id: int = 0
    timeout_s: int = 120

    @property
    def is_multi(self) -> bool:
        return self.coordinator is not None

    @property
    def label(self) -> str:
        return f"process {self.process_id} of {self.num_processes}"


def _env_int(name: str) -> int | None:
    text = os.environ.get(name)
    if text is None or not text.strip():
        return None
    try:
        return int(text)
    except ValueError:
        raise InputError(f"${name}: expected an integer, got {text!r}") from None


def _host_port(coordinator: str) -> tuple[str, int]:
    host, sep, port = coordinator.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InputError(f"--coordinator {coordinator!r}: expected HOST:PORT (e.g. "
                         "10.0.0.1:1234) or 'auto'")
    return host, int(port)


def process_spec(coordinator: str | None = None, num_processes: int | None = None,
                 process_id: int | None = None, timeout_s: int = 120) -> ProcessSpec:
    """The checked ProcessSpec of the arguments, else the environment; one process when
    neither names a coordinator. Raises InputError naming the bad value."""
    coordinator = coordinator or os.environ.get(ENV_COORDINATOR) or None
    num_processes = num_processes if num_processes is not None else _env_int(ENV_NUM_PROCESSES)
    process_id = process_id if process_id is not None else _env_int(ENV_PROCESS_ID)
    if timeout_s < 1:
        raise InputError(f"--coordinator-timeout must be >= 1 second, got {timeout_s}")
    if coordinator is None:
        if (num_processes or 1) > 1 or process_id:
            raise InputError("--num-processes / --process-id need --coordinator HOST:PORT "
                             f"(or ${ENV_COORDINATOR})")
        return ProcessSpec(timeout_s=timeout_s)
    if coordinator == AUTO:
        return ProcessSpec(AUTO, num_processes or 0, process_id or 0, timeout_s)
    _host_port(coordinator)
    if num_processes is None or process_id is None:
        raise InputError(f"--coordinator {coordinator} needs --num-processes and --process-id "
                         f"(or ${ENV_NUM_PROCESSES} and ${ENV_PROCESS_ID})")
    if num_processes < 1:
        raise InputError(f"--num-processes must be >= 1, got {num_processes}")
    if not 0 <= process_id < num_processes:
        raise InputError(f"--process-id must be in [0, {num_processes}), got {process_id}")
    return ProcessSpec(coordinator, num_processes, process_id, timeout_s)


def wait_for_coordinator(coordinator: str, timeout_s: float) -> None:
    """Returns once HOST:PORT accepts a TCP connection; InputError after timeout_s.

    JAX's own client aborts the whole process (a C++ fatal error, no Python exception) when
    the coordinator stays unreachable, so processes other than 0 check first."""
    host, port = _host_port(coordinator)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=2):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise InputError(
                    f"--coordinator {coordinator}: not reachable within {timeout_s:g} s ({e}); "
                    "start process 0 first, on that host, and check the address and port"
                ) from None
            time.sleep(0.5)


def check_port_free(coordinator: str) -> None:
    """Process 0 serves the coordinator on PORT: InputError when the port is taken."""
    _host, port = _host_port(coordinator)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError as e:
            raise InputError(f"--coordinator {coordinator}: process 0 cannot serve port {port} "
                             f"({e.strerror}); pick a free port") from None


def initialize(spec: ProcessSpec) -> None:
    """`jax.distributed.initialize` for a multi-process spec (nothing for one process); CPU
    devices get gloo collectives. Call before anything touches a device.

    Each process's backend exchanges its devices with the others when it is made; a process
    with nothing to do (e.g. its part already complete on --resume) would never make it and
    leave the others waiting, so every process makes it here."""
    if not spec.is_multi:
        return
    if jax.config.jax_platforms in (None, "", "cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if spec.coordinator == AUTO:
        jax.distributed.initialize(initialization_timeout=spec.timeout_s)
        jax.devices()
        return
    if spec.process_id == 0:
        check_port_free(spec.coordinator)
    else:
        wait_for_coordinator(spec.coordinator, spec.timeout_s)
    jax.distributed.initialize(spec.coordinator, spec.num_processes, spec.process_id,
                               initialization_timeout=spec.timeout_s)
    jax.devices()  # every process makes its backend now, together (see below)


def processes_any(flags: np.ndarray) -> np.ndarray:
    """Element-wise OR of a bool array `[N]` over the job's processes (each passes its own)."""
    if jax.process_count() == 1:
        return flags
    return np.asarray(multihost_utils.process_allgather(flags.astype(np.int32))).any(axis=0)


# ---------------------------------------------------------------------------------------------
# The job split and its output parts
# ---------------------------------------------------------------------------------------------


def process_share(rows: Sequence, spec: ProcessSpec) -> list:
    """This process's rows: every num_processes-th from process_id (rows of every length
    spread evenly, so the processes finish together)."""
    return list(rows[spec.process_id :: spec.num_processes])


def part_path(out: str | os.PathLike, spec: ProcessSpec) -> Path:
    """The output part of this process: `out.jsonl` -> `out.process-I-of-N.jsonl` (`out` itself
    for one process)."""
    out = Path(out)
    if not spec.is_multi:
        return out
    return out.with_name(f"{out.stem}.process-{spec.process_id}-of-{spec.num_processes}{out.suffix}")


def merge_parts(out: str | os.PathLike, num_processes: int, order: Sequence | None = None) -> int:
    """Writes `out` from its processes' parts (`part_path`): each row once, ordered as the ids
    in `order` (the prompt file's ids; default: part by part). Returns the rows written.
    Raises InputError on a missing part, a row id in two parts, or (with `order`) an id missing
    from every part or not in `order`; `out` is written only when every check passes."""
    rows: dict = {}
    for pid in range(num_processes):
        part = part_path(out, ProcessSpec("merge", num_processes, pid))
        if not part.is_file():
            raise InputError(f"{part}: missing (process {pid} of {num_processes} wrote no part)")
        for number, line in enumerate(part.read_bytes().splitlines(), 1):
            try:
                row = json.loads(line)
            except (UnicodeDecodeError, json.JSONDecodeError):
                raise InputError(f"{part}:{number}: not a JSON row; run that process again with "
                                 "--resume to repair its part") from None
            if row["id"] in rows:
                raise InputError(f"{part}:{number}: id {row['id']!r} is also in another part")
            rows[row["id"]] = line
    if order is not None:
        missing = [i for i in order if i not in rows]
        extra = set(rows) - set(order)
        if missing:
            raise InputError(f"{out}: {len(missing)} id(s) in no part, e.g. {missing[:5]}; run "
                             "the processes again with --resume")
        if extra:
            raise InputError(f"{out}: the parts hold ids not in the prompts, e.g. "
                             f"{sorted(extra, key=str)[:5]}")
        lines = [rows[i] for i in order]
    else:
        lines = list(rows.values())
    rewrite_atomically(out, b"".join(line + b"\n" for line in lines))
    return len(lines)
