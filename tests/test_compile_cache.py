"""The persistent compilation cache (`specjax.compile_cache`): on by default under
$SPECJAX_CACHE/compile, hit by a second process, capped, off with SPECJAX_COMPILE_CACHE=0 or
--no-compile-cache, the user's own JAX cache left alone, and a damaged entry compiled again
with a warning, never loaded."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from importlib import import_module
from pathlib import Path

import pytest

from specjax.cli.main import build_parser
from specjax.compile_cache import (
    SUFFIX,
    CheckedFileCache,
    pack_entry,
    switched_off,
    trim,
    unpack_entry,
)

TESTS = Path(__file__).resolve().parent
cli_main = import_module("specjax.cli.main")  # the module (specjax.cli.main is the function)

# One job of the API on a tiny model in a fresh process; prints the cache events and tokens.
JOB = textwrap.dedent("""
    import collections, json, os, sys, warnings
    import jax
    events = collections.Counter()
    jax.monitoring.register_event_listener(lambda name, **kw: events.update([name]))
    from helpers import tiny_config
    import specjax
    from specjax.compile_cache import use_compile_cache
    from specjax.models.llama import init_params
    cfg = tiny_config()
    params = init_params(cfg, jax.random.PRNGKey(0))
    before = jax.config.jax_compilation_cache_dir  # importing specjax sets nothing up
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = specjax.generate_ids(cfg, params, [[3, 4, 5, 3, 4]], max_new_tokens=6, eos_ids=(),
                                   draft="ngram", num_draft=2, mesh=os.environ.get("JOB_MESH"))
    print(json.dumps({
        "before": before, "folder": str(use_compile_cache()), "tokens": out[0].token_ids,
        "hits": events["/jax/compilation_cache/cache_hits"],
        "misses": events["/jax/compilation_cache/cache_misses"],
        "requests": events["/jax/compilation_cache/compile_requests_use_cache"],
        "warnings": [str(w.message) for w in caught if "compile cache" in str(w.message)],
    }))
""")


def run_job(cache: Path, **env) -> dict:
    """JOB in a fresh process with $SPECJAX_CACHE = cache; its JSON line."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    environ.update(SPECJAX_CACHE=str(cache), PYTHONPATH=str(TESTS), **env)
    run = subprocess.run([sys.executable, "-c", JOB], capture_output=True, text=True, env=environ,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def entries(folder: Path) -> list[Path]:
    return sorted(folder.glob(f"*{SUFFIX}"))


def test_a_second_process_loads_every_program_and_damage_is_compiled_again(tmp_path):
    folder = tmp_path / "compile"
    first = run_job(tmp_path)
    assert first["before"] is None and first["folder"] == str(folder)
    assert first["hits"] == 0 and first["misses"] > 0
    assert entries(folder) and not first["warnings"]
    second = run_job(tmp_path)
    # every program the job compiled is loaded (init_params compiled before the job: uncached)
    assert second["hits"] == first["misses"] == len(entries(folder)) and second["misses"] == 0
    assert second["tokens"] == first["tokens"]

    damaged = entries(folder)
    contents = [path.read_bytes() for path in damaged]
    for i, path in enumerate(damaged):
        if i % 3 == 0:
            path.write_bytes(os.urandom(len(contents[i])))  # garbage
        elif i % 3 == 1:
            path.write_bytes(contents[i][: len(contents[i]) // 2])  # torn write
        else:
            path.write_bytes(contents[i - 1])  # another program's entry under this key
    third = run_job(tmp_path)
    assert third["tokens"] == first["tokens"] and third["hits"] == 0
    assert len(third["warnings"]) == len(damaged)
    assert all("corrupt or not this program's" in w for w in third["warnings"])
    fourth = run_job(tmp_path)  # the damaged entries were written anew
    assert fourth["hits"] == first["misses"] and not fourth["warnings"]


def test_a_multi_device_cpu_process_caches_nothing(tmp_path):
    """2 fake CPU devices, a dp=2 job: no entry read or written (a loaded XLA CPU program with
    collectives deadlocks), one warning, the same tokens as one device."""
    two = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JOB_MESH": "dp=2"}
    first = run_job(tmp_path, **two)
    assert not entries(tmp_path / "compile") and first["hits"] == 0
    assert len(first["warnings"]) == 1 and "2 CPU devices" in first["warnings"][0]
    second = run_job(tmp_path, **two)
    assert second["hits"] == 0 and second["tokens"] == first["tokens"]
    assert second["tokens"] == run_job(tmp_path / "one")["tokens"]


def test_switched_off_by_the_environment_or_left_to_the_user(tmp_path):
    off = run_job(tmp_path, SPECJAX_COMPILE_CACHE="0")
    assert off["folder"] == "None" and off["hits"] == off["misses"] == 0
    assert not (tmp_path / "compile").exists()
    user = run_job(tmp_path, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "mine"))
    assert user["folder"] == str(tmp_path / "mine") and not (tmp_path / "compile").exists()
    assert switched_off({"SPECJAX_COMPILE_CACHE": "Off"}) and not switched_off({})


def test_every_subcommand_takes_no_compile_cache():
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    for name, command in commands.items():
        assert "--no-compile-cache" in command.format_help(), name


def test_the_cli_sets_the_cache_up_before_the_command_runs(monkeypatch):
    calls = []
    monkeypatch.setattr(cli_main, "use_compile_cache", calls.append)
    for flag in ([], ["--no-compile-cache"]):
        assert cli_main.main(["generate", "--prompt", " ", *flag]) == 2  # the command then fails
    assert calls == [True, False]


def test_an_entry_is_bound_to_its_key_and_bytes():
    data = pack_entry("jit_f-1", b"program")
    assert unpack_entry("jit_f-1", data) == b"program"
    for bad in (data[:-1], data[:10], b"", b"x" * len(data), data[:-1] + b"!"):
        assert unpack_entry("jit_f-1", bad) is None
    assert unpack_entry("jit_g-2", data) is None  # another program's entry


def test_a_damaged_entry_is_removed_with_a_warning(tmp_path):
    cache = CheckedFileCache(tmp_path)
    cache.put("jit_f-1", b"program")
    assert cache.get("jit_f-1") == b"program" and cache.get("jit_missing-0") is None
    cache.entry_path("jit_f-1").write_bytes(b"garbage")
    with pytest.warns(RuntimeWarning, match="corrupt or not this program's"):
        assert cache.get("jit_f-1") is None
    assert not cache.entry_path("jit_f-1").exists()


def test_the_folder_keeps_under_its_cap_dropping_the_least_recent(tmp_path):
    cache = CheckedFileCache(tmp_path, max_bytes=3 * len(pack_entry("k-0", bytes(100))))
    for i in range(3):
        cache.put(f"k-{i}", bytes(100))
        os.utime(cache.entry_path(f"k-{i}"), (i, i))  # k-0 is the least recently used
    cache.put("k-3", bytes(100))
    assert [p.name for p in entries(tmp_path)] == [f"k-{i}{SUFFIX}" for i in (1, 2, 3)]
    cache.put("huge-0", bytes(1000))  # more than the cap alone: not written
    assert not cache.entry_path("huge-0").exists()
    trim(tmp_path, 0)
    assert not entries(tmp_path)
