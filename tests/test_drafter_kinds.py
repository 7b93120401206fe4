"""The learned-drafter kinds are records: each is consistent, documented, and a new kind is one
record plus one registry line (training options, head config, init and drafter follow)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import pytest
from helpers import tiny_config

from specjax.cli.main import build_parser
from specjax.drafters.learned import medusa, registry
from specjax.drafters.learned.registry import (
    KINDS,
    get_kind,
    init_head,
    make_head_config,
    make_learned_drafter,
)
from specjax.tree import chain

DOCS = Path(__file__).resolve().parents[1] / "docs" / "drafters.md"


@pytest.mark.parametrize("name", list(KINDS))
def test_each_record_names_its_own_config_and_is_documented(name):
    kind = KINDS[name]
    cfg = tiny_config(vocab_size=16)
    head = make_head_config(name, cfg)
    assert type(head) is kind.config and head.kind == name
    assert kind.drafter(tree=chain(1), head=head).name == name
    assert kind.drafter.module_class is kind.model  # the drafter runs the record's module
    assert f"`{name}`" in DOCS.read_text()


def test_an_unknown_kind_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown learned drafter kind 'nope'; choose from \['eagle3'"):
        get_kind("nope")


def test_a_new_kind_is_one_record_and_one_registry_line(monkeypatch):
    @dataclasses.dataclass(frozen=True)
    class ToyConfig(medusa.MedusaConfig):
        kind: str = "toy"

    toy = dataclasses.replace(medusa.KIND, name="toy", config=ToyConfig)
    monkeypatch.setitem(registry.KINDS, "toy", toy)  # the registry line
    cfg = tiny_config(vocab_size=16)
    head = make_head_config("toy", cfg, num_heads=2)
    variables = init_head(head, jax.random.PRNGKey(0))
    assert set(variables["params"]) == {"head_0_0", "head_1_0"}
    assert make_learned_drafter(head, chain(2)).name == "toy"
    args = build_parser().parse_args(["train-drafter", "--kind", "toy", "--prompts", "p.jsonl",
                                      "--steps", "1", "--out", "o", "--depth", "2"])
    assert args.kind == "toy" and args.depth == 2
