"""Drafters by name: `drafter, drafter_params = make_drafter(spec, tree=..., target=...)`.

Specs (`NAME` or `NAME:ARG`):

    ngram | ngram:N | ngram:A-B        prompt lookup, match lengths 1..N or A..B (default 1-3)
    suffix | suffix:N | suffix:A-B     suffix decoding, context orders 1..N or A..B (default 1-6)
    layerskip:K                        the target's first K layers + final norm + LM head
    model:NAME_OR_PATH                 a Llama-family draft model with the target's tokenizer,
                                       loaded by `specjax.models.hub.load_model` (quantized
                                       like the target: `models.quant`)
    forced:PROFILE                     measurement only, not lossless (`drafters.forced`)
    eagle3:DIR | mtp:DIR | medusa:DIR  a learned head trained by `specjax train-drafter` (DIR
    dflash:DIR | dspark:DIR            = its output), or an upstream EAGLE-3 / DFlash HF folder
                                       (the kinds of `drafters.learned.registry.KINDS`)

Other drafters join with `@register("name")` on a factory `(arg, DraftContext) -> (drafter,
drafter params)`.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from specjax.drafters.auto import auto_max_draft
from specjax.drafters.draft_model import DraftModelDrafter
from specjax.drafters.forced import make_forced
from specjax.drafters.layerskip import layerskip_drafter
from specjax.drafters.learned.checkpoint import load_learned_drafter
from specjax.drafters.learned.registry import KINDS as LEARNED_KINDS
from specjax.drafters.ngram import NgramDrafter
from specjax.drafters.suffix import SuffixDrafter
from specjax.models.config import ModelConfig
from specjax.models.hub import load_model
from specjax.models.quant import quantization_of, quantize_params
from specjax.tree import TreeSpec, chain

Factory = Callable[[str, "DraftContext"], tuple[Any, Any]]
FACTORIES: dict[str, Factory] = {}
#: name -> check(arg): raises ValueError for a malformed argument, before any model loads
ARG_CHECKS: dict[str, Callable[[str], Any]] = {}


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


def register(name: str, check_arg: Callable[[str], Any] | None = None) -> Callable[[Factory], Factory]:
    """Registers a factory under `name`; `check_arg(arg)` (optional) validates the spec's
    argument without a target, so `check_spec` can refuse it before any model loads."""
    def add(factory: Factory) -> Factory:
        FACTORIES[name] = factory
        if check_arg is not None:
            ARG_CHECKS[name] = check_arg
        return factory

    return add


def check_spec(spec: str) -> None:
    """Raises ValueError for an unknown drafter name or a malformed argument (no model needed)."""
    name, _, arg = spec.strip().partition(":")
    if name not in FACTORIES:
        raise ValueError(f"unknown drafter {spec!r}; choose from {available_drafters()}")
    if name in ARG_CHECKS:
        ARG_CHECKS[name](arg)


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


def _check_range(default: tuple[int, int], what: str) -> Callable[[str], None]:
    def check(arg: str) -> None:
        low, high = parse_range(arg, default, what)
        if not 1 <= low <= high:
            raise ValueError(f"{what}: expected 1 <= A <= B, got {arg!r}")

    return check


def _check_positive_int(what: str) -> Callable[[str], None]:
    def check(arg: str) -> None:
        if parse_int(arg, what) < 1:
            raise ValueError(f"{what}: expected an integer >= 1, got {arg!r}")

    return check


def _check_given(what: str) -> Callable[[str], None]:
    def check(arg: str) -> None:
        if not arg.strip():
            raise ValueError(f"{what} needs its argument after the colon")

    return check


def make_drafter(
    spec: str,
    *,
    tree: TreeSpec,
    target=None,
    target_cfg: ModelConfig | None = None,
    target_params=None,
    dtype: str = "float32",
    loader: Callable[[str, str], Any] | None = None,
    auto: bool = False,
):
    """(drafter, drafter params) for a spec string (see the module docstring).

    auto: for `num_draft="auto"`: `tree` is the longest chain auto may compile; the drafter is
    built on a chain of 1 and then drafts the longest chain it can fill
    (`drafters.auto.auto_max_draft`: a Medusa head with fewer heads drafts fewer tokens).

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
    longest = tree.max_depth
    context = DraftContext(
        tree=chain(1) if auto else tree, target_cfg=target_cfg, target_params=target_params,
        target_tokenizer=getattr(target, "tokenizer", None), dtype=dtype, loader=loader,
    )
    drafter, params = FACTORIES[name](arg, context)
    if auto:
        drafter = dataclasses.replace(drafter, tree=chain(auto_max_draft(drafter, longest)))
    drafter.check_target(target_cfg)
    return drafter, params


# ---- built-in drafters -------------------------------------------------------------------------


@register("ngram", _check_range((1, 3), "ngram"))
def _ngram(arg: str, ctx: DraftContext):
    n_min, n_max = parse_range(arg, (1, 3), "ngram")
    return NgramDrafter(tree=ctx.tree, n_min=n_min, n_max=n_max), None


@register("suffix", _check_range((1, 6), "suffix"))
def _suffix(arg: str, ctx: DraftContext):
    n_min, n_max = parse_range(arg, (1, 6), "suffix")
    return SuffixDrafter(tree=ctx.tree, n_min=n_min, n_max=n_max), None


@register("layerskip", _check_positive_int("layerskip:K"))
def _layerskip(arg: str, ctx: DraftContext):
    if ctx.target_params is None:
        raise ValueError("layerskip:K drafts with the target's weights: pass the target's params")
    return layerskip_drafter(ctx.tree, ctx.target_cfg, parse_int(arg, "layerskip:K")), ctx.target_params


@register("model", _check_given("model:NAME_OR_PATH"))
def _model(arg: str, ctx: DraftContext):
    if not arg:
        raise ValueError("model:NAME_OR_PATH needs a model name or path")
    loader = ctx.loader or load_model
    draft = loader(arg, ctx.dtype)
    check_tokenizers(getattr(draft, "tokenizer", None), ctx.target_tokenizer, arg)
    # a draft model follows the target's weight quantization (models.quant)
    params = quantize_params(draft.params, quantization_of(ctx.target_params))
    return DraftModelDrafter(tree=ctx.tree, cfg=draft.cfg), params


@register("forced")
def _forced(arg: str, ctx: DraftContext):
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
        return load_learned_drafter(kind, arg, ctx.tree, ctx.target_cfg, ctx.target_params)

    return factory


for _kind in LEARNED_KINDS:
    register(_kind, _check_given(f"{_kind}:DIR"))(_learned(_kind))
