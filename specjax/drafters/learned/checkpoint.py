"""Learned-drafter folders: `specjax train-drafter` outputs and upstream Hugging Face folders.

A trained folder (written by `specjax.train.trainer`):

  OUT/drafter.json        {"format": FORMAT, "kind", "head": the head config, "target": its name,
                           "target_config": the target's ModelConfig, "train", "data"}
  OUT/checkpoints/<step>/ orbax checkpoints of the whole TrainState (step, params, optimizer
                          state, consts); the drafter reads only params and consts

An upstream folder holds config.json + *.safetensors (`hf.py`). `load_learned_drafter` is
what `--draft KIND:DIR` runs; `export_drafter` writes a trained folder in an upstream layout
(`specjax export-drafter`).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import jax

from specjax.drafters.learned.drafting import drafter_params
from specjax.drafters.learned.hf import load_upstream, save_upstream
from specjax.drafters.learned.registry import (
    head_config_from_dict,
    head_config_to_dict,
    init_head,
    make_learned_drafter,
    model_config_from_dict,
    upstream_formats,
)
from specjax.jsonfile import read_json_object
from specjax.models.config import ModelConfig
from specjax.models.finite import check_tree_finite
from specjax.tree import TreeSpec

FORMAT = "specjax-drafter-v1"
DESCRIPTION = "drafter.json"


def trained_folder_problem(folder: Path) -> str | None:
    """What keeps `folder` from being a `specjax train-drafter` output (no such folder, no
    DESCRIPTION), as the end of a sentence naming it; None when it looks like one."""
    if not folder.is_dir():
        return "no such folder (a `specjax train-drafter` output)"
    if not (folder / DESCRIPTION).is_file():
        return f"no {DESCRIPTION} (not a `specjax train-drafter` output)"
    return None
CHECKPOINTS = "checkpoints"


def describe(head_cfg, train: dict, data_meta: dict) -> dict:
    """The drafter.json of a trained head (train: the TrainConfig's fields)."""
    return {"format": FORMAT, "kind": head_cfg.kind, "head": head_config_to_dict(head_cfg),
            "target": head_cfg.target.name, "target_config": dataclasses.asdict(head_cfg.target),
            "train": train, "data": data_meta}


def read_description(folder: str | Path, target_cfg: ModelConfig) -> tuple[dict, object]:
    """(OUT/drafter.json, its head config for target_cfg); a malformed file -> one-line
    ValueError naming it."""
    path = Path(folder) / DESCRIPTION
    desc = read_json_object(path)
    fields = {"kind": str, "head": dict, "train": dict}
    missing = [k for k, kind in fields.items() if not isinstance(desc.get(k), kind)]
    if missing:
        raise ValueError(f"{path}: not a drafter description (no valid {', '.join(missing)})")
    try:
        return desc, head_config_from_dict(desc["head"], target_cfg)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: unusable head config ({e})") from None


def described_target(folder: str | Path) -> ModelConfig | None:
    """The target config drafter.json records (None: written before it recorded one)."""
    path = Path(folder) / DESCRIPTION
    stored = read_json_object(path).get("target_config")
    if stored is None:
        return None
    try:
        return model_config_from_dict(stored)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: unusable target_config ({e})") from None


def abstract_variables(head_cfg) -> dict:
    """Shapes, dtypes and (default-device) shardings of a head's variables, for orbax."""
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shapes = jax.eval_shape(lambda: init_head(head_cfg, jax.random.PRNGKey(0)))
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device), shapes)


def load_trained(folder: str | Path, target_cfg: ModelConfig, step: int | None = None):
    """(head config, head variables {"params", "consts"}) of a trained folder at `step`
    (default: its latest checkpoint). The optimizer state is not read."""
    folder = Path(folder)
    _desc, head_cfg = read_description(folder, target_cfg)
    import orbax.checkpoint as ocp  # ~1 s of start-up that only loading a trained head needs

    mngr = ocp.CheckpointManager((folder / CHECKPOINTS).absolute())
    try:
        step = mngr.latest_step() if step is None else step
        if step is None:
            raise ValueError(f"{folder}: no checkpoint yet")
        wanted = {k: v for k, v in abstract_variables(head_cfg).items() if v}
        restore_args = ocp.checkpoint_utils.construct_restore_args(wanted)
        restored = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
            item=wanted, restore_args=restore_args, partial_restore=True)))["state"]
    finally:
        mngr.close()
    return head_cfg, {"params": restored["params"], "consts": dict(restored.get("consts", {}))}


def load_learned_drafter(kind: str, folder: str, tree: TreeSpec, target_cfg: ModelConfig,
                         target_params):
    """(drafter, drafter params) of a learned head in `folder`: a `specjax train-drafter`
    output (drafter.json + orbax checkpoints; latest step) or, for kinds with an upstream
    layout, a Hugging Face folder (config.json + *.safetensors). A weight holding NaN / Inf is
    refused (CheckpointError naming the folder and the tensor)."""
    path = Path(folder)
    if not folder or not path.is_dir():
        raise ValueError(f"{kind}:DIR needs a folder with a trained drafter, got {folder!r}")
    if target_params is None:
        raise ValueError(f"{kind} drafts with the target's embedding/head: pass the target's params")
    if (path / DESCRIPTION).exists():
        head_cfg, variables = load_trained(path, target_cfg)
        check_tree_finite(variables["params"], path / CHECKPOINTS)
        if head_cfg.kind != kind:
            raise ValueError(f"{folder} holds a {head_cfg.kind} drafter, not {kind}")
    elif (path / "config.json").exists():
        head_cfg, variables = load_upstream(kind, path, target_cfg)
    else:
        raise ValueError(f"{folder}: neither {DESCRIPTION} (specjax) nor config.json (upstream)")
    return make_learned_drafter(head_cfg, tree), drafter_params(variables, target_params, head_cfg)


def export_drafter(src: str | Path, out: str | Path, fmt: str,
                   target_cfg: ModelConfig | None = None) -> Path:
    """Writes the trained head in `src` to `out` in the upstream layout `fmt` (e.g.
    "eagle3-hf"); target_cfg: the target's config when drafter.json records none."""
    src = Path(src)
    formats = upstream_formats()
    if fmt not in formats:
        raise ValueError(f"unknown export format {fmt!r}; choose from {sorted(formats)}")
    if not (src / DESCRIPTION).is_file():
        raise ValueError(f"{src}: no {DESCRIPTION} (not a `specjax train-drafter` output)")
    target_cfg = target_cfg or described_target(src)
    if target_cfg is None:
        raise ValueError(f"{src / DESCRIPTION}: records no target_config (an older run): "
                         "name the target with --model")
    head_cfg, variables = load_trained(src, target_cfg)
    if head_cfg.kind != formats[fmt].name:
        raise ValueError(f"{src} holds a {head_cfg.kind} drafter; {fmt} exports {formats[fmt].name}")
    check_tree_finite(variables["params"], src / CHECKPOINTS)
    return save_upstream(head_cfg, variables, out)
