"""train-drafter on a mesh: the same losses and head as on one device (4 fake CPU devices, in a
subprocess: XLA_FLAGS must be set before jax is imported)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np


def test_training_on_a_mesh_equals_one_device(tmp_path):
    worker = Path(__file__).with_name("train_mesh_worker.py")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, str(worker), str(tmp_path)], env=env, text=True,
                          capture_output=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["devices"] == 4
    assert len(result["loss_one"]) == 4
    np.testing.assert_allclose(result["loss_mesh"], result["loss_one"], rtol=1e-5, atol=1e-6)
    assert result["max_param_moved"] > 1e-3  # the head trained: the comparison can fail
    assert result["max_param_diff"] < 1e-4
    assert result["target_q_spec"] in ("PartitionSpec(None, None, 'tp')", "P(None, None, 'tp')")
