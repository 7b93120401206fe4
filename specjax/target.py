"""What the decoding loop needs of a target model: the `TargetModel` protocol.

The loop (`specjax.loop`), verification (`specjax.verify`) and the API (`specjax.api`) touch the
target only through these members, so any model whose keys and values live in a specjax
`KVCache` (`empty_cache` to make one, `write` to store a forward's new keys and values; commit
keeps the accepted ones) can be decoded plainly or speculatively:

    @dataclasses.dataclass(frozen=True)      # hashable: the target is a jit static argument
    class MyModel:
        vocab_size: int
        eos_token_ids: tuple[int, ...] = ()
        max_position_embeddings: int = 2048

        def init_cache(self, batch_size, capacity) -> KVCache: ...
        def forward(self, params, tokens, positions, cache, tree_mask=None, *,
                    hidden_layers=(), logit_indices=None) -> ForwardOutput: ...

    specjax.generate_ids(MyModel(...), params, [[1, 2, 3]], draft="ngram", num_draft=4)

The built-in Llama-family decoder is `specjax.models.llama.Llama(cfg)`; a bare `ModelConfig` is
accepted wherever a target is and means that (`as_target`). Drafters that need nothing of the
target's insides (ngram, suffix, a separate draft model) serve any target; the ones that read
the target's layers or weights (layerskip, EAGLE-3, DFlash, ...) need the built-in Llama.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import jax

from specjax.models.cache import KVCache, empty_cache, write
from specjax.models.config import ModelConfig
from specjax.models.llama import ForwardOutput, Llama

__all__ = ["ForwardOutput", "KVCache", "Llama", "TargetModel", "as_target", "empty_cache", "write"]


@runtime_checkable
class TargetModel(Protocol):
    """A target model as the decoding loop calls it.

    vocab_size: V, the width of the logits (prompt ids must lie in [0, V)).
    eos_token_ids: the ids that end a row when the caller names none.
    max_position_embeddings: the longest row (prompt + new tokens + draft margin) by default.
    """

    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_position_embeddings: int

    def init_cache(self, batch_size: int, capacity: int) -> KVCache:
        """An empty cache of `capacity` entries per row for `batch_size` rows (lengths 0)."""

    def forward(self, params, tokens: jax.Array, positions: jax.Array, cache: KVCache,
                tree_mask: jax.Array | None = None, *, hidden_layers: tuple[int, ...] = (),
                logit_indices: jax.Array | None = None) -> ForwardOutput:
        """One forward over T new tokens per row; pure, traceable under jit.

        tokens, positions: `[B, T]` int32 (positions = `cache.lengths + depth` in a draft tree).
        cache: row b attends to its entries `[0, cache.lengths[b])` and, among the new tokens,
          to those `tree_mask` `[B, T, T]` bool allows (None = causal).
        hidden_layers: static indices of layers whose outputs to return (may be negative).
        logit_indices: `[B, K]` positions in T to compute logits at (None = all T).
        Returns ForwardOutput(logits `[B, K or T, V]` f32, hidden `[B, T, H]` (the final hidden
        states), layer_hidden (one `[B, T, H]` per hidden_layers entry), cache with the T new
        entries written at `[lengths[b], lengths[b] + T)` and lengths NOT advanced).
        """


MEMBERS = ("vocab_size", "eos_token_ids", "max_position_embeddings", "init_cache", "forward")


def as_target(model) -> TargetModel:
    """`model` as a TargetModel: a ModelConfig is the built-in `Llama(model)`, anything else must
    have every member of the protocol and be hashable (TypeError naming what is missing)."""
    if isinstance(model, ModelConfig):
        return Llama(model)
    missing = [name for name in MEMBERS if not hasattr(model, name)]
    if missing:
        raise TypeError(f"the target model {type(model).__name__} lacks {', '.join(missing)} "
                        "(see specjax.target.TargetModel)")
    try:
        hash(model)
    except TypeError:
        raise TypeError(f"the target model {type(model).__name__} must be hashable (a jit static "
                        "argument): make it a frozen dataclass") from None
    return model
