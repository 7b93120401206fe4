"""The record of one learned-drafter kind (`HeadKind`) and the pieces it is made of.

A kind module (`eagle3.py`, `mtp.py`, `medusa.py`, `dflash.py`, `dspark.py`) defines its head
config, Flax module, init, loss and drafter, and ends with `KIND = HeadKind(...)`; the registry
(`registry.py`) lists the records, one line each. Everything that used to branch on the kind
string (training, losses, upstream import/export, the `train-drafter` options, the drafter
specs `KIND:DIR`) reads the record instead.

Signatures (cfg: the kind's head config, a frozen dataclass with `kind` and `hidden_layers`):

    config.for_target(target: ModelConfig, **options) -> cfg
    init(cfg, key, consts: dict | None) -> variables {"params", "consts"}
    loss(cfg, variables, parts, tout, batch, key) -> (scalar, {metric: scalar})  (`objectives`)
    drafter(tree=TreeSpec, head=cfg, **options) -> Drafter
    init_from_target(cfg, variables, target_params) -> variables
    consts_from_data(cfg, response_tokens `[N]` int) -> consts dict, or None
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from specjax.models.config import ModelConfig

HeadConfig = Any  # a kind's frozen config dataclass
Variables = dict  # {"params": ..., "consts": ...}
Loss = Callable[..., tuple[Any, dict]]
#: (upstream tensor name, our param path, transpose: upstream Linear `[out, in]` vs Flax `[in, out]`)
TensorNames = list[tuple[str, tuple[str, ...], bool]]


@dataclasses.dataclass(frozen=True)
class HeadOption:
    """A `specjax train-drafter` option of a kind: `--{flag}` N (an integer >= minimum) sets
    the head config's `field` (a `for_target` argument). Kinds may share a flag (`--depth`)
    with different fields; the CLI declares each flag once."""

    flag: str
    field: str
    minimum: int
    help: str

    @property
    def dest(self) -> str:
        """The argparse destination (`draft-vocab` -> `draft_vocab`)."""
        return self.flag.replace("-", "_")


def no_consts(cfg, tensors: dict[str, np.ndarray]) -> dict:
    """Upstream layouts without extra (non-parameter) tensors."""
    del cfg, tensors
    return {}


def no_tensors(cfg, variables: Variables) -> dict[str, np.ndarray]:
    del cfg, variables
    return {}


@dataclasses.dataclass(frozen=True)
class UpstreamLayout:
    """A Hugging Face folder layout of a kind (config.json + *.safetensors) that specjax
    imports (`KIND:DIR` on such a folder) and exports (`specjax export-drafter --format`)."""

    format: str  # the export format name, e.g. "eagle3-hf"
    tensor_names: Callable[[HeadConfig], TensorNames]
    config_from_hf: Callable[[dict, ModelConfig], HeadConfig]  # (config.json, target) -> cfg
    config_to_hf: Callable[[HeadConfig], dict]  # cfg -> config.json
    consts_from_tensors: Callable[[HeadConfig, dict], dict] = no_consts
    tensors_from_consts: Callable[[HeadConfig, Variables], dict] = no_tensors


@dataclasses.dataclass(frozen=True)
class HeadKind:
    """Everything specjax knows about one learned-drafter kind (see the module docstring)."""

    name: str  # the drafter spec name (`--draft NAME:DIR`, `--kind NAME`) = config.kind
    summary: str  # one line for help texts and docs
    config: type  # the head config class (`for_target`)
    model: type  # the Flax module class (`model(cfg)`)
    init: Callable[..., Variables]
    loss: Loss
    drafter: Callable[..., Any]  # the Drafter class (`drafter(tree=..., head=cfg, ...)`)
    options: tuple[HeadOption, ...] = ()
    init_from_target: Callable[[HeadConfig, Variables, Any], Variables] | None = None
    consts_from_data: Callable[[HeadConfig, np.ndarray], dict | None] | None = None
    upstream: UpstreamLayout | None = None

    def __post_init__(self):
        default = {f.name: f.default for f in dataclasses.fields(self.config)}.get("kind")
        if default != self.name:
            raise ValueError(f"kind record {self.name!r}: {self.config.__name__}.kind is {default!r}")
