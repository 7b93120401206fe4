"""The CLI's edges: every bad option or file is one `...: error: ...` line naming it, exit 2,
before any model loads; `generate --out/--resume` never loses or tears a row."""
from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

import specjax.api
import specjax.measure.profile
import specjax.models.hub
from specjax.api import Generation
from specjax.cli import main


def _forbid_model_loads(monkeypatch):
    def load(*args, **kwargs):
        raise AssertionError("a model was loaded before the inputs were checked")

    monkeypatch.setattr(specjax.models.hub, "load_model", load)
    monkeypatch.setattr(specjax.measure.profile, "load_target", load)


def run_cli(argv) -> int:
    """main's exit status, argparse's SystemExit included."""
    try:
        return main([str(a) for a in argv])
    except SystemExit as e:
        return e.code


FILES = {
    "empty.yaml": b"",
    "scalar.yaml": b"5\n",
    "list.yaml": b"- 1\n- 2\n",
    "malformed.yaml": b"chain: [1\n",
    "latin1.yaml": b"name: caf\xe9\n",
    "no_kind.yaml": b"name: x\n",
    "kary_no_branching.yaml": b"k_ary: {max_nodes: 3}\n",
    "chain_too_long.yaml": b"chain: 1000\n",
    "chain_float.yaml": b"chain: 2.5\n",
    "sched_v9.yaml": b"version: 9\nbuckets: []\n",
    "sched_no_buckets.yaml": b"version: 1\ndraft: ngram\n",
    "sched_bad_bucket.yaml": b"version: 1\ndraft: ngram\nbuckets: [{num_draft: 2}]\n",
    "sched_bad_tree.yaml": b"version: 1\ndraft: ngram\nbuckets: [{batch_size: 1, tree: nope}]\n",
    "sched_huge.yaml": b"version: 1\ndraft: ngram\nbuckets: [{batch_size: 1, num_draft: 1000}]\n",
    "sched_no_draft.yaml": b"version: 1\nbuckets: [{batch_size: 1, num_draft: 2}]\n",
    "sched_bad_draft.yaml": b"version: 1\ndraft: nope\nbuckets: [{batch_size: 1, num_draft: 2}]\n",
    "p_latin1.jsonl": b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n',
    "p_list_id.jsonl": b'{"id": [1], "prompt": "ok"}\n',
    "p_dup_ids.jsonl": b'{"id": 7, "prompt": "a"}\n{"id": 7, "prompt": "b"}\n',
    "p_empty.jsonl": b"\n\n",
    "p_ok.jsonl": b'{"prompt": "a"}\n',
    "a_file": b"x",
}

GEN = ["generate", "--prompt", "hi"]
SPEC = [*GEN, "--draft", "ngram"]
BENCH = ["bench", "--draft", "ngram", "--dataset", "synthetic:2"]
TUNE = ["tune", "--draft", "ngram", "--dataset", "synthetic:2"]

# argv ("{tmp}" = a folder holding FILES) -> (exit status, a substring of the error line)
CASES = [
    # sampling and batch options (argparse names the option)
    ([*GEN, "--batch-size", "-1"], "argument --batch-size: must be an integer >= 1, got -1"),
    ([*GEN, "--batch-size", "0"], "argument --batch-size: must be an integer >= 1"),
    ([*GEN, "--batch-size", "two"], "argument --batch-size: expected an integer, got 'two'"),
    ([*GEN, "--max-new-tokens", "0"], "argument --max-new-tokens: must be an integer >= 1"),
    ([*GEN, "--temperature", "nan"], "argument --temperature: must be a finite number"),
    ([*GEN, "--temperature", "inf"], "argument --temperature: must be a finite number"),
    ([*GEN, "--temperature", "-0.5"], "argument --temperature: must be >= 0"),
    ([*GEN, "--top-k", "0"], "argument --top-k: must be an integer >= 1"),
    ([*GEN, "--top-p", "0"], "argument --top-p: must be in (0, 1]"),
    ([*GEN, "--top-p", "1.5"], "argument --top-p: must be in (0, 1]"),
    ([*GEN, "--top-p", "nan"], "argument --top-p: must be a finite number"),
    ([*GEN, "--stop", ""], "argument --stop: must not be empty"),
    ([*GEN, "--seed", "1.5"], "argument --seed: expected an integer, got '1.5'"),
    ([*GEN, "--seed", "-1"], "argument --seed: must be an integer in [0, 2**32)"),
    ([*GEN, "--draft", "ngram:abc"], "--draft 'ngram:abc': ngram: expected N or A-B"),
    ([*GEN, "--draft", "ngram:3-1"], "expected 1 <= A <= B"),
    ([*GEN, "--draft", "layerskip:0"], "layerskip:K: expected an integer >= 1"),
    ([*GEN, "--draft", "eagle3"], "eagle3:DIR needs its argument"),
    # draft shape
    ([*SPEC, "--num-draft", "0"], "argument --num-draft: a draft length must be in [1, 64], got 0"),
    ([*SPEC, "--num-draft", "1000"], "argument --num-draft: a draft length must be in [1, 64]"),
    ([*SPEC, "--num-draft", "2.5"], "argument --num-draft: expected an integer, got '2.5'"),
    ([*GEN, "--num-draft", "3"], "--num-draft/--tree need --draft"),
    ([*GEN, "--tree", "chain4"], "--num-draft/--tree need --draft"),
    ([*GEN, "--draft", "nope"], "--draft 'nope': unknown drafter"),
    ([*SPEC, "--tree", "no_such_preset"], "unknown tree 'no_such_preset'"),
    ([*SPEC, "--tree", "{tmp}/missing.yaml"], "cannot read tree file {tmp}/missing.yaml: No such file"),
    ([*SPEC, "--tree", "{tmp}/empty.yaml"], "tree file {tmp}/empty.yaml: the file is empty"),
    ([*SPEC, "--tree", "{tmp}/scalar.yaml"], "tree file {tmp}/scalar.yaml: expected a mapping of fields, got int"),
    ([*SPEC, "--tree", "{tmp}/list.yaml"], "tree file {tmp}/list.yaml: expected a mapping of fields, got list"),
    ([*SPEC, "--tree", "{tmp}/malformed.yaml"], "tree file {tmp}/malformed.yaml: malformed YAML (expected"),
    ([*SPEC, "--tree", "{tmp}/latin1.yaml"], "tree file {tmp}/latin1.yaml: not UTF-8 text"),
    ([*SPEC, "--tree", "{tmp}/no_kind.yaml"], "tree file {tmp}/no_kind.yaml: a tree config needs exactly one of"),
    ([*SPEC, "--tree", "{tmp}/kary_no_branching.yaml"], "kary_no_branching.yaml: missing field 'branching'"),
    ([*SPEC, "--tree", "{tmp}/chain_too_long.yaml"], "chain_too_long.yaml: chain depth must be in [1, 64], got 1000"),
    ([*SPEC, "--tree", "{tmp}/chain_float.yaml"], "chain_float.yaml: chain depth must be an integer"),
    ([*SPEC, "--tree", "{tmp}"], "cannot read tree file {tmp}: Is a directory"),
    # --tuned schedules
    ([*GEN, "--tuned", "{tmp}/missing.yaml"], "cannot read schedule {tmp}/missing.yaml"),
    ([*GEN, "--tuned", "{tmp}/empty.yaml"], "schedule {tmp}/empty.yaml: the file is empty"),
    ([*GEN, "--tuned", "{tmp}/scalar.yaml"], "schedule {tmp}/scalar.yaml: expected a mapping"),
    ([*GEN, "--tuned", "{tmp}/malformed.yaml"], "schedule {tmp}/malformed.yaml: malformed YAML"),
    ([*GEN, "--tuned", "{tmp}/sched_v9.yaml"], "sched_v9.yaml: not a version-1 draft schedule"),
    ([*GEN, "--tuned", "{tmp}/sched_no_buckets.yaml"], "sched_no_buckets.yaml: needs a 'buckets' list"),
    ([*GEN, "--tuned", "{tmp}/sched_bad_bucket.yaml"], "sched_bad_bucket.yaml: bad entry under 'buckets' (missing field 'batch_size')"),
    ([*GEN, "--tuned", "{tmp}/sched_bad_tree.yaml"], "sched_bad_tree.yaml: bad entry under 'buckets' (unknown tree 'nope'"),
    ([*GEN, "--tuned", "{tmp}/sched_huge.yaml"], "sched_huge.yaml: bad entry under 'buckets' (chain depth must be in [1, 64]"),
    ([*GEN, "--tuned", "{tmp}/sched_no_draft.yaml"], "the schedule names no drafter; pass --draft"),
    ([*GEN, "--tuned", "{tmp}/sched_bad_draft.yaml"], "sched_bad_draft.yaml: draft 'nope': unknown drafter"),
    # prompts and outputs
    (["generate", "--prompt", "  "], "--prompt is empty"),
    (["generate", "--prompts", "{tmp}/missing.jsonl"], "cannot read prompts file {tmp}/missing.jsonl"),
    (["generate", "--prompts", "{tmp}/p_latin1.jsonl"], "p_latin1.jsonl:2: not UTF-8 text (byte 16 of the line)"),
    (["generate", "--prompts", "{tmp}/p_list_id.jsonl"], "p_list_id.jsonl:1: the id must be a string or an integer"),
    (["generate", "--prompts", "{tmp}/p_empty.jsonl"], "p_empty.jsonl: no prompts"),
    (["generate", "--prompts", "{tmp}/p_dup_ids.jsonl", "--out", "{tmp}/o.jsonl", "--resume"],
     "p_dup_ids.jsonl:2: id 7 is also the id of {tmp}/p_dup_ids.jsonl:1; --resume needs unique ids"),
    ([*GEN, "--resume"], "--resume needs --out"),
    ([*GEN, "--out", "{tmp}/no_folder/out.jsonl"], "--out {tmp}/no_folder/out.jsonl: folder {tmp}/no_folder does not exist"),
    ([*GEN, "--out", "{tmp}"], "--out {tmp}: is a folder"),
    # bench
    (["bench", "--dataset", "synthetic:2"], "the following arguments are required: --draft"),
    (["bench", "--draft", "ngram", "--dataset", "synthetic:0"], "prompt set 'synthetic:0': expected synthetic[:N[:LEN]]"),
    (["bench", "--draft", "ngram", "--dataset", "synthetic:abc"], "prompt set 'synthetic:abc'"),
    (["bench", "--draft", "ngram", "--dataset", "synthetic:2:0"], "prompt set 'synthetic:2:0'"),
    (["bench", "--draft", "ngram", "--dataset", "synthetic:1:2:3"], "prompt set 'synthetic:1:2:3'"),
    (["bench", "--draft", "ngram", "--dataset", "synthetic:"], "prompt set 'synthetic:'"),
    (["bench", "--draft", "ngram", "--dataset", "{tmp}/p_empty.jsonl"], "p_empty.jsonl: no prompts"),
    ([*BENCH, "--categories", "nope"], "unknown categories ['nope']"),
    ([*BENCH, "--per-category", "0"], "argument --per-category: must be an integer >= 1"),
    ([*BENCH, "--repeats", "0"], "argument --repeats: must be an integer >= 1"),
    ([*BENCH, "--num-draft", "0"], "argument --num-draft: a draft length must be in [1, 64]"),
    ([*BENCH, "--batch-size", "0"], "argument --batch-size: must be an integer >= 1"),
    ([*BENCH, "--temperature", "nan"], "argument --temperature: must be a finite number"),
    ([*BENCH, "--tree", "{tmp}/empty.yaml"], "tree file {tmp}/empty.yaml: the file is empty"),
    (["bench", "--draft", "nope", "--dataset", "synthetic:2"], "--draft 'nope': unknown drafter"),
    ([*BENCH, "--out", "{tmp}/no_folder/r.json"], "--out {tmp}/no_folder/r.json: folder {tmp}/no_folder does not exist"),
    ([*BENCH, "--out", "{tmp}"], "--out {tmp}: is a folder"),
    ([*BENCH, "--json", "{tmp}"], "--out {tmp}: is a folder"),  # the old name still checked
    ([*BENCH, "--plots", "{tmp}/a_file"], "--plots {tmp}/a_file: is not a folder"),
    # tune
    (["tune", "--draft", "ngram", "--dataset", "synthetic:0"], "prompt set 'synthetic:0'"),
    ([*TUNE, "--batch-sizes", "1,0"], "--batch-sizes: expected comma-separated integers >= 1, got '1,0'"),
    ([*TUNE, "--batch-sizes", "a,b"], "--batch-sizes: expected comma-separated integers >= 1"),
    ([*TUNE, "--draft-lengths", "0,2"], "--draft-lengths: expected comma-separated integers >= 1"),
    ([*TUNE, "--draft-lengths", "2,100"], "--draft-lengths must be in [1, 64], got 100"),
    ([*TUNE, "--max-draft", "0"], "argument --max-draft: a draft length must be in [1, 64]"),
    ([*TUNE, "--check", "-1"], "argument --check: must be an integer >= 0"),
    ([*TUNE, "--measure-repeats", "0"], "argument --measure-repeats: must be an integer >= 1"),
    ([*TUNE, "--trees", "chain4,nope"], "unknown tree 'nope'"),
    ([*TUNE, "--out", "{tmp}/no_folder/s.yaml"], "--out {tmp}/no_folder/s.yaml: folder {tmp}/no_folder does not exist"),
    ([*TUNE, "--report", "{tmp}"], "--report {tmp}: is a folder"),
    ([*TUNE, "--json", "{tmp}"], "--report {tmp}: is a folder"),  # the old name of --report
    (["tune", "--draft", "nope", "--dataset", "synthetic:2"], "--draft 'nope': unknown drafter"),
    # profile
    (["profile", "--batch-sizes", "x"], "--batch-sizes: expected comma-separated integers >= 1"),
    (["profile", "--out", "{tmp}/no_folder/p.json"], "--out {tmp}/no_folder/p.json: folder {tmp}/no_folder does not exist"),
    (["profile", "--out", "{tmp}"], "--out {tmp}: is a folder"),
]


@pytest.fixture
def tmp_files(tmp_path):
    for name, data in FILES.items():
        (tmp_path / name).write_bytes(data)
    return tmp_path


@pytest.mark.parametrize("argv,message", CASES, ids=[" ".join(a[:1] + a[-2:]) for a, _ in CASES])
def test_bad_input_is_one_error_line_before_any_model_loads(argv, message, tmp_files, monkeypatch, capsys):
    _forbid_model_loads(monkeypatch)
    assert run_cli([a.replace("{tmp}", str(tmp_files)) for a in argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("specjax") and ": error: " in last
    assert message.replace("{tmp}", str(tmp_files)) in last


def test_an_oserror_on_a_named_file_is_one_line(monkeypatch, capsys):
    def fail(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", "/some/model.gguf")

    monkeypatch.setattr(specjax.models.hub, "load_model", fail)
    assert run_cli(GEN) == 2
    assert capsys.readouterr().err.strip() == "specjax: error: /some/model.gguf: Permission denied"


def test_an_unexpected_error_keeps_its_traceback(monkeypatch):
    def bug(*args, **kwargs):
        raise KeyError("a bug")

    monkeypatch.setattr(specjax.models.hub, "load_model", bug)
    with pytest.raises(KeyError):
        run_cli(GEN)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_output_folder(tmp_path, monkeypatch, capsys):
    _forbid_model_loads(monkeypatch)
    folder = tmp_path / "ro"
    folder.mkdir(mode=0o555)
    assert run_cli([*GEN, "--out", folder / "out.jsonl"]) == 2
    assert f"--out {folder}/out.jsonl: cannot write there" in capsys.readouterr().err


def test_read_only_output_file_system(monkeypatch, capsys):
    """/sys refuses new files even for root."""
    if _sys_is_writable():
        pytest.skip("no read-only /sys here")
    _forbid_model_loads(monkeypatch)
    assert run_cli([*GEN, "--out", "/sys/specjax-out.jsonl"]) == 2
    assert "--out /sys/specjax-out.jsonl: cannot write there" in capsys.readouterr().err


def _sys_is_writable() -> bool:
    import tempfile

    try:
        tempfile.TemporaryFile(dir="/sys").close()
    except OSError as e:
        return e.errno not in (errno.EACCES, errno.EROFS, errno.EPERM)
    return True


# ---- generate --out / --resume with a stand-in for the model --------------------------------


def fake_completion(prompt: str) -> str:
    """A completion with multi-byte characters and U+2028 (a line break to str.splitlines)."""
    return f"{prompt} → café 日本\u2028end"


@pytest.fixture
def fake_model(monkeypatch):
    """generate without a model: each prompt's completion is fake_completion(prompt); prompts
    containing "ERR" end with stop_reason "error". Records the prompts generated."""
    generated: list[str] = []

    def iter_generate(model, prompts, *, batch_size, **kwargs):
        for start in range(0, len(prompts), batch_size):
            chunk = prompts[start:start + batch_size]
            generated.extend(chunk)
            yield start, [Generation(p, fake_completion(p), [5, 6], 2,
                                     "error" if "ERR" in p else "length", 0.01) for p in chunk]

    monkeypatch.setattr(specjax.models.hub, "load_model", lambda *a, **k: object())
    monkeypatch.setattr(specjax.api, "iter_generate", iter_generate)
    return generated


def _prompts(tmp_path, texts):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"id": i, "prompt": t}) + "\n" for i, t in enumerate(texts)))
    return path


def _rows(path):
    return [json.loads(line) for line in path.read_bytes().decode("utf-8").split("\n") if line]


PROMPTS = ["p0", "p1", "p2", "p3", "p4"]


def _gen(prompts, out, *extra):
    return run_cli(["generate", "--prompts", prompts, "--out", out, "--batch-size", "2", *extra])


def test_rows_with_line_separators_survive_resume(tmp_path, fake_model):
    prompts, out = _prompts(tmp_path, PROMPTS), tmp_path / "out.jsonl"
    assert _gen(prompts, out) == 0
    assert [r["completion"] for r in _rows(out)] == [fake_completion(p) for p in PROMPTS]
    fake_model.clear()
    assert _gen(prompts, out, "--resume") == 0
    assert fake_model == [] and len(_rows(out)) == len(PROMPTS)


def test_resume_trims_a_tail_torn_inside_a_multibyte_character(tmp_path, fake_model, capsys):
    prompts, out = _prompts(tmp_path, PROMPTS), tmp_path / "out.jsonl"
    assert _gen(prompts, out) == 0
    data = out.read_bytes()
    lines = data.split(b"\n")
    cut = lines[3].index("日".encode()) + 1  # inside the 3-byte character
    torn = b"\n".join(lines[:3]) + b"\n" + lines[3][:cut]
    out.write_bytes(torn)
    fake_model.clear()
    assert _gen(prompts, out, "--resume") == 0
    assert "a torn last line" in capsys.readouterr().err
    assert fake_model == ["p3", "p4"]
    assert sorted(r["id"] for r in _rows(out)) == [0, 1, 2, 3, 4]
    assert Path(f"{out}.dropped").read_bytes() == lines[3][:cut]


def test_resume_reports_and_rewrites_corrupt_lines(tmp_path, fake_model, capsys):
    prompts, out = _prompts(tmp_path, PROMPTS), tmp_path / "out.jsonl"
    assert _gen(prompts, out) == 0
    lines = out.read_bytes().split(b"\n")[:-1]
    damaged = [lines[0], b"{not json", lines[2], b"\xff\xfe binary", b'{"id": 4}', lines[3]]
    out.write_bytes(b"\n".join(damaged) + b"\n")
    fake_model.clear()
    assert _gen(prompts, out, "--resume") == 0
    err = capsys.readouterr().err
    assert "3 corrupt line(s) (line 2, 4, 5)" in err and "generated again" in err
    assert fake_model == ["p1", "p4"]
    rows = _rows(out)
    assert sorted(r["id"] for r in rows) == [0, 1, 2, 3, 4]
    assert [r["id"] for r in rows[:3]] == [0, 2, 3]  # the good rows, in place, then the new ones
    assert Path(f"{out}.dropped").read_bytes() == b'{not json\n\xff\xfe binary\n{"id": 4}\n'


def test_resume_without_damage_leaves_the_file_alone(tmp_path, fake_model):
    prompts, out = _prompts(tmp_path, PROMPTS), tmp_path / "out.jsonl"
    assert _gen(prompts, out) == 0
    inode = out.stat().st_ino
    assert _gen(prompts, out, "--resume") == 0
    assert out.stat().st_ino == inode and not Path(f"{out}.dropped").exists()


def _fail_writes_to(path: Path, monkeypatch, code: int, after_batches: int):
    """os.write to `path` fails with `code` once `after_batches` writes went through: the failing
    write first puts half its bytes in the file (a torn row), then raises."""
    real_write = os.write
    state = {"writes": 0, "on": True}

    def write(fd, data):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = None
        if not state["on"] or target != str(path.resolve()):
            return real_write(fd, data)
        state["writes"] += 1
        if state["writes"] <= after_batches:
            return real_write(fd, data)
        if state["writes"] == after_batches + 1 and len(data) > 1:
            return real_write(fd, bytes(data)[: len(data) // 2])
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "write", write)
    return lambda: state.update(on=False)


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc/self/fd")
@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EACCES, errno.EIO])
def test_a_failed_write_keeps_every_finished_row(tmp_path, fake_model, monkeypatch, capsys, code):
    prompts, out = _prompts(tmp_path, PROMPTS), tmp_path / "out.jsonl"
    stop_failing = _fail_writes_to(out, monkeypatch, code, after_batches=1)
    assert _gen(prompts, out) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"specjax: error: cannot write {out}: {os.strerror(code)}; the rows already "
                       f"in it are kept and --resume generates the rest")
    data = out.read_bytes()
    assert data.endswith(b"\n")  # the half-written second row of the batch was cut off
    assert [r["id"] for r in _rows(out)] == [0, 1, 2]  # batch 1, and batch 2's whole first row
    stop_failing()
    fake_model.clear()
    assert _gen(prompts, out, "--resume") == 0
    assert fake_model == ["p3", "p4"]
    assert [r["id"] for r in _rows(out)] == [0, 1, 2, 3, 4]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_full_disk_is_one_error_line(tmp_path, fake_model, capsys):
    prompts = _prompts(tmp_path, PROMPTS)
    assert _gen(prompts, "/dev/full") == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "specjax: error: cannot write /dev/full: No space left on device; the rows already in it "
        "are kept and --resume generates the rest")


def test_error_rows_are_written_and_exit_1(tmp_path, fake_model, capsys):
    prompts, out = _prompts(tmp_path, ["ok", "ERR a", "ok too", "ERR b"]), tmp_path / "out.jsonl"
    assert _gen(prompts, out) == 1
    assert [r["stop_reason"] for r in _rows(out)] == ["length", "error", "length", "error"]
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith('specjax: error: 2 row(s) ended with stop_reason "error"')
    assert last.endswith("ids 1, 3")


def test_empty_prompt_sets_are_refused_by_the_library_too():
    from specjax.measure.bench import RunConfig, run_bench
    from specjax.measure.tune import TuneConfig, tune

    with pytest.raises(ValueError, match="at least one prompt"):
        tune(None, [], "ngram", RunConfig(max_new_tokens=4, batch_size=1), TuneConfig())
    with pytest.raises(ValueError, match="at least one prompt"):
        run_bench(None, [], None, None, RunConfig(max_new_tokens=4, batch_size=1))


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_bench_report_on_a_full_disk_is_one_error_line(monkeypatch, capsys):
    import specjax.measure.bench

    monkeypatch.setattr(specjax.measure.profile, "load_target", lambda *a, **k: SimpleNamespace(tokenizer=None))
    monkeypatch.setattr(specjax.measure.bench, "make_any_drafter", lambda *a, **k: (None, None))
    monkeypatch.setattr(specjax.measure.bench, "run_bench", lambda *a, **k: {"overall": {}})
    monkeypatch.setattr(specjax.measure.bench, "summary_lines", lambda report: [])
    assert run_cli([*BENCH, "--out", "/dev/full"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "specjax: error: cannot write /dev/full: No space left on device")
