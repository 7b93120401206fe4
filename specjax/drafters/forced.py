"""Forced acceptance: a drafter for measuring the speculative *system*, not a drafter.

`ForcedDrafter` proposes random tokens and overrides the acceptance rule (`Drafter.accept`): a
draft node at depth d passes with probability `profile[d - 1]`, independently per node; the
deepest node whose whole path passes is accepted (first in sibling order on ties) and the token
after it is the target's (sampled with the run's sampling params, argmax when greedy). The
target still verifies all 1 + N tokens and commit, append and metrics run as usual, so every
step costs what the real system's step costs while the accepted lengths follow a chosen
profile. On a chain the conditional acceptance at position j is profile[j] in expectation.

NOT lossless (the accepted tokens are random): measurement only. Use it with EOS ignored so
rows run to max_new_tokens. The profile lives in the drafter's *params* (`forced_params`, a
`[MAX_DEPTH]` array), so trying another profile never compiles again.

Spec strings (`make_forced`):
  forced:0.9,0.8,0.7   conditional acceptance per position; later positions repeat the last
  forced:0.8           the same at every position
  forced:PATH          YAML/JSON with `conditional_acceptance: [...]`, or a `specjax bench`
                       JSON (its overall speculative profile)
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import yaml

from specjax.accept import _all_ancestors, _deepest, _result
from specjax.drafters.base import Drafter
from specjax.gather import take_rows
from specjax.rng import per_row, sample_rows, split_rows
from specjax.sampling import SamplingParams
from specjax.tree import TreeSpec
from specjax.types import AcceptResult, Draft

PREFIX = "forced"
MAX_DEPTH = 64  # positions a params profile covers (trees up to this depth)


def extend_profile(profile: Sequence[float], depth: int) -> tuple[float, ...]:
    """The profile padded to `depth` positions by repeating its last value (or cut)."""
    profile = tuple(float(p) for p in profile)
    return (profile + (profile[-1],) * depth)[:depth]


def accept_forced(
    key: jax.Array,
    target_logits: jax.Array,
    draft: Draft,
    tree: TreeSpec,
    sampling: SamplingParams,
    conditional,
) -> AcceptResult:
    """Acceptance drawn from a per-depth pass probability `conditional` `[>= Dmax]`.

    target_logits `[B, 1 + N, V]`, draft.tokens/valid `[B, N]` -> AcceptResult (see types).
    """

    batch, num_nodes = draft.tokens.shape
    key_coins, key_next = split_rows(key, batch, 2)  # [B, 2] each
    pass_prob = jnp.asarray(conditional, jnp.float32)[jnp.asarray(tree.node_depth) - 1]  # [N]
    coins = per_row(key_coins, batch, lambda k: jax.random.uniform(k, (num_nodes,), jnp.float32))
    passed = draft.valid & (coins < pass_prob[None, :])
    last = _deepest(_all_ancestors(passed, tree), tree)
    return _result(last, sample_rows(key_next, take_rows(target_logits, last), sampling), tree)


def expected_accepted(tree: TreeSpec, conditional: Sequence[float]) -> float:
    """E[accepted draft tokens per step] under `accept_forced` (exact, all nodes valid).

    E = sum_{d >= 1} P(some root path of >= d nodes passes); per node v,
    P_v(>= d) = 1 - prod_{children c} (1 - p(c) * P_c(>= d - 1)).
    For a chain: sum_j prod_{i <= j} conditional[i].
    """
    probs = extend_profile(conditional, tree.max_depth)
    # reach[v][d]: P(a passing path of >= d more nodes starts below verify row v)
    reach: dict[int, list[float]] = {}
    for v in range(tree.num_nodes, -1, -1):  # children have larger verify indices
        row = [1.0] + [0.0] * tree.max_depth
        for d in range(1, tree.max_depth + 1):
            miss = 1.0
            for c in tree.children[v]:
                miss *= 1.0 - probs[tree.depth[c] - 1] * reach[c + 1][d - 1]
            row[d] = 1.0 - miss
        reach[v] = row
    return float(sum(reach[0][1:]))


def forced_params(profile: Sequence[float]) -> dict:
    """The ForcedDrafter's params: {"conditional": f32 `[MAX_DEPTH]`} (profile extended)."""
    if not profile or any(not 0.0 <= p <= 1.0 for p in profile):
        raise ValueError(f"forced profile needs values in [0, 1], got {tuple(profile)}")
    return {"conditional": jnp.asarray(extend_profile(profile, MAX_DEPTH), jnp.float32)}


@dataclasses.dataclass(frozen=True)
class ForcedDrafter(Drafter):
    """Random draft tokens in [0, vocab_size); acceptance forced to the profile in its params
    (`forced_params`; see the module docstring)."""

    vocab_size: int = 2

    def __post_init__(self):
        if self.vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {self.vocab_size}")
        if self.tree.max_depth > MAX_DEPTH:
            raise ValueError(f"forced drafting supports depths up to {MAX_DEPTH}")

    @property
    def name(self) -> str:
        return PREFIX

    def check_target(self, target_cfg) -> None:
        if target_cfg.vocab_size < self.vocab_size:
            raise ValueError(f"forced drafter draws tokens below {self.vocab_size}, more than the "
                             f"target's vocabulary {target_cfg.vocab_size}")

    def propose(self, params, state, decode, key, sampling):
        batch, num_nodes = decode.tokens.shape[0], self.tree.num_nodes
        tokens = per_row(key, batch, lambda k: jax.random.randint(
            k, (num_nodes,), 0, self.vocab_size, dtype=jnp.int32))
        return Draft(tokens=tokens, valid=jnp.ones((batch, num_nodes), bool)), state

    def accept(self, params, key, target_logits, draft, sampling):
        return accept_forced(key, target_logits, draft, self.tree, sampling, params["conditional"])


def profile_from_file(path: str | Path) -> tuple[float, ...]:
    """The conditional profile in a YAML/JSON file (see the module docstring)."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    if isinstance(data, dict) and "overall" in data:  # a `specjax bench` report
        data = data["overall"]["spec"]
    if isinstance(data, dict):
        data = data.get("conditional_acceptance")
    if not isinstance(data, list) or not data:
        raise ValueError(f"{path}: no 'conditional_acceptance' list")
    return tuple(float(x) for x in data)


def parse_profile(text: str) -> tuple[float, ...]:
    """`0.9,0.8,0.7` or a file path -> conditional profile."""
    if Path(text).is_file():
        return profile_from_file(text)
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"forced profile {text!r} is neither numbers (0.9,0.8) nor a file") from None


def is_forced(spec: str | None) -> bool:
    return bool(spec) and (spec == PREFIX or spec.startswith(PREFIX + ":"))


def make_forced(spec: str, tree: TreeSpec, vocab_size: int) -> tuple[ForcedDrafter, dict]:
    """`forced:PROFILE` -> (ForcedDrafter drawing tokens from [0, vocab_size), its params)."""
    _, _, text = spec.partition(":")
    return ForcedDrafter(tree=tree, vocab_size=vocab_size), forced_params(parse_profile(text or "1.0"))
