"""The options of a generation job, checked before any model loads or anything compiles.

`GenerationConfig` (length, sampling, stopping) is a frozen record that `specjax.generate` and
`generate_ids` take in place of loose keyword arguments; `job_key` is the PRNG key a job samples
from (`seed=` or `key=`); `DraftChoice` is what `draft=` named (a drafter spec string, a Drafter,
or a `(drafter, params)` pair) with its draft tree. Every check raises TypeError / ValueError
naming the argument.
"""
from __future__ import annotations

import dataclasses
import reprlib
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import numpy as np

from specjax.drafters.auto import BASE_LENGTHS, auto_max_draft
from specjax.drafters.base import Drafter
from specjax.drafters.registry import available_drafters, check_spec
from specjax.rng import KEY_ID_SPACE, raw_key, seed_key
from specjax.sampling import SamplingParams
from specjax.tree import TreeSpec, chain, check_num_draft, load_tree

DEFAULT_NUM_DRAFT = 4  # the chain a fixed-shape drafter spec (or a sampled job) drafts by default
#: drafter kinds whose specs never run with num_draft="auto": `forced` measures a given draft
#: shape (its acceptance is drawn from a profile, so auto's estimate would be meaningless)
FIXED_KINDS = ("forced",)
AUTO_MAX_DRAFT = max(BASE_LENGTHS)  # the longest chain auto compiles (the margin it needs)


def describe(value) -> str:
    """`type value` for an error message, the value shortened."""
    return f"{type(value).__name__} {reprlib.repr(value)}"


def is_integer(value) -> bool:
    """An int or a numpy integer (not a bool, not a float however round)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_int(value, what: str, low: int, high: int | None = None) -> int:
    """`value` as an int in [low, high) (no upper bound when high is None); TypeError when it is
    not an integer, ValueError when out of range, both naming `what`."""
    bounds = f">= {low}" if high is None else f"in [{low}, {high})"
    if not is_integer(value):
        raise TypeError(f"{what} must be an integer {bounds}, got {describe(value)}")
    if value < low or (high is not None and value >= high):
        raise ValueError(f"{what} must be an integer {bounds}, got {value}")
    return int(value)


def as_rows(values, what: str, expected: str) -> list:
    """An ordered container (list, tuple, array, iterator) as a list, else a TypeError naming
    the argument `what` and what was `expected` (a str, bytes, dict or set is refused)."""
    unordered = (str, bytes, bytearray, Mapping, AbstractSet)
    if isinstance(values, unordered) or not isinstance(values, Iterable):
        raise TypeError(f"{what} must be {expected}, got {describe(values)}")
    return list(values)


def stop_strings(stop) -> tuple[str, ...]:
    """The non-empty stop strings of `stop` (None, one str, or a sequence of str)."""
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else as_rows(stop, "stop", "a str or a sequence of str")
    for i, s in enumerate(stops):
        if not isinstance(s, str):
            raise TypeError(f"stop[{i}] must be a str, got {describe(s)}")
    return tuple(s for s in stops if s)


def token_ids(values, what: str) -> tuple[int, ...]:
    """A sequence of integer token ids as a tuple of int (TypeError naming `what`)."""
    ids = as_rows(values, what, "a sequence of integer token ids")
    for i, t in enumerate(ids):
        if not is_integer(t):
            raise TypeError(f"{what}[{i}] must be an integer token id, got {describe(t)}")
    return tuple(int(t) for t in ids)


# ---------------------------------------------------------------------------------------------
# Length, sampling, stopping
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """How each prompt is continued; checked when built (frozen: one record serves many calls).

    max_new_tokens: the most tokens generated per prompt.
    temperature: 0 = greedy (argmax); top_k: None or 0 = off; top_p: None or 1.0 = off.
    stop: stop strings (one str or several; `specjax.generate` only, `generate_ids` takes token
      sequences as stop_token_seqs): a row ends with the first it produces, the string cut off.
    eos_ids: token ids that end a row; None = the model's end tokens, () = none (run to length).
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    stop: tuple[str, ...] = ()
    eos_ids: tuple[int, ...] | None = None

    def __post_init__(self):
        set_field = object.__setattr__  # frozen: normalise the fields once, here
        set_field(self, "max_new_tokens", check_int(self.max_new_tokens, "max_new_tokens", 1))
        set_field(self, "stop", stop_strings(self.stop))
        if self.eos_ids is not None:
            set_field(self, "eos_ids", token_ids(self.eos_ids, "eos_ids"))
        self.sampling()  # range checks of temperature, top_k, top_p

    def sampling(self) -> SamplingParams:
        """The dynamic sampling knobs of the jitted program."""
        return SamplingParams.make(self.temperature, self.top_k, self.top_p)

    @classmethod
    def resolve(cls, config: GenerationConfig | None, **given) -> GenerationConfig:
        """`config` (None: the defaults) with the loose keyword options whose value is not None.
        ValueError when an option is given both ways; TypeError when config is not a
        GenerationConfig."""
        options = {name: value for name, value in given.items() if value is not None}
        if config is None:
            return cls(**options)
        if not isinstance(config, cls):
            raise TypeError(f"config must be a specjax.GenerationConfig, got {describe(config)}")
        if options:
            raise ValueError(f"{', '.join(sorted(options))} given both in config= and as keyword "
                             "arguments: give each option one way")
        return config


def per_prompt_limits(max_new_tokens, count: int) -> tuple[int | None, list[int] | None]:
    """(the scalar for GenerationConfig, each prompt's limit or None) of a max_new_tokens option
    that is None, one int, or a sequence of `count` ints >= 1 (one per prompt: the config gets
    their largest)."""
    per_prompt = isinstance(max_new_tokens, (Sequence, np.ndarray)) and not isinstance(
        max_new_tokens, (str, bytes))
    if not per_prompt or (isinstance(max_new_tokens, np.ndarray) and max_new_tokens.ndim == 0):
        return max_new_tokens, None  # one value, checked by GenerationConfig
    limits = [check_int(m, f"max_new_tokens[{i}]", 1) for i, m in enumerate(max_new_tokens)]
    if len(limits) != count:
        raise ValueError(f"max_new_tokens has {len(limits)} values for {count} prompts: give one "
                         "int, or one per prompt")
    return (max(limits) if limits else None), limits


def job_key(seed: int | None, key) -> np.ndarray:
    """`[2]` uint32: the key a job's rows are drawn from, `key` (a JAX PRNG key, raw or typed)
    or PRNGKey(seed) (default seed 0). ValueError when both are given."""
    if key is not None:
        if seed is not None:
            raise ValueError("give seed= or key=, not both")
        return raw_key(key)
    return seed_key(0 if seed is None else check_int(seed, "seed", 0, KEY_ID_SPACE))


# ---------------------------------------------------------------------------------------------
# draft=
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DraftChoice:
    """What `draft=` named, checked: a spec to build for the target (`spec`), or a ready drafter
    (`drafter`, `params`), drafting on `tree`; nothing at all (plain decoding) when both are None."""

    spec: str | None = None
    drafter: Drafter | None = None
    params: Any = None
    tree: TreeSpec | None = None
    auto: bool = False  # num_draft="auto": the shape picked every step (`drafters.auto`)

    @property
    def speculates(self) -> bool:
        return self.spec is not None or self.drafter is not None


def draft_shape(num_draft, tree) -> TreeSpec | None:
    """The draft tree `num_draft` (a chain) or `tree` (a TreeSpec, preset name or YAML path)
    names, None when neither is given; ValueError when both are."""
    if num_draft is not None and tree is not None:
        raise ValueError("give num_draft= (a chain) or tree= (a tree), not both")
    if tree is not None:
        return load_tree(tree)
    return None if num_draft is None else chain(check_num_draft(num_draft))


def check_drafter(drafter) -> Drafter:
    """A Drafter whose tree is a TreeSpec within `specjax.tree.MAX_DRAFT_NODES`."""
    if not isinstance(drafter, Drafter):
        raise TypeError(f"a drafter must be a specjax Drafter, got {describe(drafter)}")
    if not isinstance(drafter.tree, TreeSpec):
        raise TypeError(f"the drafter's tree must be a specjax.tree.TreeSpec, got {describe(drafter.tree)}")
    check_num_draft(drafter.tree.num_nodes, "the drafter's tree size (draft nodes)")
    return drafter


def draft_choice(draft, num_draft=None, tree=None, drafter_params=None,
                 sampled: bool = False) -> DraftChoice:
    """Checks `draft=` (None, a drafter spec string, a Drafter, or a `(drafter, params)` pair)
    with its shape options; loads nothing. ValueError listing the known drafter kinds when
    `draft` is none of these or names an unknown kind.

    num_draft="auto" (the default for a spec of every kind but FIXED_KINDS given no num_draft /
    tree, when greedy) picks the draft shape every step (`drafters.auto`); FIXED_KINDS, and
    every kind when `sampled` (temperature > 0), default to a chain of DEFAULT_NUM_DRAFT: speculative
    sampling draws differently for another draft shape (exactly, but other tokens), and auto's
    shape follows the whole batch (its acceptance estimate, the active rows), so a sampled row
    would depend on its neighbours; an explicit "auto" accepts that."""
    auto = isinstance(num_draft, str) and num_draft == "auto"
    shape = draft_shape(None if auto else num_draft, tree)
    if draft is None:
        if shape is not None or drafter_params is not None or auto:
            raise ValueError("num_draft=, tree= and drafter_params= shape a drafter: give draft= too")
        return DraftChoice()
    if auto and tree is not None:
        raise ValueError("give num_draft= (a chain, or 'auto') or tree= (a tree), not both")
    if isinstance(draft, str):
        check_spec(draft)
        if drafter_params is not None:
            raise ValueError(f"draft={draft!r} builds its own params: drop drafter_params=")
        kind = draft.strip().partition(":")[0]
        if auto and kind in FIXED_KINDS:
            raise ValueError(f"num_draft='auto' does not drive the {kind} drafter (it measures a "
                             f"given draft shape); give num_draft=N for {draft!r}")
        if shape is None and kind not in FIXED_KINDS and (auto or not sampled):
            return DraftChoice(spec=draft.strip(), tree=chain(AUTO_MAX_DRAFT), auto=True)
        return DraftChoice(spec=draft.strip(), tree=shape or chain(DEFAULT_NUM_DRAFT))
    if isinstance(draft, tuple) and len(draft) == 2 and isinstance(draft[0], Drafter):
        if drafter_params is not None:
            raise ValueError("draft=(drafter, params) carries its params: drop drafter_params=")
        draft, drafter_params = draft
    if isinstance(draft, Drafter) and auto:
        if not draft.shape_free_state:
            raise ValueError(f"num_draft='auto' needs a drafter whose state does not depend on its "
                             f"tree (Drafter.shape_free_state); {draft.name} does not: give "
                             "num_draft=N")
        longest = chain(auto_max_draft(draft, AUTO_MAX_DRAFT))
        drafter = check_drafter(dataclasses.replace(draft, tree=longest))
        return DraftChoice(drafter=drafter, params=drafter_params, tree=drafter.tree, auto=True)
    if isinstance(draft, Drafter):
        drafter = check_drafter(draft if shape is None else dataclasses.replace(draft, tree=shape))
        return DraftChoice(drafter=drafter, params=drafter_params, tree=drafter.tree)
    raise ValueError(f"draft must be a drafter spec (one of {available_drafters()}, e.g. 'ngram' "
                     f"or 'ngram:2-4'), a specjax Drafter or a (drafter, params) pair; got "
                     f"{describe(draft)}")
