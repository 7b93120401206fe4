"""Bring your own target model: a user-written Flax model (not the built-in Llama) that keeps
its keys and values in a specjax KVCache decodes through `generate_ids`, plainly and with n-gram
speculation on a chain and on a tree, greedy-exact."""
from __future__ import annotations

import dataclasses
import math
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from specjax.api import generate_ids
from specjax.target import ForwardOutput, KVCache, TargetModel, as_target, empty_cache, write


class OneLayerLM(nn.Module):
    """One single-head attention layer over [cache, new tokens] with learned absolute
    positions, an MLP and an LM head."""

    vocab_size: int
    width: int
    max_positions: int

    @nn.compact
    def __call__(self, tokens, positions, k_cache, v_cache, lengths, tree_mask):
        """tokens, positions `[B, T]`; k_cache `[B, D, S]`, v_cache `[B, S, D]` (one layer, one
        head); tree_mask `[B, T, T]` -> (logits `[B, T, V]`, hidden `[B, T, D]`, k, v `[B, T, D]`)."""
        x = nn.Embed(self.vocab_size, self.width)(tokens) + nn.Embed(self.max_positions, self.width)(positions)
        q, k, v = (nn.Dense(self.width, name=name)(x) for name in ("q", "k", "v"))
        cached_ok = jnp.arange(k_cache.shape[-1])[None, None, :] < lengths[:, None, None]  # [B, 1, S]
        scores = jnp.concatenate([
            jnp.where(cached_ok, jnp.einsum("btd,bds->bts", q, k_cache), -jnp.inf),
            jnp.where(tree_mask, jnp.einsum("btd,bud->btu", q, k), -jnp.inf),
        ], axis=-1) / math.sqrt(self.width)
        weights = jax.nn.softmax(scores, axis=-1)
        capacity = k_cache.shape[-1]
        attended = (jnp.einsum("bts,bsd->btd", weights[..., :capacity], v_cache)
                    + jnp.einsum("btu,bud->btd", weights[..., capacity:], v))
        hidden = x + nn.Dense(self.width, name="out")(attended)
        hidden = hidden + nn.Dense(self.width, name="down")(nn.gelu(nn.Dense(2 * self.width, name="up")(hidden)))
        return nn.Dense(self.vocab_size, name="head")(hidden), hidden, k, v


def head_kv(cache: KVCache):
    """The cache's one layer and one KV head: k `[B, D, S]`, v `[B, S, D]`."""
    return cache.k[0, :, 0], cache.v[0, :, 0]


def as_cache_entries(x):
    """`[B, T, D]` -> `[L=1, B, T, KVH=1, D]`, the layout `specjax.target.write` stores."""
    return x[None, :, :, None, :]


@dataclasses.dataclass(frozen=True)
class OneLayerTarget:
    """The user's side of `specjax.target.TargetModel` for OneLayerLM."""

    vocab_size: int = 24
    width: int = 16
    max_position_embeddings: int = 128
    eos_token_ids: tuple[int, ...] = ()

    @property
    def module(self) -> OneLayerLM:
        return OneLayerLM(self.vocab_size, self.width, self.max_position_embeddings)

    def init_params(self, key):
        tokens = jnp.zeros((1, 1), jnp.int32)
        cache = self.init_cache(1, 1)
        return self.module.init(key, tokens, tokens, *head_kv(cache), cache.lengths,
                                jnp.ones((1, 1, 1), bool))

    def init_cache(self, batch_size: int, capacity: int) -> KVCache:
        return empty_cache(1, batch_size, capacity, 1, self.width, jnp.float32)

    def forward(self, params, tokens, positions, cache, tree_mask=None, *, hidden_layers=(),
                logit_indices=None) -> ForwardOutput:
        batch, seq = tokens.shape
        if tree_mask is None:
            tree_mask = jnp.broadcast_to(jnp.tril(jnp.ones((seq, seq), bool)), (batch, seq, seq))
        logits, hidden, k, v = self.module.apply(params, tokens, positions, *head_kv(cache),
                                                 cache.lengths, tree_mask)
        if logit_indices is not None:
            logits = jnp.take_along_axis(logits, logit_indices[..., None], axis=1)
        return ForwardOutput(logits=logits, hidden=hidden, layer_hidden=tuple(hidden for _ in hidden_layers),
                             cache=write(cache, as_cache_entries(k), as_cache_entries(v)))


PROMPTS = [[3, 4, 5, 6, 3, 4, 5, 6, 3], [7, 8, 9, 7, 8, 9, 7], [10, 11], [12, 13, 12, 13, 12, 13]]


@pytest.fixture(scope="module")
def user_model():
    target = OneLayerTarget()
    return target, target.init_params(jax.random.PRNGKey(0))


def naive_greedy(target, params, prompt: list[int], steps: int, width: int = 48) -> list[int]:
    """Recomputes the whole sequence with an empty cache for every token: no cache reuse."""

    @jax.jit
    def next_token(tokens, length):  # tokens [1, width] right-padded; the last real one at length-1
        out = target.forward(params, tokens, jnp.arange(width)[None], target.init_cache(1, width))
        return jnp.argmax(out.logits[0, length - 1])

    seq = list(prompt)
    for _ in range(steps):
        seq.append(int(next_token(jnp.asarray([seq + [0] * (width - len(seq))], jnp.int32), len(seq))))
    return seq[len(prompt):]


def test_user_model_is_a_target_model(user_model):
    target, _ = user_model
    assert isinstance(target, TargetModel)  # structurally: nothing inherited from specjax
    assert as_target(target) is target


def test_plain_decoding_matches_a_full_recompute(user_model):
    target, params = user_model
    results = generate_ids(target, params, PROMPTS, max_new_tokens=12)
    for prompt, result in zip(PROMPTS, results):
        assert result.token_ids == naive_greedy(target, params, prompt, 12)
        assert result.stop_reason == "length"


@pytest.mark.parametrize("shape", [{"num_draft": 4}, {"tree": "kary_2x2x2"}], ids=["chain", "tree"])
def test_ngram_speculation_is_greedy_exact(user_model, shape):
    target, params = user_model
    plain = generate_ids(target, params, PROMPTS, max_new_tokens=24)
    spec = generate_ids(target, params, PROMPTS, max_new_tokens=24, draft="ngram", **shape)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert sum(r.spec["accepted"] for r in spec) > 0  # drafts were accepted and committed


def test_eos_comes_from_the_target(user_model):
    target, params = user_model
    free = generate_ids(target, params, PROMPTS[:1], max_new_tokens=8)[0].token_ids
    ends = dataclasses.replace(target, eos_token_ids=(free[2],))
    (result,) = generate_ids(ends, params, PROMPTS[:1], max_new_tokens=8, draft="ngram")
    assert result.token_ids == free[: free.index(free[2]) + 1] and result.stop_reason == "eos"


def test_what_is_not_a_target_model_is_named():
    @dataclasses.dataclass(frozen=True)
    class NoForward:
        vocab_size: int = 8

    with pytest.raises(TypeError, match="lacks eos_token_ids, max_position_embeddings, init_cache, forward"):
        generate_ids(NoForward(), None, [[1, 2]], max_new_tokens=2)

    members = dict(vocab_size=8, eos_token_ids=(), max_position_embeddings=8, init_cache=None, forward=None)
    with pytest.raises(TypeError, match="must be hashable"):  # a jit static argument
        generate_ids(types.SimpleNamespace(**members), None, [[1, 2]], max_new_tokens=2)
