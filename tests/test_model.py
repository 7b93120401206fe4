"""The Llama-family forward: tree masks, per-row cache offsets, variants."""
from __future__ import annotations

import operator

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tiny_config

from specjax.models.cache import init_cache
from specjax.models.config import RopeScaling
from specjax.models.llama import (
    DecoderLayer,
    LlamaModel,
    causal_mask,
    forward,
    init_params,
    rope_tables,
)


def _prefill(cfg, params, prompts):
    """Right-padded prefill of ragged prompts; returns the committed cache."""
    batch = len(prompts)
    width = max(len(p) for p in prompts)
    tokens = np.zeros((batch, width), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    positions = np.broadcast_to(np.arange(width), (batch, width))
    cache = init_cache(cfg, batch, 64)
    out = forward(cfg, params, jnp.asarray(tokens), jnp.asarray(positions), cache)
    return out.cache.advance(jnp.array([len(p) for p in prompts]))


def _tree():
    # root 0; children 1, 2 of 0; 3 child of 1; 4 child of 2; 5 child of 3
    parents = [-1, 0, 0, 1, 2, 3]
    n = len(parents)
    mask = np.zeros((n, n), bool)
    depth = np.zeros(n, np.int32)
    for i, p in enumerate(parents):
        mask[i, i] = True
        j = p
        while j >= 0:
            mask[i, j] = True
            depth[i] += 1
            j = parents[j]
    return parents, mask, depth


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"tie_word_embeddings": True},
        {"attention_bias": True},
        {"qk_norm": True},
        {"rope_scaling": RopeScaling(factor=8.0, original_max_position_embeddings=16)},
    ],
    ids=["llama", "tied", "qwen2-bias", "qwen3-qknorm", "llama3-rope"],
)
def test_tree_mask_equals_separate_paths(overrides):
    cfg = tiny_config(**overrides)
    params = init_params(cfg, jax.random.PRNGKey(1))
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    cache = _prefill(cfg, params, prompts)
    parents, mask, depth = _tree()
    rng = np.random.default_rng(0)
    tree_tokens = rng.integers(2, cfg.vocab_size, size=(2, len(parents))).astype(np.int32)
    positions = cache.lengths[:, None] + depth[None, :]
    out = forward(
        cfg, params, jnp.asarray(tree_tokens), positions, cache,
        jnp.broadcast_to(jnp.asarray(mask), (2,) + mask.shape),
    )
    leaves = [i for i in range(len(parents)) if i not in parents]
    for leaf in leaves:
        path = []
        j = leaf
        while j >= 0:
            path.append(j)
            j = parents[j]
        path = path[::-1]
        path_tokens = tree_tokens[:, path]
        path_pos = cache.lengths[:, None] + jnp.arange(len(path))[None, :]
        ref = forward(cfg, params, jnp.asarray(path_tokens), path_pos, cache)
        np.testing.assert_allclose(out.logits[:, path], ref.logits, atol=1e-5, rtol=1e-5)


def test_ragged_rows_match_unbatched():
    cfg = tiny_config()
    params = init_params(cfg, jax.random.PRNGKey(2))
    prompts = [[3, 4, 5, 6, 7, 8, 9], [20, 21]]
    cache = _prefill(cfg, params, prompts)
    step_tokens = jnp.array([[30], [31]], jnp.int32)
    out = forward(cfg, params, step_tokens, cache.lengths[:, None], cache)
    for i, p in enumerate(prompts):
        single = _prefill(cfg, params, [p])
        ref = forward(cfg, params, step_tokens[i : i + 1], single.lengths[:, None], single)
        np.testing.assert_allclose(out.logits[i], ref.logits[0], atol=1e-5, rtol=1e-5)
    # full-sequence forward agrees with prefill + one decode step
    full = jnp.array([prompts[0] + [30]], jnp.int32)
    ref = forward(cfg, params, full, jnp.arange(full.shape[1])[None], init_cache(cfg, 1, 64))
    np.testing.assert_allclose(out.logits[0, 0], ref.logits[0, -1], atol=1e-5, rtol=1e-5)


def test_hidden_layers_and_logit_indices():
    cfg = tiny_config(num_layers=3)
    params = init_params(cfg, jax.random.PRNGKey(3))
    tokens = jnp.array([[4, 5, 6, 7]], jnp.int32)
    pos = jnp.arange(4)[None]
    cache = init_cache(cfg, 1, 16)
    full = forward(cfg, params, tokens, pos, cache, hidden_layers=(0, 2))
    assert len(full.layer_hidden) == 2 and full.layer_hidden[0].shape == (1, 4, cfg.hidden_size)
    picked = forward(cfg, params, tokens, pos, cache, logit_indices=jnp.array([[3, 1]]))
    np.testing.assert_allclose(picked.logits[0], full.logits[0, jnp.array([3, 1])], atol=1e-6)
    k, v = full.cache.token_major()
    assert np.asarray(k[:, 0, :4]).any() and not np.asarray(k[:, 0, 4:]).any()
    assert np.asarray(v[:, 0, :4]).any() and not np.asarray(v[:, 0, 4:]).any()


def layer_by_layer(cfg, params, tokens, positions, cache) -> list:
    """Each decoder layer's output `[B, T, H]`, run one layer at a time from the stacked params
    (the reference `forward`'s hidden_layers must pick from)."""
    x = LlamaModel(cfg).apply(params, tokens, method=LlamaModel.embed)
    cos, sin = rope_tables(cfg, positions)
    mask = causal_mask(*tokens.shape)
    outputs = []
    for layer in range(cfg.num_layers):
        layer_params = jax.tree.map(operator.itemgetter(layer), params["params"]["layers"])
        x, _ = DecoderLayer(cfg).apply({"params": layer_params}, x, cache.k[layer], cache.v[layer],
                                       cos, sin, cache.lengths, mask)
        outputs.append(x)
    return outputs


def test_hidden_layers_are_the_requested_layers_outputs():
    cfg = tiny_config(num_layers=3)
    params = init_params(cfg, jax.random.PRNGKey(4))
    tokens = jnp.array([[4, 5, 6, 7], [9, 8, 7, 6]], jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(4), (2, 4))
    cache = init_cache(cfg, 2, 16)
    expected = layer_by_layer(cfg, params, tokens, positions, cache)
    for a, b in zip(expected, expected[1:]):  # an off-by-one would pick a different array
        assert not np.allclose(a, b, atol=1e-3)
    requested = (0, 2, 1, -1, -3)
    out = forward(cfg, params, tokens, positions, cache, hidden_layers=requested)
    for layer, got in zip(requested, out.layer_hidden, strict=True):
        np.testing.assert_allclose(got, expected[layer], atol=1e-5, rtol=1e-5, err_msg=f"layer {layer}")
    final_norm = LlamaModel(cfg).bind(params).norm
    np.testing.assert_allclose(out.hidden, final_norm(expected[-1]), atol=1e-5, rtol=1e-5)
