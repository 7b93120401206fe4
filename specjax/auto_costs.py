"""Step costs of `num_draft="auto"`'s branches on this device, measured once and cached.

`auto_drafter(target, params, drafter, drafter_params, batch_size)` wraps a drafter for auto
(`drafters.auto.AutoDrafter`) with `AutoParams.step_s`: the seconds of one whole step of each
branch (the plain step and each chain length) at this batch size, at two cache widths
(those of `CONTEXTS`: a job is priced on the line through them at its program's width; where
the attention reads the whole buffer whatever is filled, the wide one with few tokens cached,
`cached_tokens`). They are
measured by running the branches themselves, forced, on a running batch
(`profile_step_costs`: compilation excluded, branches timed in turns of a 1-step and a 4-step
call, the fastest of each, a call's own cost left out), once per (device kind, model, dtype,
batch size, drafter, lengths), and kept as JSON in `$SPECJAX_CACHE/step_costs/` (default
`~/.cache/specjax/step_costs/`). A missing file is profiled (a line on stderr says so and how
long it took); an unreadable one, or one made for another device or model, is profiled again
with a warning: never an error. `costs_from_profile` reads the same costs from a
`specjax profile` / `specjax tune` latency profile instead.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters.auto import AutoDrafter, AutoParams, auto_lengths, auto_max_draft
from specjax.kernels import attention_cpu, cpu_ffi, qmatmul_cpu
from specjax.loop import StopCriteria, spec_start_program
from specjax.models.config import ModelConfig
from specjax.models.llama import Llama, attention_impl
from specjax.models.paths import cache_dir
from specjax.models.quant import (
    BlockedKernel,
    PackedKernel,
    float_kernel_reason,
    is_held,
    quantization_of,
)
from specjax.sampling import SamplingParams
from specjax.target import as_target
from specjax.xla_options import current_options, program

#: what the branches do and how they are timed; files of another version are profiled again
#: (2: model-based drafters' plain branch syncs instead of proposing, so it costs less; 3: the
#: fastest of up to 5 turns of 4 steps, was the median of 3 turns of 2; 4: at two contexts, a
#: call's own cost, from calls of 1 and 4 steps, left out; 5: the wide width with `CONTEXT`
#: tokens cached where a step's cost follows the width alone, `cached_tokens`; on CPU the key
#: names the kernels' sources, `cost_key`)
VERSION = 5
CONTEXT = 64  # prompt tokens cached before the timed steps
#: the contexts profiled: a step's cost grows with its program's cache width (attention, the
#: cache writes), and not alike for every branch (SmolLM2, B = 8 here: D=4 / D=0 2.0 at 64
#: tokens, 1.7 at 1024), so a job is priced on the line through the two (`AutoParams.costs_at`;
#: Spec-Bench rows run at up to ~1100 entries: mostly inside the line, not past it)
CONTEXTS = (CONTEXT, 1024)
STEPS = 4  # steps of the long timed call (the short one takes 1)
REPEATS = 5  # turns at most (each branch's fastest call of each length counts)
BUDGET_S = 10.0  # after two turns over the branches, no further turn once the timed calls took this


def stderr_line(message: str) -> None:
    print(f"specjax: {message}", file=sys.stderr, flush=True)


def costs_folder() -> Path:
    return cache_dir() / "step_costs"


def weights_of(params) -> str:
    """How the weights are held, as far as a step's cost goes: "float", or the quantization mode,
    with "/cpu-kernel" where the CPU kernels multiply them (`quant.PackedKernel`; float kernels
    where `quant.float_kernel_reason` is None), "/cpu-blocks" for float kernels in the CPU
    kernel's layout (`quant.BlockedKernel`)."""
    mode = quantization_of(params)
    leaves = jax.tree.leaves(params, is_leaf=is_held)
    if mode is None and any(isinstance(leaf, BlockedKernel) for leaf in leaves):
        return "float/cpu-blocks"
    packed = any(isinstance(leaf, PackedKernel) for leaf in leaves)
    in_place = mode is None and float_kernel_reason() is None  # (params None: float)
    return (mode or "float") + ("/cpu-kernel" if packed or in_place else "")


def cost_key(target, drafter: AutoDrafter, batch_size: int, params=None) -> dict:
    """What a cached cost belongs to: the device, the programs' compile options, the model (its
    config, how its weights are held and the attention that runs), the drafter, the branches,
    the batch size and the profiled cache widths (JSON-able, compared whole on load). On the CPU
    backend it names the C++ kernels' sources too: a changed kernel changes the costs."""
    device = jax.devices()[0]
    kernels = {"kernels": cpu_ffi.source_digest((qmatmul_cpu.SOURCE, attention_cpu.SOURCE))} if (
        jax.default_backend() == "cpu") else {}
    return {"version": VERSION, "backend": jax.default_backend(), "device_kind": device.device_kind,
            "compile_options": {name: str(value) for name, value in sorted(current_options().items())},
            "model": repr(target), "weights": weights_of(params), "drafter": repr(drafter.inner),
            "attention": [attention_impl(cfg) for cfg in attention_configs(target, drafter)],
            "lengths": list(drafter.lengths),
            "batch_size": int(batch_size), "widths": [profile_width(drafter, c) for c in CONTEXTS]} | kernels | (
        {"trees": [[t.name, list(t.parents), list(t.ranks)] for t in drafter.trees]} if drafter.trees else {})


def cost_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return costs_folder() / f"{digest}.json"


def cached_costs(path: Path, key: dict) -> tuple[list[list[float]] | None, str | None]:
    """(`[len(CONTEXTS)][S]` step seconds, None) from a good file; (None, why not) otherwise
    (None: no file)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError) as err:
        return None, f"unreadable ({type(err).__name__})"
    if not isinstance(data, dict) or data.get("key") != key:
        found = data.get("key", {}) if isinstance(data, dict) else {}
        return None, (f"made for another device or model ({found.get('device_kind', '?')}, "
                      f"batch {found.get('batch_size', '?')})" if isinstance(found, dict) else "foreign")
    step_s = data.get("step_s")
    shapes = len(key["lengths"]) + len(key.get("trees", []))
    if (not isinstance(step_s, list) or len(step_s) != len(key["widths"])
            or not all(isinstance(at, list) and len(at) == shapes for at in step_s)
            or not all(isinstance(s, (int, float)) and s > 0 for at in step_s for s in at)):
        return None, "malformed step costs"
    return [[float(s) for s in at] for at in step_s], None


def write_costs(path: Path, key: dict, step_s: list[list[float]], seconds: float) -> None:
    """Writes the file atomically (a temporary file renamed over it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"key": key, "step_s": step_s, "profile_s": round(seconds, 2)}),
                   encoding="utf-8")
    os.replace(tmp, path)


@functools.partial(program, static_argnames=("target", "drafter"))
def _forced_steps(target, params, drafter: AutoDrafter, drafter_params, started, branch, sampling,
                  criteria, steps):
    """`steps` `[]` steps of one branch `[]` from `spec_start`'s (state, drafter state,
    metrics), inside the branch's loop as a running job takes them."""
    state, drafter_state, metrics = started
    return drafter.switched_step(target, params, drafter_params, state, drafter_state, metrics,
                                 sampling, criteria, branch=branch, steps=steps)


def attention_configs(target, drafter: AutoDrafter | None = None) -> list[ModelConfig]:
    """The configs of the built-in Llama attentions a step runs: the target's, and a draft
    model's when the drafter has one (empty for a target of another class)."""
    model = as_target(target)
    if not isinstance(model, Llama):
        return []
    configs = [model.cfg]
    inner = getattr(drafter, "inner", drafter)
    if isinstance(getattr(inner, "cfg", None), ModelConfig):  # a draft model's own attention
        configs.append(inner.cfg)
    return configs


def cached_tokens(target, context: int, drafter: AutoDrafter | None = None) -> int:
    """The tokens a profile for `context` caches before its timed steps: `context`, or at most
    `CONTEXT` when every attention a step runs is the XLA path (`models.llama.attention_impl`:
    the built-in Llama target's, and a draft model's when the drafter has one): that reads the
    whole cache buffer, masked, however much of it is filled, so a step costs what its
    program's width makes it cost, and prefilling 1024 tokens a row only costs the profile
    time. The kernels (Pallas on GPU / TPU, the C++ one on one CPU device: the default for f32
    there) stop at each row's length: there the tokens are cached for real, as they are for a
    target of another class (its attention is its own). The learned heads' attention is
    always the XLA path (`attention_over_parts`)."""
    configs = attention_configs(target, drafter)
    if not configs or any(attention_impl(cfg) != "xla" for cfg in configs):
        return context
    return min(context, CONTEXT)


def profile_width(drafter: AutoDrafter, context: int, steps: int = STEPS) -> int:
    """The cache width of the profile's program at `context` tokens: room for the timed steps
    and the two calls before them at the drafter's widest draft."""
    return context + (steps + 2) * (drafter.tree.num_nodes + 1)


def motif_tokens(target, batch_size: int, length: int) -> jax.Array:
    """`[B, length]` int32: each row a random motif of 8 tokens repeated (drafters find matches)."""
    motif = jax.random.randint(jax.random.PRNGKey(2), (batch_size, 8), 2, as_target(target).vocab_size)
    return jnp.tile(motif, (1, -(-length // 8)))[:, :length].astype(jnp.int32)


def started_state(target, params, drafter: AutoDrafter, drafter_params: AutoParams,
                  batch_size: int, context: int, width: int, sampling, criteria,
                  fill: bool | None = None):
    """`spec_start`'s (state, drafter state, metrics) of `batch_size` rows with `context` motif
    tokens cached in a `width`-token program, the root (the next step's first token) after them.

    fill (default: the drafter's `state_from_tokens`): prefill at most `CONTEXT` tokens, then
    stand the rest in (`filled`) instead of running the target over them: a step's cost does
    not depend on the values cached, and prefilling 1024 tokens a row was most of a wide
    profile (B = 8: ~38 of its 58 s). A drafter whose state needs the target's outputs over
    the context (a draft model's or a learned head's own cache) is prefilled whole."""
    if fill is None:
        fill = getattr(drafter, "inner", drafter).state_from_tokens
    prefilled = min(context, CONTEXT) if fill else context
    tokens = motif_tokens(target, batch_size, context + 1)
    started = spec_start_program(
        target, params, drafter, drafter_params, tokens[:, :prefilled],
        jnp.full((batch_size,), prefilled, jnp.int32), jnp.full((batch_size,), width, jnp.int32),
        as_target(target).init_cache(batch_size, width), jax.random.PRNGKey(3), sampling, criteria,
        drafter.init_carry(drafter_params), width=width)
    if prefilled == context:
        return started
    state, drafter_state, metrics = started
    return filled(state, tokens), drafter_state, metrics


def filled(state, tokens: jax.Array):
    """A `DecodeState` just after a prefill, grown to the context `tokens` `[B, C + 1]` (its
    prompt a head of them): the token buffer holds them (the last one the root), every row's
    prompt is the first C, and the cache's lengths advance to C over entries left as they are
    (a step reads them at the cost real entries would have)."""
    context = tokens.shape[1] - 1
    return state.replace(tokens=state.tokens.at[:, :context + 1].set(tokens),
                         num_tokens=jnp.full_like(state.num_tokens, context + 1),
                         prompt_lens=jnp.full_like(state.prompt_lens, context),
                         cache=state.cache.advance(context - state.cache.lengths))


def profile_step_costs(target, params, drafter: AutoDrafter, inner_params, batch_size: int, *,
                       context: int = CONTEXT, steps: int = STEPS, repeats: int = REPEATS,
                       budget_s: float = BUDGET_S, phases: dict | None = None,
                       width: int | None = None, fill: bool | None = None) -> list[float]:
    """`[S]` seconds of one step of each branch of `drafter` at `batch_size` rows with
    `context` tokens cached (rows repeating a short motif, so drafters find matches;
    `started_state`: `fill` stands the context in, default where the drafter allows), in a
    program whose cache holds `width` tokens (default `profile_width` of the context; at least
    that).

    One program serves every branch and step count (both are arguments): it compiles once, on
    the first call. The branches are then timed in turns, each turn a call of 1 step and one
    of `steps` steps per branch, `repeats` turns at most; past two turns, none starts once the
    timed calls took `budget_s`. What a call costs besides its steps (the dispatch, fresh
    buffers for the whole state out) is no cost of a job's steps, which run inside one
    program call: at B = 8 and 1024 cached tokens it was ~65-95 ms a call against ~45 ms a
    plain step, so t(4) / 4 priced every branch ~20 ms high and their ratios close to 1. It
    is the same for every branch (the same state goes in and out), so it is taken once, the
    median over the branches of the intercept of the line through each branch's two calls,
    and a branch's step cost is (t(steps) - that) / steps (the slope of one branch's two
    calls alone swung by 20 % between profiles; `benchmarks/auto_profile_time.py` prints
    both). Fastest times, because other work on the machine only ever adds time and a cost
    profiled during a burst of it would steer every later job (the file is kept): with the
    median of 3 turns of 2 steps, a B = 8 profile on a shared CPU once priced D = 1 below the
    plain step.
    phases: when given, gets "first_call_s" (compile + one call), "timed_s" and "call_s" (a
    call's cost besides its steps)."""
    if steps < 2:
        raise ValueError(f"the profile needs calls of 1 and of steps >= 2 steps, got steps={steps}")
    width = max(width or 0, profile_width(drafter, context, steps))
    sampling, criteria = SamplingParams.make(), StopCriteria.make((), ())
    params_ = AutoParams(inner=inner_params, step_s=jnp.ones((drafter.num_shapes,), jnp.float32))
    started = jax.block_until_ready(started_state(target, params, drafter, params_, batch_size,
                                                  context, width, sampling, criteria, fill))
    looped = drafter.loop_params(params_)  # as the decoding programs' loops read them
    run = lambda b, n: jax.block_until_ready(_forced_steps(
        target, params, drafter, looped, started, jnp.int32(b), sampling, criteria, jnp.int32(n)))
    first = time.perf_counter()
    run(0, 1)  # compiles (one program for every branch and step count)
    first = time.perf_counter() - first
    times = {n: [[] for _ in range(drafter.num_shapes)] for n in (1, steps)}
    timed = 0.0
    for turn in range(repeats):
        if turn >= 2 and timed >= budget_s:
            break
        for b in range(drafter.num_shapes):
            for n in (1, steps):
                begin = time.perf_counter()
                run(b, n)
                elapsed = time.perf_counter() - begin
                timed += elapsed
                times[n][b].append(elapsed)
    short, long = ([min(t) for t in times[n]] for n in (1, steps))
    # what a call costs besides its steps: from each branch, t(1) - (t(steps) - t(1)) /
    # (steps - 1); the same for every branch (the same state in and out), so their median
    call_s = float(np.median([max(0.0, (steps * t_short - t_long) / (steps - 1))
                              for t_short, t_long in zip(short, long)]))
    step_s = [max(t_long - call_s, 0.05 * t_long) / steps for t_long in long]
    if phases is not None:
        phases.update(first_call_s=first, timed_s=timed, call_s=call_s)
    chains = len(drafter.lengths)
    return monotone(step_s[:chains]) + step_s[chains:]


def monotone(costs: list[float]) -> list[float]:
    """The non-decreasing sequence closest to `costs` in least squares (pool adjacent
    violators): a chain of D does all a chain of D' < D does and more (more draft tokens, a
    wider verify), so a longer chain measured cheaper is noise (a loaded machine) and the two
    are pooled."""
    blocks: list[list[float]] = []  # [sum, count]
    for c in costs:
        blocks.append([c, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(int(count))]


def step_costs(target, params, drafter: AutoDrafter, inner_params, batch_size: int,
               log: Callable[[str], None] = stderr_line) -> tuple[list[int], list[list[float]]]:
    """(the profiled cache widths `[K]`, `[K][S]` the branches' step seconds at each): the
    cached ones, else measured at each of `CONTEXTS` (and cached)."""
    key = cost_key(target, drafter, batch_size, params)
    path = cost_path(key)
    step_s, problem = cached_costs(path, key)
    if step_s is not None:
        return key["widths"], step_s
    if problem:
        warnings.warn(f"auto step costs {path}: {problem}; profiling again", stacklevel=2)
    trees = "".join(f", tree {t.name or t.num_nodes}" for t in drafter.trees)
    cached = [cached_tokens(target, c, drafter) for c in CONTEXTS]
    log(f"auto: profiling the step costs of draft lengths {list(drafter.lengths)}{trees} at batch "
        f"{batch_size} on {key['device_kind']}, cache widths {' and '.join(map(str, key['widths']))} "
        f"({' and '.join(map(str, cached))} tokens cached; once per device, model, dtype and batch size)")
    begin = time.perf_counter()
    step_s = [profile_step_costs(target, params, drafter, inner_params, batch_size, context=c, width=w)
              for c, w in zip(cached, key["widths"])]
    seconds = time.perf_counter() - begin
    names = [f"D={d}" for d in drafter.lengths] + [f"tree{i}" for i in range(len(drafter.trees))]
    log(f"auto: profiled in {seconds:.1f} s (" + "; ".join(
        f"width {w}: " + ", ".join(f"{n} {s * 1e3:.2f} ms" for n, s in zip(names, at))
        for w, at in zip(key["widths"], step_s)) + f"), kept in {path}")
    try:
        write_costs(path, key, step_s, seconds)
    except OSError as err:
        warnings.warn(f"auto step costs not kept ({err})", stacklevel=2)
    return key["widths"], step_s


def costs_from_profile(profile: dict, batch_size: int, lengths: tuple[int, ...]) -> list[float]:
    """`[S]` step seconds from a latency profile's dict (`LatencyProfile.to_dict`, the
    "profile" of a `specjax tune` report) at `batch_size`: the measured whole step where it
    has one, else T_target(B, 1 + D) + T_draft(B, D); the plain step is T_ar(B)."""
    b = str(batch_size)
    target = {int(t): s for t, s in profile["target_s"][b].items()}
    ts = sorted(target)
    out = []
    for d in lengths:
        if d == 0:
            out.append(float(profile["ar_step_s"][b]))
        elif str(d) in profile.get("step_s", {}).get(b, {}):
            out.append(float(profile["step_s"][b][str(d)]))
        else:
            t_target = float(np.interp(1 + d, ts, [target[t] for t in ts]))
            out.append(t_target + float(profile.get("draft_s", {}).get(b, {}).get(str(d), 0.0)))
    return out


def auto_drafter(target, params, drafter, drafter_params, batch_size: int,
                 profile: dict | None = None, log: Callable[[str], None] = stderr_line,
                 trees: tuple = ()):
    """(AutoDrafter, AutoParams) driving `drafter` at `batch_size` rows: its branches (the
    plain step, `auto_lengths` chains up to what the drafter can draft, `auto_max_draft`) and
    their step costs (from `profile`, a latency profile dict, when given: at any width; else
    cached or measured at two cache widths, `step_costs`). trees: draft trees auto may pick too (`AutoDrafter.trees`; their
    costs are measured: a latency profile holds chains only)."""
    cfg = getattr(target, "cfg", target)
    group = getattr(cfg, "group_size", None)
    auto = AutoDrafter.wrap(drafter, auto_lengths(group, auto_max_draft(drafter)), trees=trees)
    if profile is not None and not trees:
        costs = AutoParams(drafter_params, jnp.asarray(costs_from_profile(profile, batch_size, auto.lengths),
                                                       jnp.float32))
    else:
        widths, step_s = step_costs(target, params, auto, drafter_params, batch_size, log)
        costs = AutoParams(drafter_params, jnp.asarray(step_s, jnp.float32), jnp.asarray(widths, jnp.float32))
    return auto, costs
