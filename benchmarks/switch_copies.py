"""Does a `lax.switch` whose branches update a large buffer in place copy it every step?

auto (`drafters.auto`) ran its draft shapes as the branches of ONE `lax.switch` until
2026-12-03 (now a chain of per-shape `while_loop`s, for what this script measures), every
branch writing the KV cache (and the drafter's state) in place. On jaxlib 0.10.2 (XLA CPU)
copy insertion gives every branch a copy of each such operand: the whole KV cache is copied
at every entry to the switch, a cost that grows with batch and context (at B = 1 on SmolLM2 it is inside the
noise of a 2-core machine; at B = 8 and 1024 entries it is ~380 MB a step). XLA changed conditional copy elision in openxla/xla#46314
(jaxlib 0.11.1); this script shows whether the jaxlib at hand still copies.

    python benchmarks/switch_copies.py                 # the micro case, seconds
    python benchmarks/switch_copies.py --model         # + the real refill programs (minutes)

Micro: a `while_loop` of 200 steps, each a `lax.switch` over N branches that each write a few
values into a 23 MB buffer (SmolLM2's f32 KV cache at B = 1, S = 1024, keys or values);
prints ms per step and the buffer-sized `copy` ops in the optimized HLO, N = 1 (no switch)
against N = 2 and 5. `--model`: the buffer-sized copies (f32[L, B, ...] of the cache) in the
compiled refill program of plain decoding and of auto with layerskip:8, B = 1.
"""
from __future__ import annotations

import argparse
import re
import time
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np

SIZE = 30 * 3 * 64 * 1024  # SmolLM2: layers x KV heads x head_dim x 1024 entries
STEPS = 200


def micro(branches: int) -> tuple[float, int]:
    """(ms per step, buffer-sized copies in the HLO) of the switched in-place update loop."""

    def step(carry):
        i, buf, acc = carry

        def branch(k):
            def write(buf, acc):
                buf = jax.lax.dynamic_update_slice(buf, jnp.full((k + 1,), acc), (i % 1000,))
                return buf, acc + buf[(7 * i) % 1000]
            return write

        buf, acc = jax.lax.switch(i % branches, [branch(k) for k in range(branches)], buf, acc)
        return i + 1, buf, acc

    run = jax.jit(lambda buf: jax.lax.while_loop(lambda c: c[0] < STEPS, step, (0, buf, 0.0)))
    compiled = run.lower(jnp.zeros((SIZE,), jnp.float32)).compile()
    copies = sum(1 for line in compiled.as_text().splitlines()
                 if f"f32[{SIZE}]" in line and " copy(" in line)
    jax.block_until_ready(compiled(jnp.zeros((SIZE,), jnp.float32)))
    times = []
    for _ in range(3):
        buf = jnp.zeros((SIZE,), jnp.float32)
        start = time.perf_counter()
        jax.block_until_ready(compiled(buf))
        times.append(time.perf_counter() - start)
    return 1e3 * sorted(times)[1] / STEPS, copies


def program_copies(drafter_spec: str | None, prompt_width: int = 256, max_new: int = 32) -> Counter:
    """Cache-sized copies (by shape) in the compiled refill program at B = 1."""
    from specjax.api import CHUNK_BATCHES, bucket, draft_margin
    from specjax.drafters.auto import AutoDrafter, AutoParams, auto_lengths, auto_max_draft
    from specjax.drafters.registry import make_drafter
    from specjax.loop import StopCriteria
    from specjax.models.hub import load_model
    from specjax.refill import PromptQueue, RefillPolicy, refill_program, slots_program
    from specjax.sampling import SamplingParams
    from specjax.target import as_target
    from specjax.tree import chain

    model = load_model("smollm2-135m", dtype="float32")
    drafter = params = None
    if drafter_spec:
        inner, inner_params = make_drafter(drafter_spec, tree=chain(4), target=model,
                                           target_cfg=model.cfg, target_params=model.params)
        drafter = AutoDrafter.wrap(inner, auto_lengths(None, auto_max_draft(inner)))
        params = AutoParams(inner=inner_params, step_s=jnp.ones(len(drafter.lengths)))
    width = bucket(prompt_width) + bucket(max_new) + draft_margin(None if drafter is None else drafter.tree)
    queue = PromptQueue.build([[1, 2, 3]], max_new, np.zeros((1, 2), np.uint32), CHUNK_BATCHES,
                              bucket(prompt_width))
    carry = () if drafter is None else drafter.init_carry(params)
    slots = slots_program(drafter, params, as_target(model.cfg).init_cache(1, width), carry,
                          width=width)
    text = refill_program.lower(model.cfg, model.params, drafter, params, queue, slots,
                                SamplingParams.make(0.0), StopCriteria.make(model.cfg.eos_token_ids),
                                True, policy=RefillPolicy()).compile().as_text()
    layers = model.cfg.num_layers
    shapes = Counter(m.group(1) for m in re.finditer(rf"= (f32\[{layers},1,[^\]]*{width}[^\]]*\])\S* copy\(", text))
    return shapes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="store_true", help="also count copies in the real programs")
    args = ap.parse_args()
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}")
    micro(1)  # warm-up
    base = None
    for n in (1, 2, 5):
        ms, copies = micro(n)
        base = base or ms
        print(f"micro: {n} branch(es): {ms:.3f} ms/step (x{ms / base:.1f} the 1-branch loop), "
              f"{copies} buffer-sized copies")
    if args.model:
        for spec in (None, "layerskip:8"):
            print(f"refill program, B=1, {'plain' if spec is None else 'auto ' + spec}: "
                  f"cache-sized copies {dict(program_copies(spec))}")


if __name__ == "__main__":
    main()
