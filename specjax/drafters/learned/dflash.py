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

Loss (`dflash_loss`): random anchors a in the response, the block [x_a, MASK...] per anchor
with context j < a, all anchors of a sequence in one masked forward (`anchored_blocks`); hard
cross-entropy per block position with weight exp(-(k-1)/gamma).

Drafting (`BlockDrafter`, shared with DSpark). State: the head's context K/V cache (every
draft layer's projections of the committed tokens' target features), with the committed
length mirroring the target cache's.

- prefill: the prompt's features (positions 0..P-1) enter the context cache.
- update (after commit): the accepted path's rows (root + accepted nodes: positions M..M+n)
  enter the context cache.
- propose: ONE forward of the block [root, MASK, ...] at positions M..M+Bs-1 against the
  context cache gives the hidden state of every draft position; depth d of the tree takes
  draft position d's distribution (`_level_logits`: DFlash's does not depend on the parent;
  DSpark adds its sequential correction from the parent token). A chain of D <= num_draft
  tokens is the usual shape; trees take the per-depth top-k / sampled candidates.

Drafter params: `{"head": head variables, "target": TargetView.parts(target params)}`.

Upstream layout (z-lab/dflash `dflash/model.py`), imported and exported as "dflash-hf":
  fc.weight [H, k*H]; hidden_norm.weight; norm.weight; layers.{i}.input_layernorm.weight,
  layers.{i}.post_attention_layernorm.weight, layers.{i}.self_attn.{q,k,v,o}_proj.weight
  [.bias], layers.{i}.self_attn.{q_norm,k_norm}.weight, layers.{i}.mlp.{gate,up,down}_proj.
  config: the layer dims, num_hidden_layers, and `dflash_config` (or top level):
  target_layer_ids (outputs of those target layers), block_size, mask_token_id.
"""
from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct

from specjax.drafters.learned.blocks import (
    HeadLayer,
    TargetView,
    attention,
    evenly_spaced_layers,
    hf_layer_names,
    layer_config,
    layer_from_hf,
    layer_to_hf,
    output_norm_from_target,
    prefix_mask,
)
from specjax.drafters.learned.drafting import (
    HeadDrafter,
    accepted_rows,
    draft_levels,
    make_draft,
)
from specjax.drafters.learned.kind import HeadKind, HeadOption, TensorNames, UpstreamLayout
from specjax.drafters.learned.objectives import hard_cross_entropy, masked_mean
from specjax.models.cache import KVCache, empty_cache, write
from specjax.models.config import ModelConfig
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


def init_block(model: DFlashModel, key: jax.Array, consts: dict | None = None):
    """Random variables `{"params", "consts"}` of a block head module (DFlash or DSpark)."""
    t = model.cfg.target
    hidden = jnp.zeros((1, 1, t.hidden_size), t.jnp_dtype)
    positions = jnp.zeros((1, 1), jnp.int32)
    variables = dict(model.init(key, tuple(hidden for _ in model.cfg.hidden_layers), hidden,
                                positions))
    variables["consts"] = {**variables.get("consts", {}), **(consts or {})}
    return variables


def init_dflash(cfg: DFlashConfig, key: jax.Array, consts: dict | None = None):
    return init_block(DFlashModel(cfg), key, consts)


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


# ---- loss ----------------------------------------------------------------------------------------


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


@struct.dataclass
class TrainingBlocks:
    """The anchored blocks of a batch, as the block losses read them."""

    anchors: jax.Array  # [B, A] block starts
    hidden: jax.Array  # [B, A, D, H] normalised hidden states of the draft positions
    labels: jax.Array  # [B, A, D] data tokens each draft position predicts
    label_pos: jax.Array  # [B, A, D] their positions
    weights: jax.Array  # [B, A, D] exp(-depth / gamma) on response labels, 0 elsewhere


def training_blocks(model: DFlashModel, variables, parts, tout, batch, key) -> TrainingBlocks:
    head_cfg = model.cfg
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
    return TrainingBlocks(anchors, hidden, labels, label_pos, weights)


def weighted_mean(x, weights):
    return jnp.sum(x * weights) / jnp.maximum(jnp.sum(weights), 1e-6)


def position_metrics(logits, labels, weights) -> dict:
    """{"acc{j}": accuracy at block draft position j}."""
    hit = (jnp.argmax(logits, -1) == labels).astype(jnp.float32)
    mask = weights > 0
    return {f"acc{j}": masked_mean(hit[..., j], mask[..., j]) for j in range(labels.shape[-1])}


def dflash_loss(head_cfg: DFlashConfig, variables, parts, tout, batch, key):
    blocks = training_blocks(DFlashModel(head_cfg), variables, parts, tout, batch, key)
    logits = TargetView(head_cfg.target).logits(parts, blocks.hidden)  # [B, A, D, V]
    loss = weighted_mean(hard_cross_entropy(logits, blocks.labels), blocks.weights)
    return loss, position_metrics(logits, blocks.labels, blocks.weights)


# ---- drafting ------------------------------------------------------------------------------------


@struct.dataclass
class BlockState:
    cache: KVCache  # the context keys/values of Ld layers; lengths [B] committed tokens


@dataclasses.dataclass(frozen=True)
class BlockDrafter(HeadDrafter):
    """DFlash drafting: the tree's depth must not exceed the head's num_draft (DSpark
    subclasses it with its own `module_class`)."""

    module_class = DFlashModel

    @property
    def deepest_draft(self) -> int:
        return self.head.num_draft

    def _ingest(self, params, state: BlockState, layer_hidden, new_lengths) -> BlockState:
        """Feature rows (each `[B, T, H]`) of positions lengths.. -> context cache."""
        cache = state.cache
        seq = layer_hidden[0].shape[1]
        positions = cache.lengths[:, None] + jnp.arange(seq, dtype=jnp.int32)[None, :]
        context = self._call(params, "context", layer_hidden)
        k, v = self._call(params, "context_kv", context, positions)
        return BlockState(cache=write(cache, k, v).replace(lengths=new_lengths.astype(jnp.int32)))

    # ---- Drafter interface -----------------------------------------------------------------

    def init(self, params, batch_size: int, width: int) -> BlockState:
        c = self.head.layer
        return BlockState(cache=empty_cache(c.num_layers, batch_size, width, c.num_kv_heads,
                                            c.head_dim, c.jnp_dtype))

    def prefill(self, params, state, decode, target_out):
        return self._ingest(params, state, target_out.layer_hidden, decode.cache.lengths)

    def update(self, params, state, decode, result, target_out):
        rows = tuple(accepted_rows(h, result) for h in target_out.layer_hidden)
        return self._ingest(params, state, rows, decode.cache.lengths)

    def block_hidden(self, params, state: BlockState, root: jax.Array) -> jax.Array:
        """`[B, num_draft, H]`: hidden state of each draft position after the root `[B]`."""
        head, cache = self.head, state.cache
        size = head.block_size
        tokens = jnp.concatenate(
            [root[:, None], jnp.full((root.shape[0], size - 1), head.mask_token_id, jnp.int32)], 1)
        positions = cache.lengths[:, None] + jnp.arange(size, dtype=jnp.int32)[None, :]
        x = self.view.embed(params["target"], tokens)
        everything = jnp.ones((1, size, size), bool)
        hidden = self._call(params, "block", x, positions, *cache.token_major(),
                            prefix_mask(cache.lengths, cache.capacity), everything)
        return hidden[:, head.predict_offset:]

    def _level_logits(self, params, hidden, level: int, parent_tokens):
        """Logits `[B, n | 1, V]` of depth level+1 given its parents' tokens `[B, n]`."""
        del parent_tokens
        return self.view.logits(params["target"], hidden[:, level])[:, None]

    def _valid(self, params, hidden, tokens, root, valid):
        """Which drafted nodes `[B, N]` to verify (DFlash: all the draw left valid)."""
        del params, hidden, tokens, root
        return valid

    def propose(self, params, state: BlockState, decode, key, sampling):
        root = decode.last_token
        hidden = self.block_hidden(params, state, root)

        def expand(level, tokens, carry):
            return self._level_logits(params, hidden, level + 1, tokens), carry

        first = self._level_logits(params, hidden, 0, root[:, None])
        tokens, valid, probs, _, _ = draft_levels(self.tree, first, expand, (), key, sampling)
        valid = self._valid(params, hidden, tokens, root, valid)
        return make_draft(tokens, valid, probs), state


# ---- upstream layout ("dflash-hf") ---------------------------------------------------------------


def tensor_names(cfg: DFlashConfig) -> TensorNames:
    out = [("fc.weight", ("fc", "kernel"), True),
           ("hidden_norm.weight", ("hidden_norm", "scale"), False),
           ("norm.weight", ("norm", "scale"), False)]
    for i in range(cfg.layer.num_layers):
        out.append((f"layers.{i}.input_layernorm.weight", (f"input_layernorm_{i}", "scale"), False))
        out += hf_layer_names(f"layers.{i}.", (f"layers_{i}",), cfg.layer)
    return out


def config_from_hf(config: dict, target: ModelConfig) -> DFlashConfig:
    draft = {**config, **(config.get("dflash_config") or {})}
    num_layers = int(config.get("num_hidden_layers", 1))
    head = DFlashConfig.for_target(
        target, num_draft_layers=num_layers,
        feature_layers=tuple(int(i) for i in draft["target_layer_ids"]),
        block_size=int(draft.get("block_size", 16)),
        mask_token_id=int(draft.get("mask_token_id", target.pad_token_id)),
    )
    return dataclasses.replace(head, layer=layer_from_hf(config, target, num_layers, qk_norm=True))


def config_to_hf(cfg: DFlashConfig) -> dict:
    return {"architectures": ["DFlashDraftModel"], **layer_to_hf(cfg.layer, cfg.target),
            "dflash_config": {"target_layer_ids": list(cfg.feature_layers),
                              "block_size": cfg.block_size, "mask_token_id": cfg.mask_token_id}}


#: the `train-drafter` options of the block heads (DFlash, DSpark)
BLOCK_OPTIONS = (HeadOption("block-size", "block_size", 2, "block size"),
                 HeadOption("draft-layers", "num_draft_layers", 1, "draft decoder layers"))

KIND = HeadKind(
    name="dflash",
    summary="DFlash: one bidirectional block forward drafts block_size - 1 tokens",
    config=DFlashConfig,
    model=DFlashModel,
    init=init_dflash,
    loss=dflash_loss,
    drafter=BlockDrafter,
    options=BLOCK_OPTIONS,
    init_from_target=functools.partial(output_norm_from_target, "norm"),
    upstream=UpstreamLayout("dflash-hf", tensor_names, config_from_hf, config_to_hf),
)
