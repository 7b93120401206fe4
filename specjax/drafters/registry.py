"""Drafters by name: `drafter, drafter_params = make_drafter(spec, tree=..., target=...)`.

Specs (`NAME` or `NAME:ARG`):

    ngram | ngram:N | ngram:A-B        prompt lookup, match lengths 1..N or A..B (default 1-3)
    suffix | suffix:N | suffix:A-B     suffix decoding, context orders 1..N or A..B (default 1-6)
    layerskip:K                        the target's first K layers + final norm + LM head
    model:NAME_OR_PATH                 a Llama-family draft model with the target's tokenizer,
                                       loaded by `specjax.models.hub.load_model`
    forced:PROFILE                     measurement only, not lossless (`drafters.forced`)
    eagle3:DIR | mtp:DIR | medusa:DIR  a learned head trained by `specjax train-drafter` (DIR
    dflash:DIR | dspark:DIR            = its output), or an upstream EAGLE-3 / DFlash HF folder

Other drafters join with `@register("name")` on a factory `(arg, DraftContext) -> (drafter,
drafter params)`.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from specjax.models.config import ModelConfig
from specjax.tree import TreeSpec

Factory = Callable[[str, "DraftContext"], tuple[Any, Any]]
FACTORIES: dict[str, Factory] = {}


@dataclasses.dataclass(frozen=True)
class DraftContext:
    """What a factory may use: the tree, the target (config, params, tokenizer or None), the
    dtype for loaded weights and the loader of `model:` (name_or_path, dtype) -> model."""

    tree: TreeSpec
    target_cfg: ModelConfig
    target_params: Any = None
    target_tokenizer: Any = None
    dtype: str = "float32"
    loader: Callable[[str, str], Any] | None = None


def register(name: str) -> Callable[[Factory], Factory]:
    def add(factory: Factory) -> Factory:
        FACTORIES[name] = factory
        return factory

    return add


def available_drafters() -> list[str]:
    return sorted(FACTORIES)


def parse_range(arg: str, default: tuple[int, int], what: str) -> tuple[int, int]:
    """"" -> default, "N" -> (1, N), "A-B" -> (A, B)."""
    if not arg:
        return default
    try:
        low, _, high = arg.partition("-")
        return (int(low), int(high)) if high else (1, int(low))
    except ValueError:
        raise ValueError(f"{what}: expected N or A-B, got {arg!r}") from None


def parse_int(arg: str, what: str) -> int:
    try:
        return int(arg)
    except ValueError:
        raise ValueError(f"{what}: expected an integer, got {arg!r}") from None


def make_drafter(
    spec: str,
    *,
    tree: TreeSpec,
    target=None,
    target_cfg: ModelConfig | None = None,
    target_params=None,
    dtype: str = "float32",
    loader: Callable[[str, str], Any] | None = None,
):
    """(drafter, drafter params) for a spec string (see the module docstring).

    target: a loaded model (`.cfg`, `.params`, `.tokenizer`), or pass target_cfg (and
    target_params for layerskip). loader replaces `specjax.models.hub.load_model` for `model:`.
    Raises ValueError for an unknown or malformed spec, or a drafter that cannot serve the
    target (e.g. a draft model with another vocabulary).
    """
    if target is not None:
        target_cfg = target_cfg or target.cfg
        target_params = target_params if target_params is not None else target.params
    if target_cfg is None:
        raise ValueError("make_drafter needs the target (target=... or target_cfg=...)")
    name, _, arg = spec.strip().partition(":")
    if name not in FACTORIES:
        raise ValueError(f"unknown drafter {spec!r}; choose from {available_drafters()}")
    context = DraftContext(
        tree=tree, target_cfg=target_cfg, target_params=target_params,
        target_tokenizer=getattr(target, "tokenizer", None), dtype=dtype, loader=loader,
    )
    drafter, params = FACTORIES[name](arg, context)
    drafter.check_target(target_cfg)
    return drafter, params


# ---- built-in drafters -------------------------------------------------------------------------


@register("ngram")
def _ngram(arg: str, ctx: DraftContext):
    from specjax.drafters.ngram import NgramDrafter

    n_min, n_max = parse_range(arg, (1, 3), "ngram")
    return NgramDrafter(tree=ctx.tree, n_min=n_min, n_max=n_max), None


@register("suffix")
def _suffix(arg: str, ctx: DraftContext):
    from specjax.drafters.suffix import SuffixDrafter

    n_min, n_max = parse_range(arg, (1, 6), "suffix")
    return SuffixDrafter(tree=ctx.tree, n_min=n_min, n_max=n_max), None


@register("layerskip")
def _layerskip(arg: str, ctx: DraftContext):
    from specjax.drafters.layerskip import layerskip_drafter

    if ctx.target_params is None:
        raise ValueError("layerskip:K drafts with the target's weights: pass the target's params")
    return layerskip_drafter(ctx.tree, ctx.target_cfg, parse_int(arg, "layerskip:K")), ctx.target_params


@register("model")
def _model(arg: str, ctx: DraftContext):
    from specjax.drafters.draft_model import DraftModelDrafter

    if not arg:
        raise ValueError("model:NAME_OR_PATH needs a model name or path")
    loader = ctx.loader
    if loader is None:
        from specjax.models.hub import load_model as loader
    draft = loader(arg, ctx.dtype)
    check_tokenizers(getattr(draft, "tokenizer", None), ctx.target_tokenizer, arg)
    return DraftModelDrafter(tree=ctx.tree, cfg=draft.cfg), draft.params


@register("forced")
def _forced(arg: str, ctx: DraftContext):
    from specjax.drafters.forced import make_forced

    return make_forced(f"forced:{arg}", ctx.tree, ctx.target_cfg.vocab_size)


def check_tokenizers(draft, target, label: str) -> None:
    """Raises ValueError when both tokenizers are known and their vocabularies differ."""
    if draft is None or target is None:
        return
    vocab = lambda tok: tok.backend.get_vocab(with_added_tokens=True)
    ours, theirs = vocab(draft), vocab(target)
    if ours != theirs:
        differ = sorted(set(ours.items()) ^ set(theirs.items()))[:3]
        raise ValueError(
            f"draft model {label!r} does not share the target's tokenizer "
            f"({len(ours)} vs {len(theirs)} entries; e.g. {differ})"
        )


# ---- learned drafters (`specjax train-drafter` outputs, upstream EAGLE-3 / DFlash folders) ------


def _learned(kind: str) -> Factory:
    def factory(arg: str, ctx: DraftContext):
        from specjax.drafters.learned import load_learned_drafter

        return load_learned_drafter(kind, arg, ctx.tree, ctx.target_cfg, ctx.target_params)

    return factory


for _kind in ("eagle3", "mtp", "medusa", "dflash", "dspark"):
    register(_kind)(_learned(_kind))
