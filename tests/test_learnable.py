"""The learnable setting (`specjax.train.synthetic`, `specjax.train.target_lm`), starting a
drafter run from an earlier drafter (`trainer.load_init`, `train-drafter --init-from`), and the
smoke run of benchmarks/learnable_drafters.py."""
from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import load_benchmark, tiny_config

from specjax.cli import main
from specjax.drafters.learned.registry import make_head_config
from specjax.models.cache import init_cache
from specjax.models.llama import forward, init_params
from specjax.train import synthetic
from specjax.train.data import Sequences
from specjax.train.trainer import TrainConfig, check_shapes, load_init, train

# ---- the corpus ---------------------------------------------------------------------------------


def test_documents_follow_their_rules():
    """Counts continue by the stated stride across clauses, days follow each other, names keep
    their world's adjective, the clause cycle is the world's."""
    for world in (synthetic.World(0), synthetic.World(1)):
        for doc in synthetic.documents(world, 30, 96, seed=3):
            words = list(doc.words)
            stride = synthetic.STRIDES[words[2]]
            numbers = [int(w) for w in words if w.isdigit()]
            assert all((b - a) % 100 == stride for a, b in zip(numbers, numbers[1:]))
            days = [synthetic.DAYS.index(w) for w in words if w in synthetic.DAYS]
            assert all((b - a) % 7 == 1 for a, b in zip(days, days[1:]))
            for i, w in enumerate(words[:-2]):
                if w in synthetic.NAMES and words[i + 1] == "is":
                    adjective = synthetic.ADJECTIVES[world.adjective[synthetic.NAMES.index(w)]]
                    assert words[i + 2] == adjective
            starts = [words[i + 1] for i, w in enumerate(words[:-1]) if w == "."][1:]
            kinds = ["count" if s == "count" else "on" if s == "on" else "is" for s in starts]
            cycle = world.cycle
            assert all(cycle[(cycle.index(a) + 1) % 3] == b for a, b in zip(kinds, kinds[1:]))
            assert len(words) >= 96 and doc.ids == synthetic.encode(words)


def test_log_prob_counts_every_choice():
    """A document of the one-clause-kind world: its log-prob is the sum of its choices'."""
    world = synthetic.World(0)
    doc = synthetic.documents(world, 1, 5, seed=0)[0]  # header + one clause
    words = doc.words
    expected = -math.log(2) - math.log(100) - math.log(7) - math.log(3)  # stride, c, day, clause
    if words[4] == "count":
        expected -= math.log(4)
    elif words[4] == "on":
        verb, noun = synthetic.VERBS.index(words[7]), synthetic.NOUNS.index(words[9])
        expected += -math.log(12) - math.log(8) + math.log(world.noun_probs(verb)[noun])
    else:
        expected -= 2 * math.log(12)
    assert doc.log_prob == pytest.approx(expected)
    entropy = synthetic.entropy_per_token(synthetic.documents(world, 300, 96, seed=1))
    assert 0.3 < entropy < 0.8  # nats per token (docs/drafters.md quotes the 2000-document value)


def test_shifted_world_differs():
    a, b = synthetic.World(0), synthetic.World(1)
    assert a.cycle != b.cycle and a.adjective != b.adjective and a.favourite_noun != b.favourite_noun


def test_saved_target_loads_through_load_model(tmp_path):
    """save_hf + write_tokenizer make a folder `load_model` opens with the same logits, and
    its tokenizer encodes the corpus words as the corpus ids."""
    from specjax.models.hub import load_model
    from specjax.train.target_lm import LMConfig, save_hf, synthetic_target_config, train_lm

    cfg = synthetic_target_config(len(synthetic.VOCAB), hidden=32, layers=2, heads=2, kv_heads=1)
    windows = synthetic.token_windows(synthetic.documents(synthetic.World(0), 8, 24, 0), 24)
    params = init_params(cfg, jax.random.PRNGKey(0))
    params, log = train_lm(cfg, params, windows, LMConfig(steps=3, batch_size=4, log_every=1))
    assert [r["step"] for r in log] == [1, 2, 3] and all(np.isfinite(r["loss"]) for r in log)
    save_hf(tmp_path / "t", cfg, params)
    synthetic.write_tokenizer(tmp_path / "t")
    model = load_model(tmp_path / "t")
    assert model.cfg.vocab_size == cfg.vocab_size and model.cfg.eos_token_ids == (synthetic.EOS,)
    tokens = jnp.asarray(windows[:2])
    pos = jnp.broadcast_to(jnp.arange(24), (2, 24))
    ours = forward(cfg, params, tokens, pos, init_cache(cfg, 2, 24)).logits
    loaded = forward(model.cfg, model.params, tokens, pos, init_cache(model.cfg, 2, 24)).logits
    np.testing.assert_allclose(np.asarray(loaded), np.asarray(ours), atol=1e-5)
    doc = synthetic.documents(synthetic.World(0), 1, 24, 0)[0]
    assert model.tokenizer.encode(" ".join(doc.words[1:])) == doc.ids[1:]
    assert model.tokenizer.encode_chat("count 3 4") == synthetic.encode(["count", "3", "4"])


# ---- starting from an earlier drafter -----------------------------------------------------------

TC = TrainConfig(steps=2, batch_size=2, learning_rate=1e-2, save_every=2, keep=1, log_every=1)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(cfg, params, data, folder of a 2-step eagle3 head with a reduced vocabulary)."""
    cfg = tiny_config(vocab_size=16)
    params = init_params(cfg, jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    rows = [(rng.integers(0, 16, 4).tolist(), rng.integers(0, 16, 6).tolist()) for _ in range(4)]
    data = Sequences.from_rows(rows, seq_len=12)
    folder = tmp_path_factory.mktemp("old")
    head = make_head_config("eagle3", cfg, ttt_steps=2, draft_vocab_size=12)
    ids = np.sort(rng.choice(16, 12, replace=False)).astype(np.int32)
    train(head, params, data, TC, folder, consts={"draft_to_target": ids}, progress=False)
    return cfg, params, data, folder, head


def leaves_equal(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_init_from_starts_at_the_old_drafter(trained, tmp_path):
    from specjax.drafters.learned.checkpoint import load_trained

    cfg, params, data, folder, head = trained
    head_back, start = load_init(folder, "eagle3", cfg)
    assert head_back == head
    _, old = load_trained(folder, cfg)
    assert leaves_equal(start, old)
    state, _ = train(head, params, data, TC, tmp_path / "new", init_variables=start, stop_after=0,
                     progress=False)
    assert leaves_equal(state.params, old["params"]) and leaves_equal(state.consts, old["consts"])
    assert int(state.step) == 0  # a new run: its own step count and optimizer state
    fresh, _ = train(head, params, data, TC, tmp_path / "fresh", stop_after=0, progress=False,
                     consts=old["consts"])
    assert not leaves_equal(fresh.params, old["params"])


def test_train_drafter_init_from_keeps_the_old_head_config(trained, tmp_path):
    from specjax.train.trainer import train_drafter

    cfg, params, data, folder, head = trained

    class Target:
        pass

    target = Target()
    target.cfg, target.params = cfg, params
    state, log = train_drafter(target, "eagle3", data, tmp_path / "re", TC, init_from=folder,
                               progress=False)
    assert log[-1]["step"] == 2
    desc = json.loads((tmp_path / "re" / "drafter.json").read_text())
    assert desc["head"]["draft_vocab_size"] == 12 and desc["head"]["ttt_steps"] == 2


@pytest.mark.parametrize("case", ["missing", "not_a_drafter", "kind", "target", "option"])
def test_init_from_errors_are_one_line(case, trained, tmp_path):
    cfg, _, _, folder, _ = trained
    kind, target_cfg, options = "eagle3", cfg, None
    if case == "missing":
        folder, want = tmp_path / "nope", "no such folder"
    elif case == "not_a_drafter":
        folder, want = tmp_path, "no drafter.json"
    elif case == "kind":
        kind, want = "dflash", "holds a eagle3 drafter, not dflash"
    elif case == "target":
        target_cfg, want = tiny_config(vocab_size=16, hidden_size=64), "hidden_size=32, this target has 64"
    else:
        options, want = {"draft_vocab_size": 10}, "draft_vocab_size=12 (asked 10)"
    with pytest.raises(ValueError) as info:
        load_init(folder, kind, target_cfg, options)
    message = str(info.value)
    assert want in message and "\n" not in message and str(folder) in message


def test_check_shapes_names_the_leaf(trained):
    from specjax.drafters.learned.checkpoint import load_trained

    cfg, _, _, folder, head = trained
    _, variables = load_trained(folder, cfg)
    check_shapes(head, variables)
    bad = jax.tree.map(lambda x: x, variables)
    bad["params"]["fc"]["kernel"] = np.zeros((3, 3), np.float32)
    with pytest.raises(ValueError, match=r"\['params'\]\['fc'\]\['kernel'\] has shape \(3, 3\)"):
        check_shapes(head, bad)


def test_cli_init_from_errors(trained, tmp_path, capsys):
    """A missing --init-from folder fails before any model loads; a kind mismatch after the
    target is loaded, before any data is generated; one error line each."""
    from helpers import tiny_vocab, write_hf

    cfg, _, _, folder, _ = trained
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    model_cfg = tiny_config(vocab_size=len(tiny_vocab()[0]))
    model_dir = write_hf(tmp_path / "m", model_cfg, init_params(model_cfg, jax.random.PRNGKey(0)))
    base = ["train-drafter", "--model", str(model_dir), "--prompts", str(prompts), "--steps", "1"]
    cases = [
        (["--kind", "eagle3", "--init-from", str(tmp_path / "none"), "--out", str(tmp_path / "o1")],
         "--init-from {}: no such folder".format(tmp_path / "none")),
        (["--kind", "eagle3", "--init-from", str(tmp_path), "--out", str(tmp_path / "o2")],
         "no drafter.json"),
        (["--kind", "dflash", "--init-from", str(folder), "--out", str(tmp_path / "o3")],
         "holds a eagle3 drafter, not dflash"),
    ]
    for extra, want in cases:
        assert main([*base, *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert ": error: " in err[-1] and want in err[-1], err
        assert not any("Traceback" in line for line in err)
    assert not (tmp_path / "o3" / "data").exists()


# ---- the benchmark's smoke run ------------------------------------------------------------------


@pytest.mark.slow
def test_learnable_drafters_smoke(tmp_path):
    """The whole pipeline at tiny budgets: every row kind is written, the self-drafting bound is
    exactly D + 1 (the harness measures acceptance right), realignment rows for both starts."""
    bench = load_benchmark("learnable_drafters")
    assert bench.main(["--smoke", "--out", str(tmp_path), "--no-plot"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    what = {r["what"] for r in rows}
    assert {"target", "bound", "drafter", "total"} <= what
    selfs = [r for r in rows if r["what"] == "bound" and r["drafter"] == "target-self"]
    assert selfs and all(r["al"] == pytest.approx(r["depth"] + 1) for r in selfs)
    phases = {(r["kind"], r["phase"]) for r in rows if r["what"] == "drafter"}
    for kind in ("eagle3", "dflash"):
        assert {(kind, p) for p in ("base", "stale", "init_from", "scratch")} <= phases
    assert (tmp_path / "summary.md").exists() and (tmp_path / "target" / "tokenizer.json").exists()
