"""The persistent compilation cache, on by default: compiled programs are kept on disk, so a
later process loads them (a fraction of a second) instead of compiling them again (seconds).

`use_compile_cache()` sets JAX up once per process, on the first use of the CLI or of
`specjax.generate` / `generate_ids` (importing specjax changes nothing):

- the folder is `specjax.models.paths.cache_dir() / "compile"` (`$SPECJAX_CACHE/compile`);
- `SPECJAX_COMPILE_CACHE=0` (or `--no-compile-cache`, or `use_compile_cache(False)` before the
  first use) leaves it off;
- a cache the user set up for JAX (`JAX_COMPILATION_CACHE_DIR`, `jax_compilation_cache_dir`) is
  used as it is, with the user's settings; a minimum compile time the user set is kept
  (specjax's default is 0 s: every program is cached, the small ones cost a few KB);
- entries are capped at MAX_BYTES in all (`jax_compilation_cache_max_size` when the user set
  it): the least recently used go first;
- each entry is written atomically (a temporary file, then a rename) and carries a SHA-256 of
  its key and bytes: a corrupt, truncated or foreign entry (another program's bytes under this
  key) is removed with a warning and the program compiled again, never loaded;
- a process whose backend is the CPU with more than one device (fake devices,
  `--xla_force_host_platform_device_count`, or CPU processes joined by `jax.distributed`)
  reads and writes no entries, with a one-time warning: XLA CPU programs with collectives
  loaded from the cache deadlock (jaxlib 0.10.2: the sharding tests' dp=2,tp=4 decode program
  hung 3 of 3 times loaded from the cache, devices waiting in different collectives, and ran
  every time compiled afresh).
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import threading
import warnings
from pathlib import Path

import jax

from specjax.models.paths import cache_dir

try:  # JAX has no public hook for its cache object; without one, JAX's own file cache is used
    from jax._src import compilation_cache as jax_cache
    from jax._src.compilation_cache_interface import CacheInterface
except ImportError:  # pragma: no cover - a JAX without these modules
    jax_cache, CacheInterface = None, object

#: the environment variable that turns the cache off ("0", "false", "no", "off")
ENV_SWITCH = "SPECJAX_COMPILE_CACHE"
OFF_VALUES = frozenset({"0", "false", "no", "off"})
#: the size cap of the folder's entries, in bytes
MAX_BYTES = 1 << 30
#: JAX's default minimum compile time of a cached program (specjax caches every program)
JAX_MIN_COMPILE_S = 1.0
MAGIC = b"specjax-xla-1\n"
SUFFIX = ".xla"


def cache_folder() -> Path:
    """Where specjax keeps compiled programs: `cache_dir() / "compile"`."""
    return cache_dir() / "compile"


def switched_off(environ=os.environ) -> bool:
    """The environment turns the cache off (SPECJAX_COMPILE_CACHE=0 / false / no / off)."""
    return environ.get(ENV_SWITCH, "").strip().lower() in OFF_VALUES


def entry_digest(key: str, payload: bytes) -> bytes:
    """The 32-byte SHA-256 that binds an entry's bytes to its key."""
    return hashlib.sha256(key.encode() + b"\0" + payload).digest()


def pack_entry(key: str, payload: bytes) -> bytes:
    """An entry file's bytes: MAGIC, the digest of (key, payload), the payload."""
    return MAGIC + entry_digest(key, payload) + payload


def unpack_entry(key: str, data: bytes) -> bytes | None:
    """The payload of an entry file written for `key`; None when it is corrupt, truncated, of
    another format or written for another key."""
    head = len(MAGIC) + 32
    if len(data) < head or not data.startswith(MAGIC):
        return None
    payload = data[head:]
    return payload if data[len(MAGIC):head] == entry_digest(key, payload) else None


def trim(folder: Path, max_bytes: int) -> None:
    """Removes the least recently used entries of `folder` until they hold <= max_bytes."""
    entries = []
    for path in folder.glob(f"*{SUFFIX}"):
        try:
            stat = path.stat()
        except FileNotFoundError:  # removed by another process meanwhile
            continue
        entries.append((stat.st_mtime, stat.st_size, path))
    total = sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries):
        if total <= max_bytes:
            break
        path.unlink(missing_ok=True)
        total -= size


def multi_device_cpu() -> bool:
    """This process computes on the CPU backend with more than one device (see the module
    docstring: its programs are not cached)."""
    return jax.default_backend() == "cpu" and jax.device_count() > 1


_warned_multi_device = False


def skips_multi_device_cpu() -> bool:
    """multi_device_cpu(), warning once per process when it is."""
    global _warned_multi_device
    if not multi_device_cpu():
        return False
    if not _warned_multi_device:
        _warned_multi_device = True
        warnings.warn(f"specjax: compile cache skipped: {jax.device_count()} CPU devices (XLA CPU "
                      "programs with collectives loaded from a cache deadlock)", RuntimeWarning,
                      stacklevel=1)
    return True


class CheckedFileCache(CacheInterface):
    """JAX's persistent cache as files `<key>.xla` in one folder, each checked on read (see the
    module docstring); used (read) entries are touched, so trimming drops the least recent."""

    def __init__(self, folder: Path, max_bytes: int = MAX_BYTES):
        self._path = Path(folder)
        self.max_bytes = max_bytes

    def entry_path(self, key: str) -> Path:
        return self._path / f"{key}{SUFFIX}"

    def get(self, key: str) -> bytes | None:
        if skips_multi_device_cpu():
            return None
        path = self.entry_path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            warnings.warn(f"specjax: cannot read compile cache entry {path} ({e.strerror}): "
                          "compiling again", RuntimeWarning, stacklevel=1)
            return None
        payload = unpack_entry(key, data)
        if payload is None:
            warnings.warn(f"specjax: compile cache entry {path} is corrupt or not this "
                          "program's: removed, compiling again", RuntimeWarning, stacklevel=1)
            path.unlink(missing_ok=True)
            return None
        try:
            os.utime(path)
        except OSError:
            pass
        return payload

    def put(self, key: str, value: bytes) -> None:
        if skips_multi_device_cpu():
            return
        data = pack_entry(key, value)
        if len(data) > self.max_bytes:
            return
        path = self.entry_path(key)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            temporary.write_bytes(data)
            os.replace(temporary, path)
            trim(self._path, self.max_bytes)
        except OSError as e:
            temporary.unlink(missing_ok=True)
            warnings.warn(f"specjax: cannot write compile cache entry {path} ({e.strerror}): "
                          "not cached", RuntimeWarning, stacklevel=1)


def user_cache_folder() -> Path | None:
    """The cache folder the user gave JAX (JAX_COMPILATION_CACHE_DIR / jax.config), if any."""
    folder = jax.config.jax_compilation_cache_dir
    return Path(folder) if folder else None


def size_cap() -> int:
    """MAX_BYTES, or `jax_compilation_cache_max_size` when the user set it (-1: no cap)."""
    user_cap = jax.config.values.get("jax_compilation_cache_max_size", -1)
    if user_cap == -1:
        return MAX_BYTES
    return user_cap if user_cap > 0 else 0


def can_install() -> bool:
    """This JAX has the (private) cache object specjax replaces, and none is set up yet."""
    return (jax_cache is not None and hasattr(jax_cache, "_get_cache")
            and getattr(jax_cache, "_cache", False) is None)


def has_filelock() -> bool:
    """JAX's own cache can cap its size (it needs the filelock package for that)."""
    return importlib.util.find_spec("filelock") is not None


def configure(enabled: bool) -> Path | None:
    """Sets JAX's persistent cache up (see the module docstring); the folder in use, or None."""
    if user_cache_folder() is not None:
        return user_cache_folder()
    if not enabled or switched_off() or not jax.config.jax_enable_compilation_cache:
        return None
    folder = cache_folder()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        warnings.warn(f"specjax: compile cache off: cannot create {folder} ({e.strerror})",
                      RuntimeWarning, stacklevel=3)
        return None
    if ("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ
            and jax.config.jax_persistent_cache_min_compile_time_secs == JAX_MIN_COMPILE_S):
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    if can_install():
        jax_cache._cache = CheckedFileCache(folder, size_cap())
    else:  # JAX's own file cache, in a folder of its own (its entries are not checked)
        folder = folder / "jax"
        if jax.config.values.get("jax_compilation_cache_max_size") == -1 and has_filelock():
            jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    jax.config.update("jax_compilation_cache_dir", str(folder))
    return folder


_UNSET = object()
_in_use = _UNSET  # this process's decision: the folder in use, or None (off)
_lock = threading.Lock()


def use_compile_cache(enabled: bool = True) -> Path | None:
    """Sets the persistent compilation cache up on the first call of the process (on, unless
    `enabled` is False or SPECJAX_COMPILE_CACHE=0; a JAX cache the user set up wins); later
    calls change nothing. Returns the folder in use, or None when the cache is off."""
    global _in_use
    with _lock:
        if _in_use is _UNSET:
            _in_use = configure(enabled)
        return _in_use
