"""Compile time of the default program (the refilling chunk program, `refill.refill_program`):
plain decoding vs each drafter, side by side in one process.

    python benchmarks/refill_compile.py [--drafts ngram suffix layerskip:4] [--batches 1 8]
        [--prompt-width 64] [--max-new 128] [--rounds 2]

Each round compiles AR, then each drafter (a chain of 4), for every batch size: the program is
lowered and compiled with JAX's ahead-of-time path after `jax.clear_caches()` (the persistent
compilation cache is not set up here), so each number is a first-time compile in a warm
process. Prints the minimum over rounds per program, wall and CPU seconds (CPU: what other jobs on a
shared machine disturb least), and its ratio to AR at the same batch size
(issue 20's target: a spec program within 1.5x the AR program). `benchmarks/compile_time.py`
measures the static-batch programs (`--no-refill`) in more detail.
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from compile_time import learned_drafter

from specjax.api import CHUNK_BATCHES, bucket, draft_margin
from specjax.drafters.learned.registry import KINDS
from specjax.drafters.registry import make_drafter
from specjax.loop import StopCriteria
from specjax.models.hub import load_model
from specjax.refill import PromptQueue, RefillPolicy, refill_program, slots_program
from specjax.sampling import SamplingParams
from specjax.target import as_target
from specjax.tree import chain


def compile_seconds(model, drafter, drafter_params, batch: int, prompt_width: int, max_new: int) -> tuple[float, float]:
    """(wall, CPU) seconds to lower and compile the refill program of this drafter (None: AR) at
    `batch` slots. CPU seconds (all threads of this process) are what a shared machine's
    other jobs disturb least."""
    width = bucket(prompt_width) + bucket(max_new) + draft_margin(None if drafter is None else drafter.tree)
    queue = PromptQueue.build([[1, 2, 3]], max_new, np.zeros((1, 2), np.uint32), CHUNK_BATCHES * batch,
                              bucket(prompt_width))
    carry = () if drafter is None else drafter.init_carry(drafter_params)
    slots = slots_program(drafter, drafter_params, as_target(model.cfg).init_cache(batch, width), carry,
                          width=width)
    jax.clear_caches()
    start, cpu = time.perf_counter(), time.process_time()
    refill_program.lower(model.cfg, model.params, drafter, drafter_params, queue, slots,
                         SamplingParams.make(0.0), StopCriteria.make(model.cfg.eos_token_ids), True,
                         policy=RefillPolicy()).compile()
    return time.perf_counter() - start, time.process_time() - cpu


def build(name: str, model):
    """(drafter, params) of a chain of 4; a learned kind without `:DIR` gets zero weights of its
    record's shapes (compile time does not depend on the values)."""
    if name in KINDS:
        drafter, params = learned_drafter(name, chain(4), model.cfg, model.params)
        concrete = lambda x: jnp.zeros(x.shape, x.dtype) if isinstance(x, jax.ShapeDtypeStruct) else x
        return drafter, jax.tree.map(concrete, params)
    return make_drafter(name, tree=chain(4), target=model, target_cfg=model.cfg, target_params=model.params)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--drafts", nargs="+", default=["ngram", "suffix", "layerskip:4"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-width", type=int, default=64)
    parser.add_argument("--max-new", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)

    model = load_model(args.model, dtype="float32")
    drafters = {"ar": (None, None)} | {name: build(name, model) for name in args.drafts}
    seconds: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for _ in range(args.rounds):
        for batch in args.batches:
            for name, (drafter, dparams) in drafters.items():
                seconds.setdefault((batch, name), []).append(
                    compile_seconds(model, drafter, dparams, batch, args.prompt_width, args.max_new))
    for batch in args.batches:
        ar_wall, ar_cpu = (min(s[i] for s in seconds[(batch, "ar")]) for i in (0, 1))
        for name in drafters:
            wall, cpu = (min(s[i] for s in seconds[(batch, name)]) for i in (0, 1))
            print(f"B={batch:<3d} {name:12s} wall {wall:6.1f} s  x{wall / ar_wall:.2f} AR   "
                  f"CPU {cpu:6.1f} s  x{cpu / ar_cpu:.2f} AR")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
