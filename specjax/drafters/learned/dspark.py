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

Training (`specjax.train.losses.dspark_loss`): DFlash's anchored blocks, teacher-forced
previous tokens, cross-entropy + tv_weight * TV(q, p) + conf_weight * BCE(c, 1 - TV).
"""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from specjax.models.dflash import DFlashConfig, DFlashModel
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
