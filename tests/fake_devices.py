"""XLA_FLAGS for a process with N fake CPU devices (no jax import: set it before jax starts).

Collectives between fake devices are threads of one process; on a shared 2-core machine a
thread can wait minutes for a core, and XLA CPU's default rendezvous timeouts (40 s to
terminate a stuck all-reduce / all-gather) then kill a correct program. The timeouts here are
raised well past any test's own limit, so only a real deadlock fails, by the test's timeout.

A run can still stop for good: XLA CPU's fake devices, on a loaded 2-core machine, were seen
(2026-12-01, the sharding worker's dp=2,tp=4 decode) with some devices waiting in an all-gather
and others in an all-reduce of the same program, for 15 minutes, a case that runs in 4 s on an
idle machine. A worker that resumes (tests/sharding_worker.py) passes a shorter timeout, so
XLA aborts such a run and the next one picks up where it stopped.
"""
from __future__ import annotations

COLLECTIVE_TIMEOUT_S = 1800
#: the timeout of a worker that resumes: a stuck collective aborts its run in minutes
RESUMABLE_TIMEOUT_S = 300


def xla_flags(devices: int, timeout_s: int = COLLECTIVE_TIMEOUT_S) -> str:
    """The XLA_FLAGS value for `devices` fake CPU devices whose collectives wait `timeout_s`
    before XLA aborts the process ("Termination timeout ... exceeded" on stderr)."""
    return (f"--xla_force_host_platform_device_count={devices} "
            f"--xla_cpu_collective_timeout_seconds={timeout_s} "
            f"--xla_cpu_collective_call_terminate_timeout_seconds={timeout_s}")
