"""DFlash block drafter: one forward drafts a whole block, conditioned on target features.

Context: the target's hidden states from `feature_layers` (evenly spaced), concatenated and
projected, `c_t = hidden_norm(fc([h_l1; ...; h_lk]_t))` `[B, T, H]`, enter every draft layer
as extra keys/values (`k_proj(c_t)`, `v_proj(c_t)` of that layer, RoPE at position t); they
are computed once per committed token and cached.

Block: after the committed prefix (positions < M, whose features are known) the block is
`[x_M (the root, not yet verified), MASK, ..., MASK]` at positions M..M+Bs-1, embedded with
the target's embedding. Each draft layer: q/k/v of the block (bidirectional inside the block)
attend to the cached context plus the block; then the final norm and the target's LM head.
Block position k predicts the token at position M + k (k = 1..Bs-1), so a round drafts
Bs - 1 tokens (`predict_offset = 1`; DSpark uses 0: position k predicts M + k + 1).

Training (`specjax.train.losses.dflash_loss`) draws random anchors a in the response, builds
the block [x_a, MASK...] per anchor with context j < a, and runs all anchors of a sequence in
one masked forward.
"""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from specjax.models.config import ModelConfig
from specjax.models.heads import HeadLayer, attention, evenly_spaced_layers, layer_config
from specjax.models.llama import RMSNorm, _dense


@dataclasses.dataclass(frozen=True)
class DFlashConfig:
    """Static description of a DFlash head.

    layer: draft decoder layer dims (target's, q/k norm on as upstream), num_layers = depth.
    block_size: Bs; the drafter proposes num_draft = Bs - predict_offset tokens per round.
    mask_token_id: the target token whose embedding fills the masked block positions.
    num_anchors / loss_gamma: training blocks per sequence; position weight exp(-j / gamma).
    """

    target: ModelConfig
    layer: ModelConfig
    feature_layers: tuple[int, ...]
    block_size: int = 8
    mask_token_id: int = 0
    num_anchors: int = 16
    loss_gamma: float = 4.0
    kind: str = "dflash"

    @classmethod
    def for_target(cls, target: ModelConfig, num_draft_layers: int = 1,
                   num_feature_layers: int | None = None, feature_layers=None,
                   mask_token_id: int | None = None, **kwargs):
        count = num_feature_layers or min(target.num_layers, max(3, num_draft_layers))
        return cls(
            target=target,
            layer=layer_config(target, num_draft_layers, qk_norm=True),
            feature_layers=tuple(feature_layers or evenly_spaced_layers(target.num_layers, count)),
            mask_token_id=target.pad_token_id if mask_token_id is None else mask_token_id,
            **kwargs,
        )

    def __post_init__(self):
        if self.block_size - self.predict_offset < 1:
            raise ValueError(f"block_size {self.block_size} drafts no token")

    @property
    def predict_offset(self) -> int:
        return 1

    @property
    def num_draft(self) -> int:
        """Draft tokens per round (the deepest tree this head can fill)."""
        return self.block_size - self.predict_offset

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return self.feature_layers


class DFlashModel(nn.Module):
    cfg: DFlashConfig

    def setup(self):
        c = self.cfg.layer
        dtype = c.jnp_dtype
        self.fc = _dense(c.hidden_size, "fc", dtype)
        self.hidden_norm = RMSNorm(c.rms_norm_eps, dtype)
        self.layers = [HeadLayer(c, name=f"layers_{i}") for i in range(c.num_layers)]
        self.input_norms = [RMSNorm(c.rms_norm_eps, dtype, name=f"input_layernorm_{i}")
                            for i in range(c.num_layers)]
        self.norm = RMSNorm(c.rms_norm_eps, dtype)

    def context(self, layer_hidden: tuple[jax.Array, ...]) -> jax.Array:
        """Feature-layer hidden states (each `[B, T, H]`) -> context c `[B, T, H]`."""
        return self.hidden_norm(self.fc(jnp.concatenate(layer_hidden, axis=-1)))

    def context_kv(self, context: jax.Array, positions: jax.Array):
        """c `[B, T, H]`, positions `[B, T]` -> k, v `[Ld, B, T, KVH, Dh]` for every layer."""
        kv = [layer.kv(context, positions) for layer in self.layers]
        return jnp.stack([k for k, _ in kv]), jnp.stack([v for _, v in kv])

    def block(self, x, positions, ctx_k, ctx_v, ctx_mask, self_mask):
        """Block embeddings x `[B, Q, H]` at positions `[B, Q]` against the context keys
        `[Ld, B, S, KVH, Dh]` (mask `[B|1, Q, S]`) and themselves (mask `[B|1, Q, Q]`)
        -> normalised hidden `[B, Q, H]`."""
        for i, (layer, norm) in enumerate(zip(self.layers, self.input_norms)):
            q, k, v = layer.qkv(norm(x), positions)
            attn = attention(q, [(ctx_k[i], ctx_v[i], ctx_mask), (k, v, self_mask)])
            x = layer.finish(attn, x)
        return self.norm(x)

    def __call__(self, layer_hidden, x, positions):
        """Creates every param: context = the same T positions (visible up to t)."""
        seq = x.shape[1]
        ctx_k, ctx_v = self.context_kv(self.context(layer_hidden), positions)
        causal = jnp.tril(jnp.ones((seq, seq), bool))[None]
        return self.block(x, positions, ctx_k, ctx_v, causal, causal)


def block_model(cfg) -> DFlashModel:
    """The Flax module of a block head config (DFlash or DSpark)."""
    if cfg.kind == "dspark":
        from specjax.models.dspark import DSparkModel

        return DSparkModel(cfg)
    return DFlashModel(cfg)


def init_block_head(cfg, key: jax.Array, consts: dict | None = None):
    """Random variables `{"params", "consts"}` of a DFlash / DSpark head."""
    t = cfg.target
    hidden = jnp.zeros((1, 1, t.hidden_size), t.jnp_dtype)
    positions = jnp.zeros((1, 1), jnp.int32)
    variables = dict(block_model(cfg).init(key, tuple(hidden for _ in cfg.hidden_layers), hidden,
                                           positions))
    variables["consts"] = {**variables.get("consts", {}), **(consts or {})}
    return variables


def anchored_blocks(model: DFlashModel, variables, layer_hidden, embed, tokens: jax.Array,
                    anchors: jax.Array, keep: jax.Array) -> jax.Array:
    """Training forward of every anchored block of whole sequences in one masked pass.

    layer_hidden: the feature layers' hidden states (each `[B, T, H]`) of the sequences
    tokens `[B, T]`; anchors `[B, A]` block starts a (the block is [x_a, MASK...] at positions
    a..a+Bs-1 and sees the context of positions < a, as at inference); keep `[B, A]` (a
    dropped block sees only itself). embed: tokens -> embeddings.
    Returns the normalised hidden states `[B, A, Bs, H]`.
    """
    cfg = model.cfg
    batch, seq = tokens.shape
    num_anchors, size = anchors.shape[1], cfg.block_size
    positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
    context = model.apply(variables, layer_hidden, method="context")
    ctx_k, ctx_v = model.apply(variables, context, positions, method="context_kv")
    first = jnp.take_along_axis(tokens, anchors, axis=1)  # [B, A]
    block = jnp.concatenate(
        [first[..., None], jnp.full((batch, num_anchors, size - 1), cfg.mask_token_id, jnp.int32)], -1)
    block_pos = (anchors[..., None] + jnp.arange(size)).reshape(batch, -1)  # [B, Q]
    query_anchor = jnp.repeat(anchors, size, axis=1)  # [B, Q]
    ctx_mask = (jnp.arange(seq)[None, None, :] < query_anchor[..., None]) & jnp.repeat(keep, size, 1)[..., None]
    block_id = jnp.arange(num_anchors * size) // size
    self_mask = (block_id[:, None] == block_id[None, :])[None]
    hidden = model.apply(variables, embed(block.reshape(batch, -1)), block_pos, ctx_k, ctx_v,
                         ctx_mask, self_mask, method="block")
    return hidden.reshape(batch, num_anchors, size, -1)
