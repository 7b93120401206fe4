"""docs/composition.md runs: its ```python blocks, in order and in one namespace, in a fresh
interpreter with two fake CPU devices (so the shard_map examples really split the rows)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from fake_devices import fake_devices_env

DOC = Path(__file__).resolve().parents[1] / "docs" / "composition.md"
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def python_blocks(markdown: str) -> list[str]:
    return BLOCK.findall(markdown)


def test_the_doc_has_an_example_of_each_transformation():
    code = "\n".join(python_blocks(DOC.read_text(encoding="utf-8")))
    for transformation in ("jax.jit", "jax.vmap", "jax.grad", "jax.value_and_grad", "jax.shard_map"):
        assert transformation in code, transformation
    for step_function in ("spec_step(", "verify(", "accept_greedy(", "commit(", "forward("):
        assert step_function in code, step_function


def test_the_doc_examples_run(tmp_path):
    blocks = python_blocks(DOC.read_text(encoding="utf-8"))
    script = tmp_path / "composition.py"
    # one script, each block behind a marker, so a failure names its block
    script.write_text("\n".join(f"print('block {i}', flush=True)\n{block}" for i, block in enumerate(blocks)))
    env = {**os.environ, **fake_devices_env(2), "JAX_PLATFORMS": "cpu",
           "JAX_DEFAULT_MATMUL_PRECISION": "highest"}
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert f"block {len(blocks) - 1}" in run.stdout
