"""`specjax export-drafter`: a trained head written in its upstream Hugging Face layout reads
back with specjax's upstream importer as the same head (identical logits), and its config.json
is one transformers' AutoConfig loads (when transformers is installed)."""
from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from helpers import tiny_config

from specjax.cli.main import main
from specjax.drafters.learned.checkpoint import load_trained
from specjax.drafters.learned.hf import load_upstream
from specjax.drafters.learned.registry import get_kind, make_head_config
from specjax.models.llama import init_params
from specjax.train.trainer import (
    TrainConfig,
    checkpoint_manager,
    init_train_state,
    save_state,
    write_description,
)

VOCAB = 16
TC = TrainConfig(steps=1)
HEADS = {  # format -> (kind, head options, consts)
    "eagle3-hf": ("eagle3", {"draft_vocab_size": 12, "ttt_steps": 2},
                  {"draft_to_target": np.sort(np.random.default_rng(0).choice(VOCAB, 12, replace=False))}),
    "dflash-hf": ("dflash", {"num_draft_layers": 2, "block_size": 4, "mask_token_id": 3}, None),
}


@pytest.fixture(scope="module")
def target():
    cfg = tiny_config(vocab_size=VOCAB)
    return cfg, init_params(cfg, jax.random.PRNGKey(0))


def write_trained(folder, head, consts, seed=7):
    """A `train-drafter` output folder holding random head params (one checkpoint)."""
    state = init_train_state(head, TrainConfig(steps=1, seed=seed), consts)
    mngr = checkpoint_manager(folder, TC)
    save_state(mngr, state, force=True)
    mngr.wait_until_finished()
    mngr.close()
    write_description(folder, head, TC, {})
    return state.variables


def head_logits(head, variables, cfg, seed=1):
    """The head module's output on random features and embeddings (`[1, T, ...]`)."""
    rng = np.random.default_rng(seed)
    seq = 5
    feats = tuple(rng.normal(size=(1, seq, cfg.hidden_size)).astype(np.float32)
                  for _ in head.hidden_layers)
    emb = rng.normal(size=(1, seq, cfg.hidden_size)).astype(np.float32)
    model = get_kind(head.kind).model(head)
    return np.asarray(model.apply(variables, feats, emb, np.arange(seq)[None]))


def same_drafting_config(a, b) -> bool:
    """Upstream layouts carry no training knobs (ttt_steps, loss weights, anchors): the heads
    agree on everything that drafts."""
    drafting = ("layer", "feature_layers", "draft_vocab_size", "block_size", "mask_token_id", "target")
    return all(getattr(a, f, None) == getattr(b, f, None) for f in drafting)


@pytest.mark.parametrize("fmt", sorted(HEADS))
def test_exported_head_reads_back_identical(fmt, target, tmp_path):
    cfg, _ = target
    kind, options, consts = HEADS[fmt]
    head = make_head_config(kind, cfg, **options)
    write_trained(tmp_path / "run", head, consts)
    assert main(["export-drafter", "--format", fmt, str(tmp_path / "run"), str(tmp_path / "hf")]) == 0

    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "llama" and config["hidden_act"] == "silu"
    assert config["torch_dtype"] == "float32" and config["vocab_size"] == VOCAB
    assert config["hidden_size"] == cfg.hidden_size and config["num_hidden_layers"] == head.layer.num_layers
    if kind == "eagle3":
        assert config["architectures"] == ["LlamaForCausalLMEagle3"]
        assert config["draft_vocab_size"] == 12
        assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in head.feature_layers]

    head_back, back = load_upstream(kind, tmp_path / "hf", cfg)
    _, trained = load_trained(tmp_path / "run", cfg)
    assert same_drafting_config(head_back, head)
    assert np.array_equal(head_logits(head_back, back, cfg), head_logits(head, trained, cfg))


def test_exported_config_loads_with_transformers(target, tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg, _ = target
    kind, options, consts = HEADS["eagle3-hf"]
    write_trained(tmp_path / "run", make_head_config(kind, cfg, **options), consts)
    assert main(["export-drafter", "--format", "eagle3-hf", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    loaded = transformers.AutoConfig.from_pretrained(str(tmp_path / "hf"))
    assert loaded.model_type == "llama" and loaded.hidden_size == cfg.hidden_size
    assert loaded.draft_vocab_size == 12 and loaded.num_hidden_layers == 1


def test_export_refusals_name_the_problem(target, tmp_path, capsys):
    cfg, _ = target
    write_trained(tmp_path / "mtp", make_head_config("mtp", cfg, ttt_steps=2), None)
    out = str(tmp_path / "hf")
    assert main(["export-drafter", "--format", "eagle3-hf", str(tmp_path / "mtp"), out]) == 2
    assert "holds a mtp drafter; eagle3-hf exports eagle3" in capsys.readouterr().err
    assert main(["export-drafter", "--format", "eagle3-hf", str(tmp_path), out]) == 2
    assert f"{tmp_path}: no drafter.json" in capsys.readouterr().err
    # a drafter.json written before it recorded the target's config needs --model
    kind, options, consts = HEADS["eagle3-hf"]
    write_trained(tmp_path / "old", make_head_config(kind, cfg, **options), consts)
    desc_path = tmp_path / "old" / "drafter.json"
    desc = json.loads(desc_path.read_text())
    del desc["target_config"]
    desc_path.write_text(json.dumps(desc))
    assert main(["export-drafter", "--format", "eagle3-hf", str(tmp_path / "old"), out]) == 2
    assert "records no target_config" in capsys.readouterr().err
