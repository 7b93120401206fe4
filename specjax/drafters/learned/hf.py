"""Upstream Hugging Face layouts of EAGLE-3 and DFlash heads: load (and write, for tests).

A folder holds `config.json` and `*.safetensors` (PyTorch Linear weights are `[out, in]`;
ours are Flax kernels `[in, out]`). The embedding and LM head of the target are not part of
either layout's draft weights we use (EAGLE-3's optional `embed_tokens.weight` copy and `t2d`
are ignored; DFlash reuses the target's).

EAGLE-3 (SafeAILab/EAGLE `eagle/traineagle3/cnets.py`; `LlamaForCausalLMEagle3` configs):
  fc.weight [H, 3H]; midlayer.{input_layernorm, hidden_norm, post_attention_layernorm}.weight;
  midlayer.self_attn.{q,k,v,o}_proj.weight (q/k/v read 2H); midlayer.mlp.{gate,up,down}_proj;
  norm.weight; lm_head.weight [Vd, H]; d2t [Vd] (target id = draft id + d2t[draft id]).
  config: hidden_size, intermediate_size, num_attention_heads, num_key_value_heads,
  [head_dim], rms_norm_eps, rope_theta, vocab_size, draft_vocab_size,
  [eagle_config.eagle_aux_hidden_state_layer_ids: ids of the decoder layers whose *input* is
  taken, i.e. our feature layer = id - 1].
DFlash (z-lab/dflash `dflash/model.py`):
  fc.weight [H, k*H]; hidden_norm.weight; norm.weight; layers.{i}.input_layernorm.weight,
  layers.{i}.post_attention_layernorm.weight, layers.{i}.self_attn.{q,k,v,o}_proj.weight
  [.bias], layers.{i}.self_attn.{q_norm,k_norm}.weight, layers.{i}.mlp.{gate,up,down}_proj.
  config: the layer dims, num_hidden_layers, and `dflash_config` (or top level):
  target_layer_ids (outputs of those target layers), block_size, mask_token_id.
"""
from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models.config import ModelConfig
from specjax.models.finite import check_finite

# (upstream name, our param path, transpose)
Mapping = list[tuple[str, tuple[str, ...], bool]]

_MLP = ("gate_proj", "up_proj", "down_proj")
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


def _layer_names(prefix: str, path: tuple[str, ...], cfg: ModelConfig) -> Mapping:
    """A HeadLayer's tensors (attention, q/k norm, MLP, post-attention norm)."""
    out = [(f"{prefix}self_attn.{p}.weight", path + (p, "kernel"), True) for p in _ATTN]
    if cfg.attention_bias:
        out += [(f"{prefix}self_attn.{p}.bias", path + (p, "bias"), False) for p in _ATTN[:3]]
    if cfg.qk_norm:
        out += [(f"{prefix}self_attn.{n}.weight", path + (n, "scale"), False) for n in ("q_norm", "k_norm")]
    out += [(f"{prefix}mlp.{p}.weight", path + ("mlp", p, "kernel"), True) for p in _MLP]
    out.append((f"{prefix}post_attention_layernorm.weight", path + ("post_attention_layernorm", "scale"), False))
    return out


def mapping(head_cfg) -> Mapping:
    """Every upstream tensor name of a head config -> (our param path, transpose)."""
    if head_cfg.kind == "eagle3":
        return [
            ("fc.weight", ("fc", "kernel"), True),
            ("midlayer.input_layernorm.weight", ("input_layernorm", "scale"), False),
            ("midlayer.hidden_norm.weight", ("hidden_norm", "scale"), False),
            *_layer_names("midlayer.", ("layer",), head_cfg.layer),
            ("norm.weight", ("norm", "scale"), False),
            ("lm_head.weight", ("lm_head", "kernel"), True),
        ]
    if head_cfg.kind == "dflash":
        out = [("fc.weight", ("fc", "kernel"), True),
               ("hidden_norm.weight", ("hidden_norm", "scale"), False),
               ("norm.weight", ("norm", "scale"), False)]
        for i in range(head_cfg.layer.num_layers):
            out.append((f"layers.{i}.input_layernorm.weight", (f"input_layernorm_{i}", "scale"), False))
            out += _layer_names(f"layers.{i}.", (f"layers_{i}",), head_cfg.layer)
        return out
    raise ValueError(f"no upstream layout for {head_cfg.kind!r} (eagle3 and dflash have one)")


# ---- config.json <-> head config ---------------------------------------------------------------


def _layer_overrides(config: dict, target: ModelConfig) -> dict:
    hidden = int(config.get("hidden_size", target.hidden_size))
    if hidden != target.hidden_size:
        raise ValueError(f"the draft head's hidden_size {hidden} differs from the target's "
                         f"{target.hidden_size}: it was trained for another target")
    heads = int(config.get("num_attention_heads", target.num_heads))
    return {
        "num_heads": heads,
        "num_kv_heads": int(config.get("num_key_value_heads", heads)),
        "head_dim": int(config.get("head_dim") or hidden // heads),
        "intermediate_size": int(config.get("intermediate_size", target.intermediate_size)),
        "rms_norm_eps": float(config.get("rms_norm_eps", target.rms_norm_eps)),
        "rope_theta": float(config.get("rope_theta", target.rope_theta)),
        "attention_bias": bool(config.get("attention_bias", False)),
    }


def head_config_from_upstream(kind: str, config: dict, target: ModelConfig):
    from specjax.models.heads import layer_config, make_head_config

    vocab = int(config.get("vocab_size", target.vocab_size))
    if vocab != target.vocab_size:
        raise ValueError(f"the {kind} head has a vocabulary of {vocab}, the target {target.vocab_size}")
    overrides = _layer_overrides(config, target)
    if kind == "eagle3":
        aux = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if aux is not None and min(aux) < 1:
            raise ValueError(f"eagle_aux_hidden_state_layer_ids {aux}: id 0 (embeddings) is not supported")
        head = make_head_config(
            "eagle3", target, draft_vocab_size=int(config.get("draft_vocab_size", vocab)),
            feature_layers=tuple(i - 1 for i in aux) if aux else None,
        )
        return _with_layer(head, layer_config(target, 1, **overrides))
    if kind == "dflash":
        draft = {**config, **(config.get("dflash_config") or {})}
        num_layers = int(config.get("num_hidden_layers", 1))
        head = make_head_config(
            "dflash", target, num_draft_layers=num_layers,
            feature_layers=tuple(int(i) for i in draft["target_layer_ids"]),
            block_size=int(draft.get("block_size", 16)),
            mask_token_id=int(draft.get("mask_token_id", target.pad_token_id)),
        )
        return _with_layer(head, layer_config(target, num_layers, qk_norm=True, **overrides))
    raise ValueError(f"no upstream layout for {kind!r} (eagle3 and dflash have one)")


def _with_layer(head, layer: ModelConfig):
    import dataclasses

    return dataclasses.replace(head, layer=layer)


def upstream_config(head_cfg) -> dict:
    """The config.json of a head in the upstream layout."""
    c = head_cfg.layer
    config = {
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
        "vocab_size": head_cfg.target.vocab_size, "num_hidden_layers": c.num_layers,
        "attention_bias": c.attention_bias,
    }
    if head_cfg.kind == "eagle3":
        config.update(architectures=["LlamaForCausalLMEagle3"],
                      draft_vocab_size=head_cfg.draft_vocab_size,
                      eagle_config={"eagle_aux_hidden_state_layer_ids":
                                    [i + 1 for i in head_cfg.feature_layers]})
    else:
        config.update(architectures=["DFlashDraftModel"], dflash_config={
            "target_layer_ids": list(head_cfg.feature_layers), "block_size": head_cfg.block_size,
            "mask_token_id": head_cfg.mask_token_id})
    return config


# ---- tensors -------------------------------------------------------------------------------------


def _read_tensors(folder: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder}: no *.safetensors file (PyTorch .bin checkpoints: convert first)")
    tensors: dict[str, np.ndarray] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors


def _set(tree: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _get(tree: dict, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree


def variables_from_tensors(head_cfg, tensors: dict[str, np.ndarray], where: str = "checkpoint"):
    """Head variables from upstream tensors; shapes are checked against a fresh init, values for
    NaN / Inf (a CheckpointError naming `where` and the tensor)."""
    from specjax.models.heads import init_head

    reference = init_head(head_cfg, jax.random.PRNGKey(0))
    dtype = head_cfg.layer.jnp_dtype
    params: dict = {}
    for name, path, transpose in mapping(head_cfg):
        if name not in tensors:
            raise ValueError(f"{where}: missing tensor {name!r}")
        value = np.asarray(tensors[name], np.float32)
        check_finite(value, where, f"tensor {name!r}")
        value = value.T if transpose else value
        want = _get(reference["params"], path).shape
        if value.shape != want:
            raise ValueError(f"{where}: {name} has shape {value.shape[::-1] if transpose else value.shape}, "
                             f"expected {want[::-1] if transpose else want}")
        _set(params, path, jnp.asarray(value, dtype))
    consts = dict(reference.get("consts", {}))
    if head_cfg.kind == "eagle3" and "d2t" in tensors:
        d2t = np.asarray(tensors["d2t"], np.int64)
        consts["draft_to_target"] = jnp.asarray(np.arange(len(d2t)) + d2t, jnp.int32)
    return {"params": params, "consts": consts}


def load_upstream(kind: str, folder: str | Path, target: ModelConfig):
    """(head config, variables) of an upstream EAGLE-3 / DFlash folder for `target`."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    head_cfg = head_config_from_upstream(kind, config, target)
    return head_cfg, variables_from_tensors(head_cfg, _read_tensors(folder), str(folder))


def save_upstream(head_cfg, variables, folder: str | Path) -> Path:
    """Writes a head in the upstream layout (config.json + model.safetensors)."""
    from safetensors.numpy import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, path, transpose in mapping(head_cfg):
        value = np.asarray(_get(variables["params"], path), np.float32)
        tensors[name] = np.ascontiguousarray(value.T if transpose else value)
    if head_cfg.kind == "eagle3":
        ids = np.asarray(variables["consts"]["draft_to_target"], np.int64)
        tensors["d2t"] = ids - np.arange(len(ids))
        t2d = np.zeros(head_cfg.target.vocab_size, bool)
        t2d[ids] = True
        tensors["t2d"] = t2d
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(upstream_config(head_cfg), indent=1))
    return folder
