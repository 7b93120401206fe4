"""Pieces shared by the training losses of the learned drafters (all math in f32).

Every kind's loss (`HeadKind.loss`, defined in the kind's module) has the signature

    loss(head_cfg, variables, parts, tout, batch, key) -> (scalar loss, {metric: scalar})

variables: the head's `{"params", "consts"}`; parts: the target's frozen views
(`TargetView.parts`); tout: the frozen target forward over the batch (`target_pass`: final
hidden `[B, T, H]`, the head's layer_hidden; no logits); batch: tokens `[B, T]`,
lengths `[B]`, prompt_lens `[B]`. A label at position p counts when p holds a response token
(prompt_len <= p < length).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters.learned.blocks import shift_left
from specjax.models.cache import init_cache
from specjax.models.llama import forward


def target_pass(target_cfg, target_params, tokens: jax.Array, hidden_layers: tuple[int, ...]):
    """Frozen target forward over whole sequences `[B, T]` (no gradient): final hidden states
    and the requested layers' outputs. The full-vocabulary logits are NOT computed (the LM
    head is a large share of a small target's FLOPs); losses that need the target's
    distribution project the hidden states they need (`TargetView.logits[_subset]`)."""
    batch, seq = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
    out = forward(target_cfg, target_params, tokens, positions, init_cache(target_cfg, batch, seq),
                  hidden_layers=hidden_layers, compute_logits=False)
    return jax.lax.stop_gradient(out.replace(cache=None))


def response_mask(lengths, prompt_lens, seq_len: int):
    """`[B, T]` bool: position t holds a response token (prompt_len <= t < length). Works on
    numpy and jax arrays."""
    t = np.arange(seq_len)[None, :]
    return (t >= prompt_lens[:, None]) & (t < lengths[:, None])


def label_mask(batch, offset: int) -> jax.Array:
    """`[B, T]`: the label at position t + offset is a response token."""
    mask = response_mask(batch["lengths"], batch["prompt_lens"], batch["tokens"].shape[1])
    return shift_left(mask, offset, fill=False)


def soft_cross_entropy(logits: jax.Array, target_probs: jax.Array) -> jax.Array:
    """`[...]` -sum p log softmax(logits) over the last axis."""
    return -jnp.sum(target_probs * jax.nn.log_softmax(logits.astype(jnp.float32), -1), axis=-1)


def hard_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """`[...]` -log softmax(logits)[label]."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
    return -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]


def masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    mask = mask.astype(jnp.float32)
    return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def decayed_sum(per_step: list[jax.Array], decay: float) -> jax.Array:
    """sum_k decay**k * per_step[k] (the per-depth weighting of the multi-step losses)."""
    return sum(decay**k * loss for k, loss in enumerate(per_step))


def depth_losses(logits_per_depth, batch) -> tuple[list[jax.Array], dict]:
    """Hard cross-entropy per depth k against the data token t + k + 2, with accuracies.

    logits_per_depth: an iterable of `[B, T, V]` logits, the k-th predicting the token at
    t + k + 2. Returns ([loss_k], {"acc{k}": ...}).
    """
    losses, metrics = [], {}
    for k, logits in enumerate(logits_per_depth):
        labels = shift_left(batch["tokens"], k + 2)
        mask = label_mask(batch, k + 2)
        losses.append(masked_mean(hard_cross_entropy(logits, labels), mask))
        metrics[f"acc{k}"] = masked_mean(jnp.argmax(logits, -1) == labels, mask)
    return losses, metrics
