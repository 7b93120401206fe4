"""EAGLE-3 draft head: fused low/mid/high target features + one decoder layer + a (reduced) LM head.

Data flow for the draft entry at position t (inference and training alike):

    feature f_t = fc([h_low; h_mid; h_high]_t)          `[B, T, 3H] -> [B, T, H]`   (target)
             or  the head's own output at the previous draft step               (drafting)
    a_t      = [input_layernorm(embed(x_{t+1})); hidden_norm(f_t)]   `[B, T, 2H]`
    o_t      = layer(a_t, residual f_t)                              `[B, T, H]`
    logits   = lm_head(norm(o_t))  over the draft vocabulary Vd -> predicts x_{t+2}

The draft vocabulary is the Vd most frequent target tokens of the training data;
`consts/draft_to_target` `[Vd]` int32 maps draft ids to target ids (identity when Vd = V).
The embedding is the target's (frozen). Sequential heads share this *cell* protocol with MTP
(`mtp.py`): `features`, `cell_qkv`, `cell_finish`, `draft_logits`, `logits`; drafting and the
training-time-test unroll are `sequential.py`'s.

Loss (`eagle3_loss`): training-time test over `ttt_steps` steps; step k at index t is scored
against the target's distribution for token t+k+2 restricted to the draft vocabulary (soft
cross-entropy; positions whose target token -- the data's, i.e. the target's own greedy choice
-- is outside the draft vocabulary are skipped), weighted loss_decay ** k.

Upstream layout (SafeAILab/EAGLE `eagle/traineagle3/cnets.py`; SpecForge / SGLang / vLLM
`LlamaForCausalLMEagle3` configs), imported and exported as "eagle3-hf":
  fc.weight [H, 3H]; midlayer.{input_layernorm, hidden_norm, post_attention_layernorm}.weight;
  midlayer.self_attn.{q,k,v,o}_proj.weight (q/k/v read 2H); midlayer.mlp.{gate,up,down}_proj;
  norm.weight; lm_head.weight [Vd, H]; d2t [Vd] (target id = draft id + d2t[draft id]); t2d [V]
  bool (exported; ignored on import). config.json: the Llama fields of the layer (model_type
  "llama", hidden_act, torch_dtype, hidden_size, intermediate_size, num_attention_heads,
  num_key_value_heads, head_dim, rms_norm_eps, rope_theta, rope_scaling, vocab_size, ...),
  draft_vocab_size, and eagle_config.eagle_aux_hidden_state_layer_ids: ids of the decoder
  layers whose *input* is taken, i.e. our feature layer = id - 1.
"""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters.learned.blocks import (
    HeadLayer,
    TargetView,
    attention,
    calibrated_norm,
    causal,
    hf_layer_names,
    layer_config,
    layer_from_hf,
    layer_to_hf,
    shift_left,
    target_lm_head,
)
from specjax.drafters.learned.kind import HeadKind, HeadOption, TensorNames, UpstreamLayout
from specjax.drafters.learned.objectives import (
    decayed_sum,
    label_mask,
    masked_mean,
    soft_cross_entropy,
)
from specjax.drafters.learned.sequential import SequentialDrafter, init_sequential, training_unroll
from specjax.models.config import ModelConfig
from specjax.models.llama import RMSNorm, _dense
from specjax.sampling import MASKED_LOGIT


def eagle3_feature_layers(num_target_layers: int) -> tuple[int, int, int]:
    """Low, middle and high target layers (outputs of layers 1, L/2 - 1, L - 4 as upstream),
    clamped into [0, L - 1] for tiny targets."""
    last = num_target_layers - 1
    pick = lambda i: min(max(i, 0), last)
    return (pick(1), pick(num_target_layers // 2 - 1), pick(num_target_layers - 4))


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """Static description of an EAGLE-3 head for one target.

    layer: dimensions of the draft decoder layer (the target's by default).
    feature_layers: the three target layers whose outputs are fused.
    draft_vocab_size: Vd (= target vocab: no reduction).
    ttt_steps / loss_decay: training-time-test unroll length and per-step loss weight decay.
    """

    target: ModelConfig
    layer: ModelConfig
    feature_layers: tuple[int, ...]
    draft_vocab_size: int
    ttt_steps: int = 4
    loss_decay: float = 0.8
    kind: str = "eagle3"

    @classmethod
    def for_target(cls, target: ModelConfig, draft_vocab_size: int | None = None,
                   feature_layers: tuple[int, ...] | None = None, **kwargs) -> Eagle3Config:
        return cls(
            target=target,
            layer=layer_config(target),
            feature_layers=tuple(feature_layers or eagle3_feature_layers(target.num_layers)),
            draft_vocab_size=int(draft_vocab_size or target.vocab_size),
            **kwargs,
        )

    def __post_init__(self):
        if not 0 < self.draft_vocab_size <= self.target.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} must be in "
                             f"[1, {self.target.vocab_size}] (the target's vocabulary)")

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """Target layers the head reads (`ForwardOutput.layer_hidden`)."""
        return self.feature_layers

    @property
    def reduced_vocab(self) -> bool:
        return self.draft_vocab_size != self.target.vocab_size


class Eagle3Model(nn.Module):
    cfg: Eagle3Config

    def setup(self):
        c = self.cfg.layer
        dtype = c.jnp_dtype
        self.fc = _dense(c.hidden_size, "fc", dtype)
        self.input_layernorm = RMSNorm(c.rms_norm_eps, dtype)
        self.hidden_norm = RMSNorm(c.rms_norm_eps, dtype)
        self.layer = HeadLayer(c)
        self.norm = RMSNorm(c.rms_norm_eps, dtype)
        self.lm_head = _dense(self.cfg.draft_vocab_size, "lm_head", dtype)
        self.draft_to_target = self.variable(
            "consts", "draft_to_target",
            lambda: jnp.arange(self.cfg.draft_vocab_size, dtype=jnp.int32),
        )

    def features(self, layer_hidden: tuple[jax.Array, ...]) -> jax.Array:
        """Target hidden states of the feature layers (each `[B, T, H]`) -> f `[B, T, H]`."""
        return self.fc(jnp.concatenate(layer_hidden, axis=-1))

    def cell_qkv(self, feature, emb, positions):
        """feature `[B, T, H]`, emb `[B, T, H]` of the next tokens -> (q, k, v, residual)."""
        a = jnp.concatenate([self.input_layernorm(emb), self.hidden_norm(feature)], axis=-1)
        q, k, v = self.layer.qkv(a, positions)
        return q, k, v, feature

    def cell_finish(self, attn, residual):
        return self.layer.finish(attn, residual)

    def draft_logits(self, out, parts=None):
        """out `[..., H]` -> f32 logits over the draft vocabulary `[..., Vd]`."""
        del parts
        return self.lm_head(self.norm(out)).astype(jnp.float32)

    def logits(self, out, parts=None):
        """out `[..., H]` -> f32 logits over the target vocabulary `[..., V]` (-inf outside the
        draft vocabulary)."""
        small = self.draft_logits(out)
        if not self.cfg.reduced_vocab:
            return small
        full = jnp.full(small.shape[:-1] + (self.cfg.target.vocab_size,), MASKED_LOGIT, jnp.float32)
        return full.at[..., self.draft_to_target.value].set(small)

    def __call__(self, layer_hidden, emb, positions):
        """Creates every param: one step over T entries (causal self-attention)."""
        q, k, v, res = self.cell_qkv(self.features(layer_hidden), emb, positions)
        out = self.cell_finish(attention(q, [(k, v, causal(emb.shape[1]))]), res)
        return self.logits(out)


def init_eagle3(cfg: Eagle3Config, key: jax.Array, consts: dict | None = None):
    """Random EAGLE-3 head variables; consts["draft_to_target"] `[Vd]` target ids (sorted)
    when the vocabulary is reduced."""
    if consts and "draft_to_target" in consts:
        ids = jnp.asarray(consts["draft_to_target"], jnp.int32)
        if ids.shape != (cfg.draft_vocab_size,):
            raise ValueError(f"draft_to_target has shape {ids.shape}, want ({cfg.draft_vocab_size},)")
        consts = {**consts, "draft_to_target": ids}
    return init_sequential(Eagle3Model(cfg), cfg, key, consts)


def init_from_target(cfg: Eagle3Config, variables, target_params):
    """The draft LM head starts as the target head's columns of the draft vocabulary, and the
    norm before it from the target's (`calibrated_norm`)."""
    head_weight = target_lm_head(cfg.target, target_params)[:, variables["consts"]["draft_to_target"]]
    params = dict(variables["params"])
    params["lm_head"] = {"kernel": jnp.asarray(head_weight, params["lm_head"]["kernel"].dtype)}
    params["norm"] = calibrated_norm(target_params, head_weight)
    return {**variables, "params": params}


def draft_vocabulary(response_tokens: np.ndarray, vocab_size: int, draft_vocab_size: int) -> np.ndarray:
    """`[Vd]` sorted target ids: the Vd most frequent of the response tokens `[N]` (ties: lower
    id), topped up with the lowest unused ids when the data has fewer distinct tokens."""
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size must be in [1, {vocab_size}], got {draft_vocab_size}")
    counts = np.bincount(response_tokens, minlength=vocab_size)[:vocab_size]
    order = np.lexsort((np.arange(vocab_size), -counts))  # by count desc, then id asc
    return np.sort(order[:draft_vocab_size]).astype(np.int32)


def consts_from_data(cfg: Eagle3Config, response_tokens: np.ndarray) -> dict | None:
    """A reduced vocabulary is the training data's most frequent response tokens."""
    if not cfg.reduced_vocab:
        return None
    return {"draft_to_target": draft_vocabulary(response_tokens, cfg.target.vocab_size,
                                                cfg.draft_vocab_size)}


def eagle3_loss(head_cfg: Eagle3Config, variables, parts, tout, batch, key):
    del key
    model = Eagle3Model(head_cfg)
    outs = training_unroll(model, head_cfg, variables, parts, tout, batch)
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
    return decayed_sum(losses, head_cfg.loss_decay), metrics


@dataclasses.dataclass(frozen=True)
class Eagle3Drafter(SequentialDrafter):
    module_class = Eagle3Model


# ---- upstream layout ("eagle3-hf") -----------------------------------------------------------


def tensor_names(cfg: Eagle3Config) -> TensorNames:
    return [
        ("fc.weight", ("fc", "kernel"), True),
        ("midlayer.input_layernorm.weight", ("input_layernorm", "scale"), False),
        ("midlayer.hidden_norm.weight", ("hidden_norm", "scale"), False),
        *hf_layer_names("midlayer.", ("layer",), cfg.layer),
        ("norm.weight", ("norm", "scale"), False),
        ("lm_head.weight", ("lm_head", "kernel"), True),
    ]


def config_from_hf(config: dict, target: ModelConfig) -> Eagle3Config:
    aux = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if aux is not None and min(aux) < 1:
        raise ValueError(f"eagle_aux_hidden_state_layer_ids {aux}: id 0 (embeddings) is not supported")
    head = Eagle3Config.for_target(
        target, draft_vocab_size=int(config.get("draft_vocab_size", target.vocab_size)),
        feature_layers=tuple(i - 1 for i in aux) if aux else None,
    )
    return dataclasses.replace(head, layer=layer_from_hf(config, target, 1))


def config_to_hf(cfg: Eagle3Config) -> dict:
    return {
        "architectures": ["LlamaForCausalLMEagle3"], **layer_to_hf(cfg.layer, cfg.target),
        "draft_vocab_size": cfg.draft_vocab_size, "target_hidden_size": cfg.target.hidden_size,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i + 1 for i in cfg.feature_layers]},
    }


def consts_from_tensors(cfg: Eagle3Config, tensors: dict[str, np.ndarray]) -> dict:
    """d2t `[Vd]` (target id - draft id) -> draft_to_target; absent: the identity."""
    if "d2t" not in tensors:
        return {}
    d2t = np.asarray(tensors["d2t"], np.int64)
    return {"draft_to_target": jnp.asarray(np.arange(len(d2t)) + d2t, jnp.int32)}


def tensors_from_consts(cfg: Eagle3Config, variables) -> dict[str, np.ndarray]:
    """d2t `[Vd]` int64 and t2d `[V]` bool (which target ids are in the draft vocabulary)."""
    ids = np.asarray(variables["consts"]["draft_to_target"], np.int64)
    t2d = np.zeros(cfg.target.vocab_size, bool)
    t2d[ids] = True
    return {"d2t": ids - np.arange(len(ids)), "t2d": t2d}


KIND = HeadKind(
    name="eagle3",
    summary="EAGLE-3: fused low/mid/high target features + one decoder layer, reduced vocabulary",
    config=Eagle3Config,
    model=Eagle3Model,
    init=init_eagle3,
    loss=eagle3_loss,
    drafter=Eagle3Drafter,
    options=(HeadOption("depth", "ttt_steps", 1, "training-time-test steps"),
             HeadOption("draft-vocab", "draft_vocab_size", 1,
                        "reduced draft vocabulary size (at most the target's)")),
    init_from_target=init_from_target,
    consts_from_data=consts_from_data,
    upstream=UpstreamLayout("eagle3-hf", tensor_names, config_from_hf, config_to_hf,
                            consts_from_tensors, tensors_from_consts),
)
