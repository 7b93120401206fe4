"""`specjax train-drafter` folder hygiene (issue 12, item 4): data staged and committed only on
success, a non-empty or unusable --out refused before the target loads, metrics that continue
across a resume, corrupt files named, numeric options refused up front."""
from __future__ import annotations

import json
import types

import jax
import numpy as np
import pytest
from helpers import tiny_config

import specjax.models.hub
import specjax.train.data
from specjax.cli import main
from specjax.drafters.learned.checkpoint import load_trained
from specjax.drafters.learned.registry import make_head_config
from specjax.models.llama import init_params
from specjax.train.data import Sequences, get_batch, tokens_before
from specjax.train.trainer import (
    STAGING_DIR,
    TrainConfig,
    keep_metrics_until,
    metric_lines_until,
    prepare_data,
    train,
)

TC = TrainConfig(steps=6, batch_size=2, learning_rate=1e-2, save_every=2, keep=2, log_every=1)
DISTILL = {"seq_len": 12, "max_new_tokens": 4, "temperature": 0.0, "seed": 0, "batch_size": 2,
           "progress": False}


def random_rows(n: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    rng = np.random.default_rng(seed)
    return [(rng.integers(2, 16, 4).tolist(), rng.integers(2, 16, rng.integers(3, 8)).tolist())
            for _ in range(n)]


@pytest.fixture(scope="module")
def setup():
    cfg = tiny_config(vocab_size=16)
    params = init_params(cfg, jax.random.PRNGKey(0))
    data = Sequences.from_rows(random_rows(5), seq_len=12, pad_id=0)
    return cfg, params, data, make_head_config("eagle3", cfg, ttt_steps=2)


@pytest.fixture
def fake_target():
    """A target whose self-distillation is a stub (`distilled`): no generation is compiled."""
    return types.SimpleNamespace(cfg=tiny_config(vocab_size=16), params=None)


def distilled(rows):
    def stub(cfg, params, prompts, **kw):
        return Sequences.from_rows(rows, kw["seq_len"], cfg.pad_token_id, {"generated_by": cfg.name})
    return stub


def failing(cfg, params, prompts, **kw):
    raise RuntimeError("generation died")


def read_metrics(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ---------------------------------------------------------------------------------------------
# Staged data
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("broken, message", [
    (failing, "generation died"),
    (distilled([([3, 4], [])]), "no response tokens"),  # the target ended every prompt at once
    (distilled([([3, 99], [5])]), "outside"),  # ids beyond the vocabulary
])
def test_failed_data_generation_leaves_nothing_and_a_rerun_regenerates(
        broken, message, fake_target, tmp_path, monkeypatch):
    out = tmp_path / "run"
    killed = out / STAGING_DIR  # a killed earlier run's complete-looking staging folder
    Sequences.from_rows(random_rows(2, seed=9), seq_len=12).save(killed)
    monkeypatch.setattr(specjax.train.data, "self_distill", broken)
    with pytest.raises((RuntimeError, ValueError), match=message):
        prepare_data(fake_target, [[3, 4]], out, **DISTILL)
    assert sorted(p.name for p in out.iterdir()) == []  # neither data/ nor the staging folder
    rows = random_rows(3)
    monkeypatch.setattr(specjax.train.data, "self_distill", distilled(rows))
    data = prepare_data(fake_target, [[3, 4]], out, **DISTILL)
    assert sorted(p.name for p in out.iterdir()) == ["data"]
    expected = Sequences.from_rows(rows, seq_len=12)
    assert np.array_equal(data.tokens, expected.tokens)
    assert np.array_equal(Sequences.load(out / "data").tokens, expected.tokens)


def test_reused_data_must_match_the_request(fake_target, tmp_path, monkeypatch):
    monkeypatch.setattr(specjax.train.data, "self_distill", distilled(random_rows(3)))
    prepare_data(fake_target, [[3, 4]], tmp_path, **DISTILL)
    monkeypatch.setattr(specjax.train.data, "self_distill", failing)  # reuse: never called
    assert prepare_data(fake_target, [[3, 4]], tmp_path, **DISTILL).num_sequences == 3
    for change in ({"max_new_tokens": 5}, {"seq_len": 10}):
        with pytest.raises(ValueError, match=rf"meta\.json.*{next(iter(change))}"):
            prepare_data(fake_target, [[3, 4]], tmp_path, **{**DISTILL, **change})
    with pytest.raises(ValueError, match="prompts_sha256"):
        prepare_data(fake_target, [[3, 5]], tmp_path, **DISTILL)


# ---------------------------------------------------------------------------------------------
# Corrupt files
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, content, message", [
    ("meta.json", '{"format": "specjax-distill-v1", "seq', "not valid JSON"),
    ("meta.json", "[1, 2]", "expected a JSON object"),
    ("meta.json", b"\xff\xfe{", "cannot read"),
    ("meta.json", '{"format": "other"}', "not a specjax-distill-v1"),
    ("sequences.npz", b"PK\x03\x04 torn", "not readable"),
])
def test_corrupt_data_files_are_named(name, content, message, setup, tmp_path):
    folder = tmp_path / "data"
    setup[2].save(folder)
    write = (folder / name).write_bytes if isinstance(content, bytes) else (folder / name).write_text
    write(content)
    with pytest.raises(ValueError, match=message) as err:
        Sequences.load(folder)
    assert str(folder / name) in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("content, message", [
    ("{", "not valid JSON"),
    ('{"kind": "eagle3"}', "no valid head, train"),
    ('{"kind": "eagle3", "head": {"kind": "eagle3"}, "train": {"stepz": 2}}', "unusable"),
])
def test_corrupt_drafter_json_is_named(content, message, setup, tmp_path):
    (tmp_path / "drafter.json").write_text(content)
    with pytest.raises(ValueError, match=message) as err:
        load_trained(tmp_path, setup[0])
    assert str(tmp_path / "drafter.json") in str(err.value)


# ---------------------------------------------------------------------------------------------
# Metrics across a resume
# ---------------------------------------------------------------------------------------------


def test_tokens_before_counts_every_earlier_batch(setup):
    data = setup[2]
    total = 0
    for step in range(9):  # batches of 2 over 5 items: crosses epochs mid-batch
        assert tokens_before(data, 2, 7, step) == total
        total += int(get_batch(data, 2, 7, step)["lengths"].sum())


def test_metric_lines_until_drops_later_and_unreadable_rows():
    lines = ['{"step": 1}', '{"step": 2}', "not json", "", '{"nostep": 1}', '{"step": 3}',
             '{"step": 4, "lo']
    assert metric_lines_until(lines, 2) == (['{"step": 1}', '{"step": 2}'], 3)


def test_keep_metrics_until_ends_an_unterminated_last_row(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}')  # killed between the row and its newline
    keep_metrics_until(path, 5)
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'


def test_metrics_continue_after_a_resume(setup, tmp_path, capsys):
    _, params, data, head = setup
    _, full_log = train(head, params, data, TC, tmp_path / "full", progress=False)
    # "killed" after step 5, mid-write of a row: the last checkpoint is step 4
    train(head, params, data, TC, tmp_path / "part", stop_after=5, progress=False)
    metrics = tmp_path / "part" / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + '{"step": 6, "lo')
    train(head, params, data, TC, tmp_path / "part", resume=True, progress=False)
    assert "dropped 1 unreadable line" in capsys.readouterr().err
    rows = read_metrics(metrics)
    assert [r["step"] for r in rows] == list(range(1, TC.steps + 1))
    assert [r["tokens"] for r in rows] == [r["tokens"] for r in full_log]
    assert [r["loss"] for r in rows] == [r["loss"] for r in full_log]


# ---------------------------------------------------------------------------------------------
# The command: refusals before the target loads, and a rerun after a failed one
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def no_model_load(monkeypatch):
    """Loading a model fails the test: the refusal must come before it."""
    def load_model(*args, **kwargs):
        raise AssertionError("the target was loaded")
    monkeypatch.setattr(specjax.models.hub, "load_model", load_model)


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("hi there", "a cat", "ok")))
    return path


def train_argv(prompts, out, *extra) -> list[str]:
    return ["train-drafter", "--kind", "eagle3", "--prompts", str(prompts), "--steps", "2",
            "--out", str(out), *extra]


def test_out_a_file_or_under_one_is_refused_before_loading(no_model_load, prompts, tmp_path, capsys):
    a_file = tmp_path / "taken"
    a_file.write_text("x")
    for out, message in ((a_file, "is a file, not a folder"), (a_file / "sub", "cannot write")):
        assert main(train_argv(prompts, out)) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and str(out) in err and "\n" not in err


def test_a_non_empty_out_needs_resume(no_model_load, prompts, tmp_path, capsys):
    out = tmp_path / "run"
    (out / "data").mkdir(parents=True)
    assert main(train_argv(prompts, out)) == 2
    err = capsys.readouterr().err
    assert str(out) in err and "not empty" in err and "--resume" in err
    # a killed run's staging folder alone does not make OUT non-empty (it would be regenerated)
    (out / "data").rmdir()
    (out / STAGING_DIR).mkdir()
    with pytest.raises(AssertionError, match="the target was loaded"):
        main(train_argv(prompts, out))


@pytest.mark.parametrize("extra, option", [
    (["--steps", "0"], "--steps"),
    (["--batch-size", "-1"], "--batch-size"),
    (["--lr", "nan"], "--lr"),
    (["--lr", "0"], "--lr"),
    (["--lr", "inf"], "--lr"),
    (["--gen-temperature", "-0.5"], "--gen-temperature"),
    (["--gen-temperature", "nan"], "--gen-temperature"),
    (["--warmup", "-1"], "--warmup"),
    (["--seed", "-3"], "--seed"),
    (["--save-every", "0"], "--save-every"),
    (["--keep", "0"], "--keep"),
    (["--seq-len", "1"], "--seq-len"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--num-prompts", "0"], "--num-prompts"),
    (["--gen-batch-size", "0"], "--gen-batch-size"),
    (["--depth", "0"], "--depth"),
    (["--draft-vocab", "0"], "--draft-vocab"),
    (["--steps", "2.5"], "--steps"),
])
def test_bad_numbers_are_refused_by_the_parser(extra, option, no_model_load, prompts, tmp_path,
                                                capsys):
    with pytest.raises(SystemExit) as exit_:
        main(train_argv(prompts, tmp_path / "run", *extra))
    assert exit_.value.code == 2 and f"argument {option}" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("extra, message", [
    (["--warmup", "2"], "--warmup 2 must be below --steps 2"),
    (["--block-size", "4"], "--block-size does not apply to --kind eagle3"),
])
def test_options_that_disagree_are_refused_before_loading(extra, message, no_model_load, prompts,
                                                          tmp_path, capsys):
    assert main(train_argv(prompts, tmp_path / "run", *extra)) == 2
    assert message in capsys.readouterr().err


def test_cli_rerun_after_a_failed_run_regenerates_and_trains(prompts, tmp_path, monkeypatch):
    """A run that fails in the data checks leaves OUT empty; the same command then succeeds
    without --resume, on freshly generated data."""
    from helpers import tiny_vocab, write_hf

    import specjax.train.trainer

    cfg = tiny_config(vocab_size=len(tiny_vocab()[0]))
    model_dir = write_hf(tmp_path / "tiny", cfg, init_params(cfg, jax.random.PRNGKey(0)))
    out = tmp_path / "run"
    argv = train_argv(prompts, out, "--model", str(model_dir), "--batch-size", "2",
                      "--seq-len", "24", "--max-new-tokens", "4", "--depth", "1",
                      "--gen-batch-size", "4")

    def check_fails(data, vocab_size, where):
        raise ValueError(f"{where}: check failed")

    with monkeypatch.context() as m:
        m.setattr(specjax.train.trainer, "check_distilled", check_fails)
        assert main(argv) == 2
    assert list(out.iterdir()) == []
    assert main(argv) == 0
    assert {"data", "drafter.json", "metrics.jsonl", "checkpoints"} <= {p.name for p in out.iterdir()}
    assert not (out / STAGING_DIR).exists()
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [2]


def test_seq_len_past_the_targets_context_is_refused_before_generating(prompts, tmp_path, capsys):
    from helpers import tiny_vocab, write_hf

    cfg = tiny_config(vocab_size=len(tiny_vocab()[0]), max_position_embeddings=32)
    model_dir = write_hf(tmp_path / "tiny", cfg, init_params(cfg, jax.random.PRNGKey(0)))
    out = tmp_path / "run"
    argv = train_argv(prompts, out, "--model", str(model_dir), "--seq-len", "64")
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "--seq-len 64" in err and "32 positions" in err and "\n" not in err
    assert list(out.iterdir()) == []
