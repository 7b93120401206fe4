"""Ray Data jobs (`specjax.ray`, the optional `ray` extra): a pool of Generator actors on a local
Ray instance writes the rows a one-process `specjax generate` writes."""
from __future__ import annotations

import json

import pytest
from helpers import write_gguf

from specjax.cli.main import main as cli_main

ray = pytest.importorskip("ray", reason="the optional ray extra")

import specjax.ray  # noqa: E402

PROMPTS = ["hello there", "a b c d e f g h i j k l m n o p", "x", "the quick brown fox jumps",
           "one two", "lorem ipsum dolor sit amet consectetur", "z y"]
COMPARED = ("id", "category", "prompt", "token_ids", "completion", "stop_reason", "num_new_tokens")


def rows_of(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_ray_job_writes_the_rows_of_generate(tmp_path, tiny_model, local_ray):
    """Sampled, speculative: the rows depend on (seed, id) only, not on the actor or block."""
    draft = "ngram"
    cfg, params = tiny_model
    write_gguf(tmp_path / "tiny.gguf", cfg, params)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "category": "c", "prompt": text}) + "\n"
                               for i, text in enumerate(PROMPTS)))
    options = {"max_new_tokens": 6, "temperature": 0.8, "seed": 3, "chat": False,
               "batch_size": 2, "draft": draft}
    argv = ["generate", "--model", str(tmp_path / "tiny.gguf"), "--prompts", str(prompts),
            "--out", str(tmp_path / "one.jsonl"), "--max-new-tokens", "6", "--temperature", "0.8",
            "--seed", "3", "--batch-size", "2", "--no-chat"] + (["--draft", draft] if draft else [])
    assert cli_main(argv) == 0
    count = specjax.ray.run_job(prompts, tmp_path / "ray.jsonl", actors=2, block_rows=3,
                                model=str(tmp_path / "tiny.gguf"), **options)
    assert count == len(PROMPTS)
    expected, got = rows_of(tmp_path / "one.jsonl"), rows_of(tmp_path / "ray.jsonl")
    assert [{k: r[k] for k in COMPARED} for r in got] == [{k: r[k] for k in COMPARED} for r in expected]
    assert [sorted(r) for r in got] == [sorted(r) for r in expected]  # the same fields
    assert len({tuple(r["token_ids"]) for r in got}) > 1


def test_ray_cli_with_tree_and_quantize_writes_the_rows_of_one_process(tmp_path, tiny_model, local_ray):
    """--ray with --tree and --quantize int8 (greedy): the actors load the same quantized target
    and draft the same tree, so the rows equal the one-process run's."""
    cfg, params = tiny_model
    write_gguf(tmp_path / "tiny.gguf", cfg, params)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": text}) + "\n"
                               for i, text in enumerate(PROMPTS[:4])))
    argv = ["generate", "--model", str(tmp_path / "tiny.gguf"), "--prompts", str(prompts),
            "--max-new-tokens", "5", "--batch-size", "2", "--no-chat", "--draft", "ngram",
            "--tree", "kary_2x2x2", "--quantize", "int8"]
    assert cli_main(argv + ["--out", str(tmp_path / "one.jsonl")]) == 0
    assert cli_main(argv + ["--out", str(tmp_path / "ray.jsonl"), "--ray", "2"]) == 0
    expected, got = rows_of(tmp_path / "one.jsonl"), rows_of(tmp_path / "ray.jsonl")
    keys = ("id", "prompt", "token_ids", "completion", "stop_reason", "spec")  # spec: the tree's depths
    assert [{k: r[k] for k in keys} for r in got] == [{k: r[k] for k in keys} for r in expected]


def test_ray_option_needs_a_prompt_file_and_a_new_out(capsys):
    assert cli_main(["generate", "--prompt", "hi", "--ray", "2"]) == 2
    assert "--ray runs a --prompts file into a new --out" in capsys.readouterr().err
