"""Training losses of the learned drafters (all math in f32).

Every loss has the signature

    loss(head_cfg, variables, parts, tout, batch, key) -> (scalar loss, {metric: scalar})

variables: the head's `{"params", "consts"}`; parts: the target's frozen views
(`TargetView.parts`); tout: the frozen target forward over the batch (`target_pass`: final
hidden `[B, T, H]`, the head's layer_hidden; no logits); batch: tokens `[B, T]`,
lengths `[B]`, prompt_lens `[B]`. A label at position p counts when p holds a response token
(prompt_len <= p < length).

- EAGLE-3 (`eagle3_loss`): training-time test over `ttt_steps` steps; step k at index t is
  scored against the target's distribution for token t+k+2 restricted to the draft vocabulary
  (soft cross-entropy; positions whose target token -- the data's, i.e. the target's own
  greedy choice -- is outside the draft vocabulary are skipped), weighted loss_decay ** k.
- MTP (`mtp_loss`): the same unroll, hard cross-entropy per depth on the data tokens (the
  target's own greedy outputs), weights loss_decay ** k.
- Medusa (`medusa_loss`): head k on the target's final hidden at t predicts token t+k+2.
- DFlash (`dflash_loss`): blocks at random response anchors, hard cross-entropy per block
  position with weight exp(-(k-1)/gamma).
- DSpark (`dspark_loss`): DFlash's block loss + alpha_tv * total variation to the target's
  distribution + alpha_conf * BCE(confidence, 1 - TV).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from specjax.models.cache import init_cache
from specjax.models.heads import TargetView, sequential_model, shift_left, ttt_unroll
from specjax.models.llama import forward
from specjax.train.data import response_mask


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


def label_mask(batch, offset: int) -> jax.Array:
    """`[B, T]`: the label at position t + offset is a response token."""
    mask = response_mask(batch["lengths"], batch["prompt_lens"], batch["tokens"].shape[1])
    return shift_left(mask, offset, fill=False)


def _weighted(per_step: list[jax.Array], decay: float) -> jax.Array:
    return sum(decay**k * loss for k, loss in enumerate(per_step))


# ---- sequential heads ------------------------------------------------------------------------


def _unroll(head_cfg, variables, parts, tout, batch):
    model = sequential_model(head_cfg)
    view = TargetView(head_cfg.target)
    features = model.apply(variables, tout.layer_hidden, method="features")
    outs = ttt_unroll(model, variables, features, lambda t: view.embed(parts, t), batch["tokens"],
                      head_cfg.ttt_steps)
    return model, outs


def eagle3_loss(head_cfg, variables, parts, tout, batch, key):
    del key
    model, outs = _unroll(head_cfg, variables, parts, tout, batch)
    d2t = variables["consts"]["draft_to_target"]
    in_draft = jnp.zeros((head_cfg.target.vocab_size,), bool).at[d2t].set(True)
    # the target's distribution over the draft vocabulary at every position `[B, T, Vd]`
    target_d = TargetView(head_cfg.target).logits_subset(parts, tout.hidden, d2t)
    losses, metrics = [], {}
    for k, out in enumerate(outs):
        logits = model.apply(variables, out, method="draft_logits")  # [B, T, Vd]
        target_p = jax.nn.softmax(shift_left(target_d, k + 1), axis=-1)  # token t + k + 2
        # positions whose target token (the data token: the target's own greedy output) lies
        # outside the draft vocabulary are skipped, as upstream
        labels = shift_left(batch["tokens"], k + 2)
        mask = label_mask(batch, k + 2) & in_draft[labels]
        losses.append(masked_mean(soft_cross_entropy(logits, target_p), mask))
        hit = jnp.argmax(logits, -1) == jnp.argmax(target_p, -1)
        metrics[f"acc{k}"] = masked_mean(hit, mask)
    return _weighted(losses, head_cfg.loss_decay), metrics


def mtp_loss(head_cfg, variables, parts, tout, batch, key):
    del key
    model, outs = _unroll(head_cfg, variables, parts, tout, batch)
    losses, metrics = [], {}
    for k, out in enumerate(outs):
        logits = model.apply(variables, out, parts, method="logits")  # [B, T, V]
        labels = shift_left(batch["tokens"], k + 2)
        mask = label_mask(batch, k + 2)
        losses.append(masked_mean(hard_cross_entropy(logits, labels), mask))
        metrics[f"acc{k}"] = masked_mean(jnp.argmax(logits, -1) == labels, mask)
    return _weighted(losses, head_cfg.loss_decay), metrics


# ---- block heads -----------------------------------------------------------------------------


def sample_anchors(key: jax.Array, batch, num_anchors: int):
    """Anchors `[B, A]` drawn uniformly without replacement among positions a whose next token
    is a response token (prompt_len - 1 <= a <= length - 2); keep `[B, A]` is False past a
    row's number of candidates."""
    tokens = batch["tokens"]
    t = jnp.arange(tokens.shape[1])[None, :]
    ok = (t >= batch["prompt_lens"][:, None] - 1) & (t <= batch["lengths"][:, None] - 2)
    scores = jnp.where(ok, jax.random.uniform(key, tokens.shape), -1.0)
    top, anchors = jax.lax.top_k(scores, min(num_anchors, tokens.shape[1]))
    keep = top >= 0
    return jnp.where(keep, anchors, 0).astype(jnp.int32), keep


def _blocks(head_cfg, variables, parts, tout, batch, key):
    """(model, anchors, hidden `[B, A, D, H]` of the draft positions, labels `[B, A, D]`,
    label positions `[B, A, D]`, weights `[B, A, D]`)."""
    from specjax.models.dflash import anchored_blocks, block_model

    model = block_model(head_cfg)
    view = TargetView(head_cfg.target)
    anchors, keep = sample_anchors(key, batch, head_cfg.num_anchors)
    hidden = anchored_blocks(model, variables, tout.layer_hidden, lambda t: view.embed(parts, t),
                             batch["tokens"], anchors, keep)[:, :, head_cfg.predict_offset:]
    depth = jnp.arange(head_cfg.num_draft)
    label_pos = anchors[..., None] + 1 + depth  # [B, A, D]
    seq = batch["tokens"].shape[1]
    labels = jnp.take_along_axis(batch["tokens"][:, None, :], jnp.minimum(label_pos, seq - 1), axis=2)
    in_response = ((label_pos < batch["lengths"][:, None, None])
                   & (label_pos >= batch["prompt_lens"][:, None, None]) & keep[..., None])
    weights = in_response * jnp.exp(-depth / head_cfg.loss_gamma)
    return model, anchors, hidden, labels, label_pos, weights


def _weighted_mean(x, weights):
    return jnp.sum(x * weights) / jnp.maximum(jnp.sum(weights), 1e-6)


def _position_metrics(logits, labels, weights) -> dict:
    hit = (jnp.argmax(logits, -1) == labels).astype(jnp.float32)
    mask = weights > 0
    return {f"acc{j}": masked_mean(hit[..., j], mask[..., j]) for j in range(labels.shape[-1])}


def dflash_loss(head_cfg, variables, parts, tout, batch, key):
    _, _, hidden, labels, _, weights = _blocks(head_cfg, variables, parts, tout, batch, key)
    logits = TargetView(head_cfg.target).logits(parts, hidden)  # [B, A, D, V]
    loss = _weighted_mean(hard_cross_entropy(logits, labels), weights)
    return loss, _position_metrics(logits, labels, weights)


def dspark_loss(head_cfg, variables, parts, tout, batch, key):
    model, anchors, hidden, labels, label_pos, weights = _blocks(
        head_cfg, variables, parts, tout, batch, key)
    first = jnp.take_along_axis(batch["tokens"], anchors, axis=1)
    prev = jnp.concatenate([first[..., None], labels[..., :-1]], axis=-1)  # teacher forcing
    logits = TargetView(head_cfg.target).logits(parts, hidden)
    logits = logits + model.apply(variables, hidden, prev, method="transition_bias")
    seq = batch["tokens"].shape[1]
    target_hidden = jnp.take_along_axis(
        tout.hidden[:, None], jnp.minimum(label_pos - 1, seq - 1)[..., None], axis=2)
    target_logits = TargetView(head_cfg.target).logits(parts, target_hidden)  # [B, A, D, V]
    tv = 0.5 * jnp.sum(jnp.abs(jax.nn.softmax(logits, -1) - jax.nn.softmax(target_logits, -1)), -1)
    conf = model.apply(variables, hidden, prev, method="confidence_logit")
    bce = optax.sigmoid_binary_cross_entropy(conf, jax.lax.stop_gradient(1.0 - tv))
    ce = _weighted_mean(hard_cross_entropy(logits, labels), weights)
    tv_mean, bce_mean = _weighted_mean(tv, weights), _weighted_mean(bce, weights)
    loss = ce + head_cfg.tv_weight * tv_mean + head_cfg.conf_weight * bce_mean
    metrics = {"ce": ce, "tv": tv_mean, "conf_bce": bce_mean,
               **_position_metrics(logits, labels, weights)}
    return loss, metrics


def medusa_loss(head_cfg, variables, parts, tout, batch, key):
    del key
    from specjax.models.mtp import MedusaModel

    outs = MedusaModel(head_cfg).apply(variables, tout.hidden)  # [K, B, T, H]
    view = TargetView(head_cfg.target)
    losses, metrics = [], {}
    for k in range(head_cfg.num_heads):
        logits = view.logits(parts, outs[k])
        labels = shift_left(batch["tokens"], k + 2)
        mask = label_mask(batch, k + 2)
        losses.append(masked_mean(hard_cross_entropy(logits, labels), mask))
        metrics[f"acc{k}"] = masked_mean(jnp.argmax(logits, -1) == labels, mask)
    return _weighted(losses, head_cfg.loss_decay), metrics


LOSSES = {"eagle3": eagle3_loss, "mtp": mtp_loss, "medusa": medusa_loss, "dflash": dflash_loss,
          "dspark": dspark_loss}


def loss_fn(head_cfg):
    """The loss function of a head config (by its `kind`)."""
    try:
        return LOSSES[head_cfg.kind]
    except KeyError:
        raise ValueError(f"no loss for drafter kind {head_cfg.kind!r}") from None
