"""Drafter training infrastructure: data format and order, orbax checkpoints, exact resume.

All runs share one TrainConfig (it is a static argument of the jitted step), so the step
compiles once for the module.
"""
from __future__ import annotations

import jax
import numpy as np
import pytest
from helpers import tiny_config

from specjax.drafters.learned.checkpoint import load_trained
from specjax.drafters.learned.eagle3 import draft_vocabulary
from specjax.drafters.learned.registry import make_head_config
from specjax.models.llama import init_params
from specjax.train.data import Sequences, batch_indices, get_batch, response_mask, response_tokens
from specjax.train.trainer import (
    TrainConfig,
    checkpoint_manager,
    init_train_state,
    restore_state,
    save_state,
    train,
)

TC = TrainConfig(steps=6, batch_size=2, learning_rate=1e-2, save_every=2, keep=2, log_every=1)


@pytest.fixture(scope="module")
def setup():
    cfg = tiny_config(vocab_size=16)
    params = init_params(cfg, jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    rows = [(rng.integers(0, 16, 4).tolist(), rng.integers(0, 16, rng.integers(3, 8)).tolist())
            for _ in range(5)]
    data = Sequences.from_rows(rows, seq_len=12, pad_id=0, meta={"note": "random"})
    head = make_head_config("eagle3", cfg, ttt_steps=2)
    return cfg, params, data, head


def leaves_equal(a, b) -> bool:
    return jax.tree.all(jax.tree.map(lambda x, y: bool(np.array_equal(np.asarray(x), np.asarray(y))), a, b))


def test_sequences_round_trip_and_masks(setup, tmp_path):
    _, _, data, _ = setup
    data.save(tmp_path / "data")
    back = Sequences.load(tmp_path / "data")
    for name in ("tokens", "lengths", "prompt_lens"):
        assert np.array_equal(getattr(back, name), getattr(data, name))
    assert back.meta["note"] == "random" and back.meta["seq_len"] == 12
    mask = response_mask(data.lengths, data.prompt_lens, data.seq_len)
    assert mask.sum() == int(np.sum(data.lengths - data.prompt_lens))
    assert not mask[:, :4].any()


def test_batch_order_is_a_function_of_seed_and_step(setup):
    _, _, data, _ = setup
    a = get_batch(data, 3, seed=7, step=4)
    b = get_batch(data, 3, seed=7, step=4)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    # an epoch visits every item once; another seed orders them differently
    first_epoch = np.concatenate([batch_indices(10, 5, 1, s) for s in range(2)])
    assert sorted(first_epoch.tolist()) == list(range(10))
    other = np.concatenate([batch_indices(10, 5, 2, s) for s in range(2)])
    assert first_epoch.tolist() != other.tolist()


def test_draft_vocabulary_keeps_the_most_frequent_response_tokens():
    rows = [([9, 9, 9], [3, 3, 3, 5]), ([9], [3, 5, 7])]
    data = Sequences.from_rows(rows, seq_len=8)
    tokens = response_tokens(data)
    assert draft_vocabulary(tokens, 16, 2).tolist() == [3, 5]  # 9 is prompt-only
    assert draft_vocabulary(tokens, 16, 4).tolist() == [0, 3, 5, 7]  # topped up with unused ids


def test_checkpoint_round_trip_is_exact(setup, tmp_path):
    _cfg, _, _, head = setup
    state = init_train_state(head, TC)
    state = state.replace(step=state.step + 3)
    mngr = checkpoint_manager(tmp_path, TC)
    save_state(mngr, state, force=True)
    mngr.wait_until_finished()
    fresh = init_train_state(head, TC.__class__(**{**TC.__dict__, "seed": 1}))
    assert not leaves_equal(fresh.params, state.params)
    back = restore_state(mngr, fresh)
    mngr.close()
    assert int(back.step) == 3 and leaves_equal(back, state)


def test_killed_and_resumed_run_equals_uninterrupted(setup, tmp_path):
    cfg, params, data, head = setup
    full, log = train(head, params, data, TC, tmp_path / "full", progress=False)
    assert int(full.step) == TC.steps and len(log) == TC.steps
    # "killed" after step 5: the last checkpoint is step 4, so step 5 is redone on resume
    part, _ = train(head, params, data, TC, tmp_path / "part", stop_after=5, progress=False)
    assert int(part.step) == 5
    with pytest.raises(ValueError, match="resume"):
        train(head, params, data, TC, tmp_path / "part", progress=False)
    resumed, _ = train(head, params, data, TC, tmp_path / "part", resume=True, progress=False)
    assert leaves_equal(resumed, full)
    kept = sorted(int(p.name) for p in (tmp_path / "part" / "checkpoints").iterdir() if p.name.isdigit())
    assert kept == [4, 6]  # keep-last-2
    head_back, variables = load_trained(tmp_path / "part", cfg)
    assert head_back == head and leaves_equal(variables, full.variables)


def test_cli_train_drafter_then_generate_with_it(tmp_path):
    """`specjax train-drafter` on a tiny HF checkpoint (then refused / resumed on the same
    OUT), then `generate --draft eagle3:OUT` reproduces plain greedy output."""
    import json

    from helpers import tiny_vocab, write_hf

    from specjax.cli import main

    cfg = tiny_config(vocab_size=len(tiny_vocab()[0]))
    model_dir = str(write_hf(tmp_path / "tiny", cfg, init_params(cfg, jax.random.PRNGKey(0))))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("hi there", "a cat", "ok")))
    out = tmp_path / "run"
    common = ["train-drafter", "--model", model_dir, "--kind", "eagle3", "--prompts", str(prompts),
              "--batch-size", "2", "--out", str(out), "--seq-len", "48", "--max-new-tokens", "8",
              "--depth", "2", "--draft-vocab", "40", "--save-every", "2", "--gen-batch-size", "4"]
    assert main([*common, "--steps", "4"]) == 0
    assert main([*common, "--steps", "4"]) == 2  # OUT holds checkpoints: needs --resume
    assert main([*common, "--steps", "4", "--resume"]) == 0  # already done: nothing to run
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [4]
    kept = {int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit()}
    assert {2, 4} <= kept and max(kept) == 4
    gen = ["generate", "--model", model_dir, "--prompts", str(prompts), "--max-new-tokens", "6",
           "--batch-size", "4"]
    assert main([*gen, "--out", str(tmp_path / "plain.jsonl")]) == 0
    assert main([*gen, "--out", str(tmp_path / "spec.jsonl"), "--draft", f"eagle3:{out}",
                 "--num-draft", "2"]) == 0
    read = lambda p: [json.loads(x) for x in p.read_text().splitlines()]
    plain, spec = read(tmp_path / "plain.jsonl"), read(tmp_path / "spec.jsonl")
    assert [r["token_ids"] for r in spec] == [r["token_ids"] for r in plain]
    assert all("spec" in r for r in spec)
