"""XLA_FLAGS for a process with N fake CPU devices (no jax import: set it before jax starts).

Collectives between fake devices are threads of one process; on a shared 2-core machine a
thread can wait minutes for a core, and XLA CPU's default rendezvous timeouts (40 s to
terminate a stuck all-reduce / all-gather) then kill a correct program. The timeouts here are
raised well past any test's own limit, so only a real deadlock fails, by the test's timeout.

A program can also stop for good: the sharding worker's dp=2,tp=4 decode hung for 15 minutes
(devices waiting in different all-gathers and all-reduces, most pool threads idle) each time
it was loaded from the persistent compile cache, and never when compiled afresh; specjax now
caches nothing in a multi-device CPU process (`specjax.compile_cache.multi_device_cpu`). A
worker that resumes (tests/sharding_worker.py) passes a shorter timeout, so that XLA aborts a
run stuck any other way and the next run picks up where it stopped.
"""
from __future__ import annotations

COLLECTIVE_TIMEOUT_S = 1800
#: the timeout of a worker that resumes: a stuck collective aborts its run in minutes
RESUMABLE_TIMEOUT_S = 300


def fake_devices_env(devices: int, timeout_s: int = COLLECTIVE_TIMEOUT_S) -> dict[str, str]:
    """The environment variables of a process with `devices` fake CPU devices (XLA_FLAGS)."""
    return {"XLA_FLAGS": xla_flags(devices, timeout_s)}


def xla_flags(devices: int, timeout_s: int = COLLECTIVE_TIMEOUT_S) -> str:
    """The XLA_FLAGS value for `devices` fake CPU devices whose collectives wait `timeout_s`
    before XLA aborts the process ("Termination timeout ... exceeded" on stderr)."""
    return (f"--xla_force_host_platform_device_count={devices} "
            f"--xla_cpu_collective_timeout_seconds={timeout_s} "
            f"--xla_cpu_collective_call_terminate_timeout_seconds={timeout_s}")
