"""Packaging: models/ and kernels/ are specjax.models / specjax.kernels, never top-level names."""
from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_repository_folders_map_into_the_specjax_namespace():
    models = importlib.import_module("specjax.models.llama")
    kernels = importlib.import_module("specjax.kernels.reference")
    assert Path(models.__file__).resolve().parent == ROOT / "models"
    assert Path(kernels.__file__).resolve().parent == ROOT / "kernels"
    configs = importlib.import_module("specjax.configs")
    assert Path(configs.__file__).resolve().parent == ROOT / "configs"


def test_no_source_file_imports_top_level_models_or_kernels():
    offenders = []
    for folder in ("specjax", "models", "kernels", "benchmarks"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                offenders += [f"{path}: {n}" for n in names if n.split(".")[0] in ("models", "kernels")]
    assert not offenders, offenders


def test_every_module_imports_under_its_package_name(tmp_path):
    """In a fresh interpreter outside the checkout (so the repo root is not on sys.path)."""
    script = """
import importlib, pkgutil, sys
import specjax, specjax.models, specjax.kernels
for package in (specjax, specjax.models, specjax.kernels):
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        importlib.import_module(info.name)
clash = sorted(m for m in sys.modules if m.split(".")[0] in ("models", "kernels"))
assert not clash, clash
"""
    subprocess.run([sys.executable, "-c", script], cwd=tmp_path, check=True)


def test_pyproject_lists_every_package_folder():
    """A subpackage missing from [tool.setuptools] packages would be left out of a wheel."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    folders = {name: ROOT / path for name, path in config["package-dir"].items()}
    found = set()
    for name, folder in folders.items():
        for init in folder.rglob("__init__.py"):
            parts = init.parent.relative_to(folder).parts
            found.add(".".join((name, *parts)))
    assert found <= set(config["packages"]), sorted(found - set(config["packages"]))
