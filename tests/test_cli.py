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
