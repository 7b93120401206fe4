"""XLA_FLAGS for a process with N fake CPU devices (no jax import: set it before jax starts).

Collectives between fake devices are threads of one process; on a shared 2-core machine a
thread can wait minutes for a core, and XLA CPU's default rendezvous timeouts (40 s to
terminate a stuck all-reduce / all-gather) then kill a correct program. The timeouts here are
raised well past any test's own limit, so only a real deadlock fails, by the test's timeout.

The fake devices also share one thread pool, of max(cores, devices) threads (XLA's CPU client;
"at least CpuDeviceCount threads to launch one collective"): 8 threads for 8 devices on this
2-core machine. A device's program runs independent thunks on several of them at once, and a
thread in a collective blocks until every device arrives, so once the blocked threads fill the
pool a device that has not arrived gets no thread: the sharding worker's dp=2,tp=4 decode was
seen stuck for 15 minutes that way (2026-12-02, gdb: all 8 pool threads in all-reduce or
all-gather thunks, a case that runs in 4 s). PJRT_NPROC sets the pool's size:
THREADS_PER_DEVICE threads a device leave room for the collectives in flight. A worker that
resumes (tests/sharding_worker.py) also passes a shorter timeout, so that XLA aborts a run
stuck any other way and the next run picks up where it stopped.
"""
from __future__ import annotations

COLLECTIVE_TIMEOUT_S = 1800
#: the timeout of a worker that resumes: a stuck collective aborts its run in minutes
RESUMABLE_TIMEOUT_S = 300


#: the CPU client's thread pool per fake device (PJRT_NPROC = this x devices)
THREADS_PER_DEVICE = 4


def fake_devices_env(devices: int, timeout_s: int = COLLECTIVE_TIMEOUT_S) -> dict[str, str]:
    """The environment variables of a process with `devices` fake CPU devices: XLA_FLAGS
    (`xla_flags`) and PJRT_NPROC, the size of the CPU client's thread pool."""
    return {"XLA_FLAGS": xla_flags(devices, timeout_s),
            "PJRT_NPROC": str(THREADS_PER_DEVICE * devices)}


def xla_flags(devices: int, timeout_s: int = COLLECTIVE_TIMEOUT_S) -> str:
    """The XLA_FLAGS value for `devices` fake CPU devices whose collectives wait `timeout_s`
    before XLA aborts the process ("Termination timeout ... exceeded" on stderr)."""
    return (f"--xla_force_host_platform_device_count={devices} "
            f"--xla_cpu_collective_timeout_seconds={timeout_s} "
            f"--xla_cpu_collective_call_terminate_timeout_seconds={timeout_s}")
