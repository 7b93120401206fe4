"""`specjax generate` end to end on a tiny HF-format checkpoint: output rows, resume, errors."""
from __future__ import annotations

import json

import jax
import pytest
from helpers import tiny_config, tiny_vocab, write_hf

from specjax.cli import main
from specjax.models.llama import init_params

FIELDS = {"id", "category", "prompt", "completion", "token_ids", "num_new_tokens", "stop_reason", "time_s",
          "compile_s", "prefill_s", "decode_s"}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    cfg = tiny_config(vocab_size=len(tiny_vocab()[0]))
    params = init_params(cfg, jax.random.PRNGKey(0))
    return str(write_hf(tmp_path_factory.mktemp("tiny_hf"), cfg, params))


def _write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def _read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


ROWS = [
    {"prompt": "hello world"},
    {"question_id": 81, "category": "writing", "turns": ["write about tiles", "second turn"]},
    {"id": "x", "prompt": "the cat"},
    {"prompt": "one more row"},
    {"prompt": "and the last"},
]


def _generate(tiny_dir, prompts, out, *extra):
    return main(["generate", "--model", tiny_dir, "--prompts", prompts, "--out", str(out),
                 "--max-new-tokens", "6", "--batch-size", "2", *extra])


def test_generate_writes_rows_and_resume_skips_done_ids(tiny_dir, tmp_path):
    prompts = _write_jsonl(tmp_path / "in.jsonl", ROWS)
    out = tmp_path / "out.jsonl"
    assert _generate(tiny_dir, prompts, out) == 0
    rows = _read_jsonl(out)
    assert [r["id"] for r in rows] == [0, 81, "x", 3, 4]
    assert all(FIELDS <= set(r) for r in rows)
    assert rows[1]["category"] == "writing" and rows[1]["prompt"] == "write about tiles"
    assert all(1 <= r["num_new_tokens"] == len(r["token_ids"]) <= 6 for r in rows)
    # A job killed mid-write: two rows lost, the last one torn. Resume completes the rest only.
    lines = out.read_text().splitlines()
    out.write_text("\n".join(lines[:3]) + "\n" + lines[3][:10])
    assert _generate(tiny_dir, prompts, out, "--resume") == 0
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()[:3]]
    resumed = _read_jsonl_tolerant(out)
    assert sorted(map(str, (r["id"] for r in resumed))) == sorted(map(str, [0, 81, "x", 3, 4]))
    assert ids == [0, 81, "x"]
    for before, after in zip(rows, sorted(resumed, key=lambda r: [0, 81, "x", 3, 4].index(r["id"]))):
        assert before["token_ids"] == after["token_ids"]


def test_refilled_slots_and_static_batches_write_the_same_rows(tiny_dir, tmp_path, capsys):
    """The default (continuous batching) and --no-refill (static batches) write the same rows;
    the summary line tells how busy the slots were, or the prefill and decode seconds."""
    prompts = _write_jsonl(tmp_path / "in.jsonl", ROWS)
    refilled, static = tmp_path / "refilled.jsonl", tmp_path / "static.jsonl"
    assert _generate(tiny_dir, prompts, refilled) == 0
    assert "busy" in capsys.readouterr().err
    assert _generate(tiny_dir, prompts, static, "--no-refill") == 0
    assert "decode" in capsys.readouterr().err
    rows = lambda path: [(r["id"], r["token_ids"], r["stop_reason"]) for r in _read_jsonl(path)]
    assert rows(refilled) == rows(static)


def _read_jsonl_tolerant(path):
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def test_speculative_rows_carry_spec_metrics(tiny_dir, tmp_path):
    prompts = _write_jsonl(tmp_path / "in.jsonl", ROWS[:2])
    out = tmp_path / "out.jsonl"
    assert _generate(tiny_dir, prompts, out, "--draft", "ngram", "--num-draft", "3") == 0
    plain = tmp_path / "plain.jsonl"
    assert _generate(tiny_dir, prompts, plain) == 0
    for spec_row, plain_row in zip(_read_jsonl(out), _read_jsonl(plain)):
        assert spec_row["token_ids"] == plain_row["token_ids"]
        assert spec_row["spec"]["steps"] >= 1


def test_a_stateful_drafter_given_no_draft_length_runs_auto(tiny_dir, tmp_path, monkeypatch):
    """--draft layerskip:1 alone (greedy): auto picks the chain every step, output as plain."""
    from specjax import auto_costs

    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(auto_costs, "profile_step_costs",
                        lambda target, params, drafter, *a, **k: [1.0] + [0.5] * (len(drafter.lengths) - 1))
    prompts = _write_jsonl(tmp_path / "in.jsonl", ROWS[:2])
    out, plain = tmp_path / "out.jsonl", tmp_path / "plain.jsonl"
    assert _generate(tiny_dir, prompts, out, "--draft", "layerskip:1") == 0
    assert _generate(tiny_dir, prompts, plain) == 0
    for spec_row, plain_row in zip(_read_jsonl(out), _read_jsonl(plain)):
        assert spec_row["token_ids"] == plain_row["token_ids"]
        assert spec_row["spec"]["shape_histogram"] and "0" not in spec_row["spec"]["shape_histogram"]


@pytest.mark.parametrize("rows,message", [
    ([{"prompt": "ok"}, {"prompt": "  "}], "in.jsonl:2: the prompt is empty"),
    ([{"prompt": "ok"}, "{not json"], "in.jsonl:2: not valid JSON"),
    ([{"text": "no prompt"}], "in.jsonl:1: needs a 'prompt' or a 'turns' field"),
    ([{"prompt": "word " * 3000}], "in.jsonl:1 has"),
])
def test_bad_input_names_the_row(tiny_dir, tmp_path, capsys, rows, message):
    prompts = _write_jsonl(tmp_path / "in.jsonl", rows)
    assert _generate(tiny_dir, prompts, tmp_path / "out.jsonl") == 2
    assert message in capsys.readouterr().err


def test_unknown_model_is_a_clear_error(tmp_path, capsys):
    prompts = _write_jsonl(tmp_path / "in.jsonl", ROWS[:1])
    assert main(["generate", "--model", str(tmp_path / "missing.gguf"), "--prompts", prompts]) == 2
    assert "missing.gguf" in capsys.readouterr().err


def test_skip_bad_rows_leaves_them_out_with_their_line(tiny_dir, tmp_path, capsys):
    """--skip-bad-rows: each bad row logged with its line and reason, the others generated."""
    rows = [{"prompt": "ok one"}, "{not json", {"prompt": " "}, {"id": 7, "prompt": "word " * 3000},
            {"id": 0, "prompt": "a duplicate of line 1's id"}, {"prompt": "ok two", "max_new_tokens": 0},
            {"prompt": "ok three"}]
    prompts = _write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    assert _generate(tiny_dir, prompts, out, "--skip-bad-rows") == 0
    err = capsys.readouterr().err
    skipped = [line for line in err.splitlines() if line.startswith("specjax: skipped ")]
    for message in ("in.jsonl:2: not valid JSON", "in.jsonl:3: the prompt is empty",
                    "in.jsonl:4: the prompt has", "in.jsonl:5: id 0 is also the id of",
                    "in.jsonl:6: max_new_tokens must be an integer >= 1"):
        assert any(message in line for line in skipped), message
    assert len(skipped) == 5
    assert [r["id"] for r in _read_jsonl(out)] == [0, 6]
    assert _generate(tiny_dir, prompts, out, "--skip-bad-rows", "--resume") == 0
    assert "resume: 2 of 3 rows already in" in capsys.readouterr().err  # line 4 is skipped again
    assert [r["id"] for r in _read_jsonl(out)] == [0, 6]
    assert _generate(tiny_dir, prompts, tmp_path / "strict.jsonl") == 2  # without it: stops
    assert not (tmp_path / "strict.jsonl").exists() or not _read_jsonl(tmp_path / "strict.jsonl")


def test_rows_give_their_own_max_new_tokens(tiny_dir, tmp_path):
    rows = [{"prompt": "hello world", "max_new_tokens": 2}, {"prompt": "the cat"},
            {"prompt": "one more row", "max_new_tokens": 9}]
    out, longest = tmp_path / "out.jsonl", tmp_path / "longest.jsonl"
    prompts = _write_jsonl(tmp_path / "in.jsonl", rows)
    assert _generate(tiny_dir, prompts, out) == 0  # --max-new-tokens 6 where a row gives none
    whole = _write_jsonl(tmp_path / "whole.jsonl", [{"prompt": r["prompt"]} for r in rows])
    assert _generate(tiny_dir, whole, longest, "--max-new-tokens", "9") == 0
    for row, limit, reference in zip(_read_jsonl(out), (2, 6, 9), _read_jsonl(longest)):
        assert row["token_ids"] == reference["token_ids"][:limit]  # greedy: a prefix of the longest
        assert row["num_new_tokens"] == limit or row["stop_reason"] == "eos"


KILLED_WRITER = """
import os, signal, sys
import specjax.cli.generate as generate
calls = []
def append_rows(fd, rows, path):  # the second chunk's write: one row, half a line, killed
    calls.append(1)
    if len(calls) < 2:
        return real(fd, rows, path)
    real(fd, rows[:1], path)
    os.write(fd, generate.json.dumps(rows[1])[:25].encode())
    os.kill(os.getpid(), signal.SIGKILL)
real, generate.append_rows = generate.append_rows, append_rows
from specjax.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_job_killed_mid_chunk_resumes_to_the_same_rows(tiny_dir, tmp_path):
    """Killed while writing a chunk's rows (a torn last line), then --resume: every id exactly
    once, each row the same as an uninterrupted run's."""
    import subprocess
    import sys

    rows = [{"prompt": f"row {i} " + "word " * (i % 5)} for i in range(40)]
    prompts = _write_jsonl(tmp_path / "in.jsonl", rows)
    args = ["generate", "--model", tiny_dir, "--prompts", prompts, "--max-new-tokens", "6",
            "--batch-size", "2"]
    whole = tmp_path / "whole.jsonl"
    assert main([*args, "--out", str(whole)]) == 0
    out = tmp_path / "out.jsonl"
    killed = subprocess.run([sys.executable, "-c", KILLED_WRITER, *args, "--out", str(out)],
                            capture_output=True, text=True)
    assert killed.returncode == -9, killed.stderr[-2000:]
    text = out.read_text()
    assert not text.endswith("\n")  # the torn line
    written = len(text.splitlines()) - 1
    assert 0 < written < len(rows)
    assert main([*args, "--out", str(out), "--resume"]) == 0
    resumed = _read_jsonl(out)
    assert sorted(r["id"] for r in resumed) == list(range(len(rows)))
    expected = {r["id"]: r["token_ids"] for r in _read_jsonl(whole)}
    assert all(r["token_ids"] == expected[r["id"]] for r in resumed)
