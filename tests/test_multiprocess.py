"""One job over several processes (`specjax.distributed`): 2 processes on localhost (CPU, gloo
collectives) write the same rows as 1 process, `--resume` works per process, `specjax merge`
makes the one output; bad specs, an unreachable coordinator and bad parts are one-line errors."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from fake_devices import fake_devices_env
from helpers import write_gguf

from specjax.cli.main import main as cli_main
from specjax.distributed import ProcessSpec, merge_parts, part_path, process_share, process_spec
from specjax.errors import InputError

PROMPTS = ["hello there", "a b c d e f g h i j k l m n o p", "x", "the quick brown fox jumps",
           "one two", "lorem ipsum dolor sit amet consectetur", "z y"]
COMPARED = ("id", "prompt", "token_ids", "completion", "stop_reason", "num_new_tokens")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def job_argv(model: Path, prompts: Path, out: Path) -> list[str]:
    return ["generate", "--model", str(model), "--prompts", str(prompts), "--out", str(out),
            "--max-new-tokens", "6", "--batch-size", "2", "--draft", "ngram", "--no-chat",
            "--no-compile-cache"]


def run_processes(argv: list[str], count: int, timeout: float = 300,
                  devices: int = 1) -> list[subprocess.CompletedProcess]:
    """Runs `specjax ARGV` as `count` processes of one job on localhost, each with `devices`
    CPU devices; their results."""
    port = free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", **fake_devices_env(devices))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", "import sys; from specjax.cli.main import main; "
             "sys.exit(main(sys.argv[1:]))", *argv, "--coordinator", f"localhost:{port}",
             "--num-processes", str(count), "--process-id", str(pid), "--coordinator-timeout", "60"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for pid in range(count)
    ]
    done = []
    for proc in procs:
        out, err = proc.communicate(timeout=timeout)
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return done


def rows_of(path: Path) -> list[dict]:
    return [{k: row[k] for k in COMPARED} for row in map(json.loads, path.read_text().splitlines())]


@pytest.fixture(scope="module")
def job(tmp_path_factory, tiny_model):
    """A tiny GGUF model, a prompt file and the single-process output of the job."""
    folder = tmp_path_factory.mktemp("multiprocess")
    cfg, params = tiny_model
    write_gguf(folder / "tiny.gguf", cfg, params)
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": text}) + "\n"
                               for i, text in enumerate(PROMPTS)))
    single = folder / "single.jsonl"
    assert cli_main(job_argv(folder / "tiny.gguf", prompts, single)) == 0
    return folder, prompts, rows_of(single)


def test_two_processes_write_the_rows_of_one(job):
    folder, prompts, expected = job
    out = folder / "two.jsonl"
    results = run_processes(job_argv(folder / "tiny.gguf", prompts, out), 2)
    for r in results:
        assert r.returncode == 0, r.stderr[-2000:]
    parts = [part_path(out, ProcessSpec("h:1", 2, pid)) for pid in range(2)]
    assert [len(p.read_text().splitlines()) for p in parts] == [4, 3]  # rows 0,2,4,6 and 1,3,5
    assert cli_main(["merge", "--out", str(out), "--parts", "2", "--prompts", str(prompts)]) == 0
    assert rows_of(out) == expected
    assert len({tuple(r["token_ids"]) for r in expected}) > 1  # the rows differ: a real check

    # a process killed mid-job: its part lost its last row and holds a torn line; --resume
    # regenerates only what is missing, per process, and the merge is the same again
    lines = parts[1].read_bytes().splitlines(keepends=True)
    parts[1].write_bytes(b"".join(lines[:-1]) + lines[-1][:10])
    results = run_processes(job_argv(folder / "tiny.gguf", prompts, out) + ["--resume"], 2)
    for r in results:
        assert r.returncode == 0, r.stderr[-2000:]
    assert "resume: 4 of 4 rows already in" in results[0].stderr
    assert "resume: 2 of 3 rows already in" in results[1].stderr
    assert cli_main(["merge", "--out", str(out), "--parts", "2", "--prompts", str(prompts)]) == 0
    assert rows_of(out) == expected


def test_one_mesh_across_two_processes_writes_the_rows_of_one(job):
    """--mesh dp=2,tp=2 over 2 processes of 2 devices: ONE program across both (rows over the
    processes, weights and KV heads over each one's 2 devices); each writes the rows it owns."""
    folder, prompts, expected = job
    out = folder / "mesh.jsonl"
    argv = job_argv(folder / "tiny.gguf", prompts, out) + ["--mesh", "dp=2,tp=2"]
    results = run_processes(argv, 2, devices=2)
    for r in results:
        assert r.returncode == 0, r.stderr[-2000:]
    assert cli_main(["merge", "--out", str(out), "--parts", "2", "--prompts", str(prompts)]) == 0
    assert rows_of(out) == expected
    part = part_path(out, ProcessSpec("h:1", 2, 0))
    part.write_bytes(b"".join(part.read_bytes().splitlines(keepends=True)[:-1]))  # lose a row
    results = run_processes(argv + ["--resume"], 2, devices=2)
    for r in results:
        assert r.returncode == 0, r.stderr[-2000:]
    assert "1 prompt:" in results[0].stderr  # both ran the one missing row's batch
    assert cli_main(["merge", "--out", str(out), "--parts", "2", "--prompts", str(prompts)]) == 0
    assert rows_of(out) == expected


def test_unreachable_coordinator_is_a_one_line_error(job, capsys):
    folder, prompts, _ = job
    argv = job_argv(folder / "tiny.gguf", prompts, folder / "lonely.jsonl")
    port = free_port()
    rc = cli_main(argv + ["--coordinator", f"localhost:{port}", "--num-processes", "2",
                          "--process-id", "1", "--coordinator-timeout", "1"])
    err = capsys.readouterr().err
    assert rc == 2
    assert f"--coordinator localhost:{port}: not reachable within 1 s" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"coordinator": "nohostport", "num_processes": 2, "process_id": 0}, "expected HOST:PORT"),
    ({"coordinator": "h:99999", "num_processes": 2, "process_id": 0}, "expected HOST:PORT"),
    ({"coordinator": "h:1234", "num_processes": 2}, "needs --num-processes and --process-id"),
    ({"coordinator": "h:1234", "num_processes": 2, "process_id": 2}, "must be in [0, 2)"),
    ({"num_processes": 2, "process_id": 1}, "need --coordinator"),
    ({"coordinator": "h:1234", "num_processes": 2, "process_id": 0, "timeout_s": 0}, ">= 1 second"),
])
def test_bad_process_specs(kwargs, message, monkeypatch):
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(InputError, match=re.escape(message)):
        process_spec(**kwargs)


def test_spec_from_environment(monkeypatch):
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
    monkeypatch.setenv("JAX_PROCESS_ID", "3")
    assert process_spec() == ProcessSpec("10.0.0.1:1234", 4, 3)
    assert process_spec(process_id=1).process_id == 1  # an argument wins over the environment
    monkeypatch.setenv("JAX_PROCESS_ID", "x")
    with pytest.raises(InputError, match="JAX_PROCESS_ID: expected an integer"):
        process_spec()


def test_share_and_parts_cover_every_row_once():
    rows = list(range(11))
    shares = [process_share(rows, ProcessSpec("h:1", 3, pid)) for pid in range(3)]
    assert sorted(sum(shares, [])) == rows
    assert part_path("a/out.jsonl", ProcessSpec("h:1", 3, 2)) == Path("a/out.process-2-of-3.jsonl")
    assert part_path("a/out.jsonl", ProcessSpec()) == Path("a/out.jsonl")


def test_merge_refuses_bad_parts(tmp_path):
    out = tmp_path / "out.jsonl"
    parts = [part_path(out, ProcessSpec("h:1", 2, pid)) for pid in range(2)]
    parts[0].write_text('{"id": 0}\n{"id": 2}\n')
    with pytest.raises(InputError, match="process-1-of-2.jsonl: missing"):
        merge_parts(out, 2)
    parts[1].write_text('{"id": 1}\n{"id": 2}\n')
    with pytest.raises(InputError, match="id 2 is also in another part"):
        merge_parts(out, 2)
    parts[1].write_text('{"id": 1}\n')
    with pytest.raises(InputError, match=r"1 id\(s\) in no part"):
        merge_parts(out, 2, order=[0, 1, 2, 3])
    assert not out.exists()  # nothing written while a check fails
    parts[1].write_text('{"id": 1}\n{"id": 3\n')
    with pytest.raises(InputError, match="process-1-of-2.jsonl:2: not a JSON row"):
        merge_parts(out, 2)
    parts[1].write_text('{"id": 1}\n{"id": 3}\n')
    assert merge_parts(out, 2, order=[3, 2, 1, 0]) == 4
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == [3, 2, 1, 0]
