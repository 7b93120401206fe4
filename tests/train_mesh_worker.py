"""Training on a mesh, the multi-device half of tests/test_train_mesh.py: run in a fresh process
with 4 fake CPU devices, it trains an EAGLE-3 head a few steps on one device and on a dp=2 x tp=2
mesh (target placed by the rules, head state replicated, batch rows over dp) and prints the two
loss curves and the largest parameter difference as JSON on its last line.

    python tests/train_mesh_worker.py OUT_DIR
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fake_devices import fake_devices_env  # imports no jax

os.environ.update(fake_devices_env(4))

import jax
import numpy as np

jax.config.update("jax_default_matmul_precision", "highest")

from helpers import tiny_config  # noqa: E402

from specjax.drafters.learned.registry import make_head_config  # noqa: E402
from specjax.models.llama import init_params  # noqa: E402
from specjax.sharding import as_mesh, shard_params  # noqa: E402
from specjax.train.data import Sequences  # noqa: E402
from specjax.train.trainer import TrainConfig, train  # noqa: E402


def main(out_dir: str) -> None:
    cfg = tiny_config(vocab_size=16)
    params = init_params(cfg, jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    rows = [(rng.integers(0, 16, 4).tolist(), rng.integers(0, 16, rng.integers(3, 8)).tolist())
            for _ in range(6)]
    data = Sequences.from_rows(rows, seq_len=12, pad_id=0, meta={"note": "random"})
    head = make_head_config("eagle3", cfg, ttt_steps=2)
    tc = TrainConfig(steps=4, batch_size=4, learning_rate=1e-2, save_every=2, keep=1, log_every=1)
    from specjax.train.trainer import init_train_state

    start = init_train_state(head, tc, None, params)
    one, log_one = train(head, params, data, tc, Path(out_dir) / "one", progress=False)
    mesh = as_mesh("dp=2,tp=2")
    placed = shard_params(params, mesh, cfg)
    split, log_split = train(head, placed, data, tc, Path(out_dir) / "mesh", progress=False,
                             mesh=mesh)
    diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
               for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(split.params)))
    print(json.dumps({
        "devices": jax.device_count(),
        "loss_one": [row["loss"] for row in log_one],
        "loss_mesh": [row["loss"] for row in log_split],
        "max_param_diff": diff,
        "max_param_moved": max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                               for a, b in zip(jax.tree.leaves(start.params),
                                               jax.tree.leaves(one.params))),
        "head_leaf_shardings": sorted({str(x.sharding.spec) for x in jax.tree.leaves(split.params)}),
        "target_q_spec": str(placed["params"]["layers"]["self_attn"]["q_proj"]["kernel"].sharding.spec),
    }))


if __name__ == "__main__":
    main(sys.argv[1])
