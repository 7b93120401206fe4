"""DSpark: the DFlash block backbone + a sequential low-rank correction + per-position confidence.

Block position k (k = 0..Bs-1, `predict_offset = 0`) predicts the token at M + k + 1, so a
block of Bs drafts Bs tokens. On top of the backbone's logits `base_k = head(h_k)`:

- correction (a low-rank token-transition bias, applied sequentially while drafting): with the
  previous token y_{k-1} (the root for k = 0),
      logits_k = base_k + ((P[y_{k-1}] * W h_k) @ S^T)        P, S `[V, r]`, W `[H, r]`
  S starts at zero, so an untrained DSpark drafts like its backbone;
- confidence: c_k = sigmoid(w . [h_k; P[y_{k-1}]] + b), trained to predict the acceptance
  probability 1 - TV(q_k, p_k) of position k. At inference the product of confidences along a
  node's path sets whether the node is verified (`Draft.valid`): each row verifies its own
  number of tokens inside the fixed padded shape.

Loss (`dspark_loss`): DFlash's anchored blocks, teacher-forced previous tokens,
cross-entropy + tv_weight * TV(q, p) + conf_weight * BCE(c, 1 - TV).

Drafting (`DSparkDrafter`, a `BlockDrafter`): node i at depth d drafts from
`base_d + transition_bias(h_d, parent token)` (the root's token at depth 1), so a chain
applies the correction sequentially (y_1 conditions y_2, ...). Its
confidence `sigmoid(confidence_logit(h_d, parent token))` estimates P(accepted | parent
accepted); a node is verified only while the product of confidences along its path stays
>= confidence_threshold (0: verify everything). The confidences depend on the draft alone, so
sampling stays lossless; padded (invalid) nodes are never accepted.
"""
from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters.learned.blocks import TargetView, output_norm_from_target
from specjax.drafters.learned.dflash import (
    BLOCK_OPTIONS,
    BlockDrafter,
    DFlashConfig,
    DFlashModel,
    init_block,
    position_metrics,
    training_blocks,
    weighted_mean,
)
from specjax.drafters.learned.drafting import path_log_probs
from specjax.drafters.learned.kind import HeadKind
from specjax.drafters.learned.objectives import hard_cross_entropy
from specjax.models.llama import _dense


@dataclasses.dataclass(frozen=True)
class DSparkConfig(DFlashConfig):
    """DFlash's fields plus the correction rank and the loss weights."""

    markov_rank: int = 32
    tv_weight: float = 1.0
    conf_weight: float = 1.0
    kind: str = "dspark"

    @property
    def predict_offset(self) -> int:
        return 0


class DSparkModel(DFlashModel):
    cfg: DSparkConfig

    def setup(self):
        super().setup()
        dtype = self.cfg.layer.jnp_dtype
        vocab, rank = self.cfg.target.vocab_size, self.cfg.markov_rank
        self.prev_codebook = nn.Embed(vocab, rank, dtype=dtype, param_dtype=dtype,
                                      embedding_init=nn.initializers.normal(0.02))
        self.next_codebook = nn.Embed(vocab, rank, dtype=dtype, param_dtype=dtype,
                                      embedding_init=nn.initializers.zeros)
        self.hidden_proj = _dense(rank, "hidden_proj", dtype)
        self.confidence = _dense(1, "confidence", dtype, use_bias=True)

    def transition_bias(self, hidden: jax.Array, prev: jax.Array) -> jax.Array:
        """hidden `[..., H]`, previous tokens `[...]` -> f32 logit bias `[..., V]`."""
        return self.next_codebook.attend(self.prev_codebook(prev) * self.hidden_proj(hidden)).astype(jnp.float32)

    def confidence_logit(self, hidden: jax.Array, prev: jax.Array) -> jax.Array:
        """`[...]` f32 logit of the acceptance probability of the position."""
        features = jnp.concatenate([hidden, self.prev_codebook(prev)], axis=-1)
        return self.confidence(features)[..., 0].astype(jnp.float32)

    def __call__(self, layer_hidden, x, positions):
        hidden = super().__call__(layer_hidden, x, positions)
        prev = jnp.zeros(hidden.shape[:-1], jnp.int32)
        return self.transition_bias(hidden, prev), self.confidence_logit(hidden, prev)


def init_dspark(cfg: DSparkConfig, key: jax.Array, consts: dict | None = None):
    return init_block(DSparkModel(cfg), key, consts)


def dspark_loss(head_cfg: DSparkConfig, variables, parts, tout, batch, key):
    model = DSparkModel(head_cfg)
    blocks = training_blocks(model, variables, parts, tout, batch, key)
    labels, weights, view = blocks.labels, blocks.weights, TargetView(head_cfg.target)
    first = jnp.take_along_axis(batch["tokens"], blocks.anchors, axis=1)
    prev = jnp.concatenate([first[..., None], labels[..., :-1]], axis=-1)  # teacher forcing
    logits = view.logits(parts, blocks.hidden)
    logits = logits + model.apply(variables, blocks.hidden, prev, method="transition_bias")
    seq = batch["tokens"].shape[1]
    target_hidden = jnp.take_along_axis(
        tout.hidden[:, None], jnp.minimum(blocks.label_pos - 1, seq - 1)[..., None], axis=2)
    target_logits = view.logits(parts, target_hidden)  # [B, A, D, V]
    tv = 0.5 * jnp.sum(jnp.abs(jax.nn.softmax(logits, -1) - jax.nn.softmax(target_logits, -1)), -1)
    conf = model.apply(variables, blocks.hidden, prev, method="confidence_logit")
    import optax  # ~0.3 s of start-up that only training needs

    bce = optax.sigmoid_binary_cross_entropy(conf, jax.lax.stop_gradient(1.0 - tv))
    ce = weighted_mean(hard_cross_entropy(logits, labels), weights)
    tv_mean, bce_mean = weighted_mean(tv, weights), weighted_mean(bce, weights)
    loss = ce + head_cfg.tv_weight * tv_mean + head_cfg.conf_weight * bce_mean
    metrics = {"ce": ce, "tv": tv_mean, "conf_bce": bce_mean,
               **position_metrics(logits, labels, weights)}
    return loss, metrics


@dataclasses.dataclass(frozen=True)
class DSparkDrafter(BlockDrafter):
    module_class = DSparkModel
    confidence_threshold: float = 0.1

    def _level_logits(self, params, hidden, level: int, parent_tokens):
        h = hidden[:, level]  # [B, H]
        base = self.view.logits(params["target"], h)[:, None]  # [B, 1, V]
        h_rows = jnp.broadcast_to(h[:, None], parent_tokens.shape + h.shape[-1:])
        return base + self._call(params, "transition_bias", h_rows, parent_tokens)

    def node_confidence(self, params, hidden, tokens, root) -> jax.Array:
        """`[B, N]` confidence of each node given its parent token (root at depth 1)."""
        tree = self.tree
        parents = np.asarray(tree.parents)
        prev = jnp.where(parents[None] < 0, root[:, None], tokens[:, np.maximum(parents, 0)])
        h = hidden[:, tree.node_depth - 1]  # [B, N, H]
        return jax.nn.sigmoid(self._call(params, "confidence_logit", h, prev))

    def _valid(self, params, hidden, tokens, root, valid):
        if self.confidence_threshold <= 0:
            return valid
        conf = self.node_confidence(params, hidden, tokens, root)
        path = jnp.exp(path_log_probs(jnp.log(jnp.maximum(conf, 1e-30)), self.tree))
        return valid & (path >= self.confidence_threshold)


KIND = HeadKind(
    name="dspark",
    summary="DSpark: the DFlash block + a sequential low-rank correction + per-node confidence",
    config=DSparkConfig,
    model=DSparkModel,
    init=init_dspark,
    loss=dspark_loss,
    drafter=DSparkDrafter,
    options=BLOCK_OPTIONS,
    init_from_target=functools.partial(output_norm_from_target, "norm"),
)
