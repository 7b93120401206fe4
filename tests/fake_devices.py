"""XLA_FLAGS for a process with N fake CPU devices (no jax import: set it before jax starts).

Collectives between fake devices are threads of one process; on a shared 2-core machine a
thread can wait minutes for a core, and XLA CPU's default rendezvous timeouts (40 s to
terminate a stuck all-reduce / all-gather) then kill a correct program. The timeouts here are
raised well past any test's own limit, so only a real deadlock fails, by the test's timeout.
"""
from __future__ import annotations

COLLECTIVE_TIMEOUT_S = 1800


def xla_flags(devices: int) -> str:
    """The XLA_FLAGS value for `devices` fake CPU devices with patient collectives."""
    return (f"--xla_force_host_platform_device_count={devices} "
            f"--xla_cpu_collective_timeout_seconds={COLLECTIVE_TIMEOUT_S} "
            f"--xla_cpu_collective_call_terminate_timeout_seconds={COLLECTIVE_TIMEOUT_S}")
