"""The learned-drafter kinds by name (one line per kind), and what is done with a kind's record.

Adding a kind: a module defining `KIND = HeadKind(...)` (see `kind.py`) and one line in
`KINDS` below; training, the `train-drafter` options, the `KIND:DIR` drafter spec and the
upstream import/export then know it.
"""
from __future__ import annotations

import dataclasses

import jax

from specjax.drafters.learned import dflash, dspark, eagle3, medusa, mtp
from specjax.drafters.learned.kind import HeadKind, HeadOption
from specjax.models.config import ModelConfig, RopeScaling
from specjax.tree import TreeSpec

KINDS: dict[str, HeadKind] = {kind.name: kind for kind in (
    eagle3.KIND,
    mtp.KIND,
    medusa.KIND,
    dflash.KIND,
    dspark.KIND,
)}


def get_kind(name: str) -> HeadKind:
    """The record of kind `name`; an unknown name -> ValueError listing the known ones."""
    try:
        return KINDS[name]
    except KeyError:
        raise ValueError(f"unknown learned drafter kind {name!r}; choose from {list(KINDS)}") from None


def kind_of(head_cfg) -> HeadKind:
    """The record of a head config (by its `kind` field)."""
    return get_kind(head_cfg.kind)


def make_head_config(kind: str, target: ModelConfig, **options):
    """A head config of `kind` for `target` (options: the config class's `for_target` args)."""
    return get_kind(kind).config.for_target(target, **options)


def init_head(head_cfg, key: jax.Array, consts: dict | None = None) -> dict:
    """Random variables `{"params", "consts"}` of any head config (consts: overrides)."""
    return kind_of(head_cfg).init(head_cfg, key, consts)


def init_from_target(head_cfg, variables: dict, target_params) -> dict:
    """Variables whose output side starts from the target's (the kind's `init_from_target`;
    unchanged for kinds without one)."""
    start = kind_of(head_cfg).init_from_target
    return variables if start is None else start(head_cfg, variables, target_params)


def make_learned_drafter(head_cfg, tree: TreeSpec, **options):
    """The drafter of a head config over a static tree (options: the drafter class's fields)."""
    return kind_of(head_cfg).drafter(tree=tree, head=head_cfg, **options)


def option_flags() -> dict[str, list[tuple[str, HeadOption]]]:
    """{flag: [(kind name, option)]}: every `train-drafter` head option and the kinds taking it."""
    flags: dict[str, list[tuple[str, HeadOption]]] = {}
    for kind in KINDS.values():
        for option in kind.options:
            flags.setdefault(option.flag, []).append((kind.name, option))
    return flags


def upstream_formats() -> dict[str, HeadKind]:
    """{export format name: kind} of the kinds with an upstream layout."""
    return {kind.upstream.format: kind for kind in KINDS.values() if kind.upstream}


# ---- head config <-> JSON (drafter.json) ---------------------------------------------------------


def model_config_from_dict(d: dict) -> ModelConfig:
    """A ModelConfig from its `dataclasses.asdict` (JSON lists back to tuples)."""
    d = dict(d)
    if d.get("rope_scaling") is not None:
        d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
    d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
    return ModelConfig(**d)


def head_config_to_dict(head_cfg) -> dict:
    """JSON-able description of a head config (the target itself is not stored)."""
    out = {}
    for f in dataclasses.fields(head_cfg):
        value = getattr(head_cfg, f.name)
        if f.name == "target":
            out["target_name"] = value.name
            continue
        out[f.name] = dataclasses.asdict(value) if isinstance(value, ModelConfig) else value
    return out


def head_config_from_dict(d: dict, target: ModelConfig):
    """Inverse of head_config_to_dict for the given target config."""
    cls = get_kind(d["kind"]).config
    kwargs = {"target": target}
    for f in dataclasses.fields(cls):
        if f.name == "target" or f.name not in d:
            continue
        value = d[f.name]
        if isinstance(value, dict) and "hidden_size" in value:
            value = model_config_from_dict(value).replace(dtype=target.dtype,
                                                           attention_impl=target.attention_impl)
        elif isinstance(value, list):
            value = tuple(value)
        kwargs[f.name] = value
    return cls(**kwargs)
