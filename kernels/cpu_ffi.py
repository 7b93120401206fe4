"""Building and registering the C++ kernels of the XLA CPU backend (XLA FFI).

    reason = available(SOURCE, {"target_name": "HandlerSymbol"}, folder)   # None: registered

A kernel's source (`kernels/*.cc`) is compiled on first use with the machine's C++ compiler
(`-O3 -march=native`, the XLA FFI headers jaxlib ships) into `folder` (`$SPECJAX_CACHE/kernels`),
keyed by a hash of the source, the flags, the compiler and the CPU, and its handlers are
registered with XLA once per process. `SPECJAX_CPU_KERNELS=0` switches every kernel off;
without a compiler, or when the build fails, the callers keep XLA's path (`available` says why).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax

#: the environment variable that switches the kernels off ("0", "false", "no", "off")
ENV_SWITCH = "SPECJAX_CPU_KERNELS"
FLAGS = ("-O3", "-std=c++17", "-fPIC", "-shared", "-march=native", "-fno-math-errno")

_lock = threading.Lock()
#: per source file: None when registered, else the reason it is not
_state: dict[str, str | None] = {}
#: the kernel libraries loaded in this process (`use_crew` switches each one)
_libraries: list = []


def switched_off(environ=os.environ) -> bool:
    return environ.get(ENV_SWITCH, "").strip().lower() in ("0", "false", "no", "off")


def one_cpu_reason() -> str | None:
    """None when a kernel here may run in place of XLA's path: not switched off, the cpu
    backend, one device (the kernels have no partitioning rule: a mesh keeps XLA's path); else
    why not. Read at each call (each trace)."""
    if switched_off():
        return f"{ENV_SWITCH}=0"
    if jax.default_backend() != "cpu":
        return f"the backend is {jax.default_backend()}, not cpu"
    if jax.device_count() != 1:
        return f"{jax.device_count()} devices (the kernel runs on one)"
    return None


def compiler() -> str | None:
    """The C++ compiler: `$CXX`, else the first of c++ / g++ / clang++ on the PATH."""
    named = os.environ.get("CXX")
    if named:
        return shutil.which(named)
    return next((p for p in map(shutil.which, ("c++", "g++", "clang++")) if p), None)


def _cpu_identity() -> str:
    """What -march=native compiles for: the CPU's model and feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(dict.fromkeys(keep))


def with_headers(source: Path) -> list[Path]:
    """`source` and the headers beside it (what it may include: `cpu_crew.h`)."""
    source = Path(source)
    return [source, *sorted(source.parent.glob("*.h"))]


def source_digest(sources) -> str:
    """A short hash of the kernels' source files and their headers (what a cached measurement
    of them depends on)."""
    digest = hashlib.sha256()
    for path in dict.fromkeys(p for source in sources for p in with_headers(source)):
        digest.update(path.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def library_name(source: Path, cxx: str) -> str:
    """The cached library's file name: a hash of source, flags, compiler, CPU and headers."""
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout
    digest = hashlib.sha256()
    for part in (*(path.read_bytes() for path in with_headers(source)), " ".join(FLAGS).encode(), version.encode(),
                 _cpu_identity().encode(), jax.ffi.include_dir().encode()):
        digest.update(part)
        digest.update(b"\0")
    return f"{source.stem}-{digest.hexdigest()[:16]}.so"


def build(source: Path, folder: Path) -> Path:
    """The compiled library of `source` in `folder` (compiled now if not there yet; written
    atomically, so processes building at once each end with a whole file). RuntimeError naming
    the reason."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set $CXX, or install g++)")
    target = folder / library_name(source, cxx)
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(prefix=target.name, suffix=".tmp", dir=folder)
    os.close(fd)
    cmd = [cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", str(source), "-o", temp]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        Path(temp).unlink(missing_ok=True)
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"compiling {source.name} failed: {last}")
    os.replace(temp, target)
    return target


def use_crew(on: bool = True) -> None:
    """Whether the loaded kernels share a call's work with their own crew of helper threads
    (True, the default; `cpu_crew.h` says why) or with tasks on XLA's intra-op pool (False, as
    before the crew). Results are bit-identical either way; for A/B measurements
    (`benchmarks/cpu_kernel_threads.py`)."""
    for library in _libraries:
        library.specjax_crew_enable(ctypes.c_int32(1 if on else 0))


def available(source: Path, handlers: dict[str, str], folder: Path) -> str | None:
    """None when `source`'s handlers (FFI target name -> exported symbol) are registered with
    XLA (built into `folder` if needed, once per process), else the reason they are not
    (switched off, no compiler, a failed build)."""
    with _lock:
        if source.name not in _state:
            _state[source.name] = _register(source, handlers, folder)
        return _state[source.name]


def _register(source: Path, handlers: dict[str, str], folder: Path) -> str | None:
    if switched_off():
        return f"{ENV_SWITCH}=0"
    try:
        # RTLD_GLOBAL: the kernel libraries share one crew of helper threads (cpu_crew.h)
        library = ctypes.CDLL(str(build(source, folder)), mode=ctypes.RTLD_GLOBAL)
        _libraries.append(library)
        for target, symbol in handlers.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)),
                                        platform="cpu")
    except (OSError, RuntimeError, AttributeError) as err:
        return str(err)
    return None
