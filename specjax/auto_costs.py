"""Step costs of `num_draft="auto"`'s branches on this device, measured once and cached.

`auto_drafter(target, params, drafter, drafter_params, batch_size)` wraps a drafter for auto
(`drafters.auto.AutoDrafter`) with `AutoParams.step_s`: the seconds of one whole step of each
branch (the plain step and each chain length) at this batch size, at two cache widths
(those of `CONTEXTS`: a job is priced on the line through them at its program's width; where
the attention reads the whole buffer whatever is filled, the wide one with few tokens cached,
`cached_tokens`). They are
measured by running the branches themselves, forced, on a running batch
(`profile_step_costs`: compilation excluded, the caches donated so a call copies none, each
branch's median ratio to the plain step over rounds of calls), once per (device kind, model, dtype,
batch size, drafter, lengths), and kept as JSON in `$SPECJAX_CACHE/step_costs/` (default
`~/.cache/specjax/step_costs/`). A missing file is profiled (a line on stderr says so and how
long it took); an unreadable one, or one made for another device or model, is profiled again
with a warning: never an error. A profile whose branches' ratios scatter (a busy machine:
`NOISY`) serves its process and is profiled again by the next `REPROFILES` processes, the
steadiest kept. `costs_from_profile` reads the same costs from a
`specjax profile` / `specjax tune` latency profile instead.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from specjax.drafters.auto import AutoDrafter, AutoParams, auto_lengths, auto_max_draft
from specjax.kernels import argmax_cpu, attention_cpu, cpu_ffi, qmatmul_cpu
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
#: names the kernels' sources, `cost_key`; 6: the caches donated, each branch's median ratio to
#: the plain step over rounds of calls, was each one's fastest call, `profile_step_costs`; 7: a
#: lookup drafter's plain branch proposes a chain of `AutoDrafter.watch_depth`, not 1, on every
#: `watch_every`-th step; 8: a lookup drafter's chains in one loop at the longest, the nodes
#: deeper than the pick dead rows, `AutoDrafter.merged`, and greedy argmax by the CPU kernel)
VERSION = 8
CONTEXT = 64  # prompt tokens cached before the timed steps
#: the contexts profiled: a step's cost grows with its program's cache width (attention, the
#: cache writes), and not alike for every branch (SmolLM2, B = 8 here: D=4 / D=0 2.0 at 64
#: tokens, 1.7 at 1024), so a job is priced on the line through the two (`AutoParams.costs_at`;
#: Spec-Bench rows run at up to ~1100 entries: mostly inside the line, not past it)
CONTEXTS = (CONTEXT, 1024)
STEPS = 4  # steps of each branch's timed call (the plain branch's short one takes 1)
MIN_ROUNDS = 3  # rounds over the branches at least ...
ROUNDS = 16  # ... and at most
BUDGET_S = 10.0  # past MIN_ROUNDS, no further round once the timed calls took this
DONATED_BYTES = 1 << 16  # a profile call's leaves of at least this are donated (`Donated`)
#: a profile whose `ratio_noise` is above this (SmolLM2 on 2 CPU cores: 0.016-0.054 on a quiet
#: machine, 0.077-0.15 with a test suite running beside it) ...
NOISY = 0.065
REPROFILES = 2  # ... is profiled again by up to this many later processes, the steadiest kept
#: the cost files this process profiled: a noisy one is not profiled again by the same process
#: (a script generating many times, a benchmark's modes)
PROFILED_HERE: set[str] = set()


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


def mesh_of(params) -> dict[str, int] | None:
    """The axes of the device mesh the weights are sharded over ({"dp": 2, "tp": 4}), None on
    one device: a sharded step costs what its mesh makes it cost."""
    for leaf in jax.tree.leaves(params):
        mesh = getattr(getattr(leaf, "sharding", None), "mesh", None)
        if mesh is not None:
            return {str(name): int(size) for name, size in mesh.shape.items()}
    return None


def cost_key(target, drafter: AutoDrafter, batch_size: int, params=None) -> dict:
    """What a cached cost belongs to: the device, the programs' compile options, the model (its
    config, how its weights are held and over which mesh, and the attention that runs), the
    drafter, the branches, the batch size and the profiled cache widths (JSON-able, compared
    whole on load). On the CPU
    backend it names the C++ kernels' sources too: a changed kernel changes the costs."""
    device = jax.devices()[0]
    kernels = {"kernels": cpu_ffi.source_digest((qmatmul_cpu.SOURCE, attention_cpu.SOURCE, argmax_cpu.SOURCE))} if (
        jax.default_backend() == "cpu") else {}
    return {"version": VERSION, "backend": jax.default_backend(), "device_kind": device.device_kind,
            "compile_options": {name: str(value) for name, value in sorted(current_options().items())},
            "model": repr(target), "weights": weights_of(params), "mesh": mesh_of(params),
            "drafter": repr(drafter.inner),
            "attention": [attention_impl(cfg) for cfg in attention_configs(target, drafter)],
            "lengths": list(drafter.lengths), "merged": drafter.merged(batch_size),
            "batch_size": int(batch_size), "widths": [profile_width(drafter, c) for c in CONTEXTS]} | kernels | (
        {"trees": [[t.name, list(t.parents), list(t.ranks)] for t in drafter.trees]} if drafter.trees else {})


def cost_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return costs_folder() / f"{digest}.json"


@dataclasses.dataclass(frozen=True)
class KeptCosts:
    """A cost file's contents: `[len(CONTEXTS)][S]` step seconds, their `ratio_noise` (the
    largest of the widths') and how many profiles were taken to keep them."""

    step_s: list[list[float]]
    noise: float = 0.0
    profiles: int = 1

    @property
    def again(self) -> bool:
        """Profile again: noisy, and not yet profiled 1 + REPROFILES times."""
        return self.noise > NOISY and self.profiles <= REPROFILES


def cached_costs(path: Path, key: dict) -> tuple[KeptCosts | None, str | None]:
    """(KeptCosts, None) from a good file; (None, why not) otherwise (None: no file)."""
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
    noise, profiles = data.get("noise", 0.0), data.get("profiles", 1)
    if not isinstance(noise, (int, float)) or not isinstance(profiles, int):
        return None, "malformed step costs"
    return KeptCosts([[float(s) for s in at] for at in step_s], float(noise), profiles), None


def write_costs(path: Path, key: dict, kept: KeptCosts, seconds: float) -> None:
    """Writes the file atomically (a temporary file renamed over it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"key": key, "step_s": kept.step_s, "noise": round(kept.noise, 4),
                               "profiles": kept.profiles, "profile_s": round(seconds, 2)}),
                   encoding="utf-8")
    os.replace(tmp, path)


def forced_steps(target, params, drafter: AutoDrafter, drafter_params, started, branch, sampling,
                 criteria, steps):
    """`steps` `[]` steps of one branch `[]` from `spec_start`'s (state, drafter state,
    metrics), inside the branch's loop as a running job takes them."""
    state, drafter_state, metrics = started
    return drafter.switched_step(target, params, drafter_params, state, drafter_state, metrics,
                                 sampling, criteria, branch=branch, steps=steps)


_forced_steps = program(forced_steps, static_argnames=("target", "drafter"))


@dataclasses.dataclass(frozen=True)
class Donated:
    """A pytree's layout split in two: its leaves of at least `DONATED_BYTES` (the caches,
    `donated`, their flat indices) and the others. Static (hashable)."""

    treedef: Any
    donated: tuple[int, ...]

    @classmethod
    def of(cls, tree, min_bytes: int | None = None) -> Donated:
        leaves, treedef = jax.tree.flatten(tree)
        min_bytes = DONATED_BYTES if min_bytes is None else min_bytes
        return cls(treedef, tuple(i for i, leaf in enumerate(leaves) if leaf.nbytes >= min_bytes))

    def parts(self, tree) -> tuple[tuple, tuple]:
        """(the other leaves, the donated ones) of `tree`."""
        leaves = self.treedef.flatten_up_to(tree)
        donated = set(self.donated)
        return (tuple(leaf for i, leaf in enumerate(leaves) if i not in donated),
                tuple(leaves[i] for i in self.donated))

    def joined(self, kept: tuple, donated: tuple):
        """The tree of `parts`' two halves."""
        kept_, donated_ = iter(kept), iter(donated)
        picks = set(self.donated)
        return self.treedef.unflatten([next(donated_) if i in picks else next(kept_)
                                       for i in range(self.treedef.num_leaves)])


@functools.partial(program, static_argnames=("target", "drafter", "layout"),
                   donate_argnames=("buffers",))
def _rewound_steps(target, params, drafter: AutoDrafter, drafter_params, kept, buffers,
                   layout: Donated, branch, sampling, criteria, steps):
    """`forced_steps` from the start (`layout.joined(kept, buffers)`) whose large leaves
    `buffers` (the caches) are donated and returned, written in place: every call starts at
    the same context (the counts and lengths are `kept`'s, the start's) and copies no cache."""
    out = forced_steps(target, params, drafter, drafter_params, layout.joined(kept, buffers),
                       branch, sampling, criteria, steps)
    return layout.parts(out)[1]


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
                       context: int = CONTEXT, steps: int = STEPS, rounds: int = ROUNDS,
                       budget_s: float = BUDGET_S, phases: dict | None = None,
                       width: int | None = None, fill: bool | None = None) -> list[float]:
    """`[S]` seconds of one step of each branch of `drafter` at `batch_size` rows with
    `context` tokens cached (rows repeating a short motif, so drafters find matches;
    `started_state`: `fill` stands the context in, default where the drafter allows), in a
    program whose cache holds `width` tokens (default `profile_width` of the context; at least
    that).

    One program serves every branch and step count (both are arguments): it compiles once, on
    the first call. Every call starts from the same state, its caches donated and written in
    place (`_rewound_steps`): a call that copied them out cost ~60 ms besides its steps at
    B = 8 (a plain step ~45 ms), and taking that out again left the branches' ratios
    scattering by +-10 % between profiles. The branches are timed in rounds, each a call of
    `steps` steps of every branch (in turn, the order reversed every other round) and one of
    1 step of the plain branch; at least `MIN_ROUNDS` rounds, at most `rounds`, none started
    once the timed calls took `budget_s`. What is left of a call's own cost (the dispatch) is
    the median over rounds of the intercept of the plain branch's two calls, taken off every
    call. A branch's cost is its median over rounds of its ratio to the plain step of the same
    round, times the plain step's median: what auto's pick reads is these ratios, and the
    machine's load drifts between rounds, bursts within them (a burst in one call moves one
    round's ratio, which the median leaves out; the fastest call of each branch, the profile
    before, mixed calls from quiet and loaded spells).
    phases: when given, gets "first_call_s" (compile + one call), "timed_s", "call_s" (a
    call's cost besides its steps), "rounds", "ratio_spread" (`[S]` each branch's
    interquartile range of its per-round ratios to the plain step) and "noise"
    (`ratio_noise`)."""
    if steps < 2:
        raise ValueError(f"the profile needs calls of 1 and of steps >= 2 steps, got steps={steps}")
    width = max(width or 0, profile_width(drafter, context, steps))
    sampling, criteria = SamplingParams.make(), StopCriteria.make((), ())
    params_ = AutoParams(inner=inner_params, step_s=jnp.ones((drafter.num_shapes,), jnp.float32))
    started = jax.block_until_ready(started_state(target, params, drafter, params_, batch_size,
                                                  context, width, sampling, criteria, fill))
    looped = drafter.loop_params(params_)  # as the decoding programs' loops read them
    layout = Donated.of(started)
    kept, buffers = layout.parts(started)
    buffers = [jax.tree.map(jnp.copy, buffers)]  # the start's own stay as they are

    def run(branch: int, n: int) -> float:
        begin = time.perf_counter()
        buffers[0] = jax.block_until_ready(_rewound_steps(
            target, params, drafter, looped, kept, buffers[0], layout, jnp.int32(branch),
            sampling, criteria, jnp.int32(n)))
        return time.perf_counter() - begin

    first = run(0, 1)  # compiles (one program for every branch and step count)
    long: list[list[float]] = []  # [round][S] seconds of a call of `steps` steps
    short: list[float] = []  # [round] seconds of the plain branch's call of 1 step
    timed = 0.0
    for r in range(max(rounds, MIN_ROUNDS)):
        if r >= MIN_ROUNDS and timed >= budget_s:
            break
        order = range(drafter.num_shapes) if r % 2 == 0 else reversed(range(drafter.num_shapes))
        at = [0.0] * drafter.num_shapes
        for b in order:
            at[b] = run(b, steps)
        short.append(run(0, 1))
        long.append(at)
        timed += sum(at) + short[-1]
    times = np.asarray(long)  # [R, S]
    call_s = max(0.0, float(np.median((steps * np.asarray(short) - times[:, 0]) / (steps - 1))))
    per_step = np.maximum(times - call_s, 0.05 * times) / steps
    ratios = per_step / per_step[:, :1]  # [R, S]
    plain_s = float(np.median(per_step[:, 0]))
    step_s = [plain_s * float(r) for r in np.median(ratios, axis=0)]
    if phases is not None:
        q75, q25 = np.percentile(ratios, [75, 25], axis=0)
        phases.update(first_call_s=first, timed_s=timed, call_s=call_s, rounds=len(long),
                      ratio_spread=[float(x) for x in q75 - q25], noise=ratio_noise(ratios))
    chains = len(drafter.lengths)
    return monotone(step_s[:chains]) + step_s[chains:]


def ratio_noise(ratios: np.ndarray) -> float:
    """The largest relative standard error of a branch's median ratio to the plain step, from
    the rounds' ratios `[R, S]`: 0.93 x the interquartile range / sqrt(R) / the median (a
    normal sample's, 1.2533 sigma / sqrt(R) with sigma = IQR / 1.349)."""
    q75, median, q25 = np.percentile(ratios, [75, 50, 25], axis=0)
    return float(np.max(0.93 * (q75 - q25) / np.sqrt(len(ratios)) / median))


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
    cached ones, else measured at each of `CONTEXTS` (and cached). Costs kept from a noisy
    profile (`KeptCosts.again`) are measured again by a later process (`PROFILED_HERE`), and the
    steadier of the two kept."""
    key = cost_key(target, drafter, batch_size, params)
    path = cost_path(key)
    kept, problem = cached_costs(path, key)
    shape = (len(key["widths"]), drafter.num_shapes)
    use_kept = kept is not None and (not kept.again or str(path) in PROFILED_HERE)
    across = spans_processes(params)
    if process_zeros(np.asarray(use_kept), across):  # every process as process 0 decided: no profile
        if not across:
            return key["widths"], kept.step_s
        local = kept.step_s if kept is not None else np.zeros(shape)  # another host's disk: 0's costs
        return key["widths"], process_zeros(np.asarray(local, np.float32), across).tolist()
    if problem:
        warnings.warn(f"auto step costs {path}: {problem}; profiling again", stacklevel=2)
    trees = "".join(f", tree {t.name or t.num_nodes}" for t in drafter.trees)
    cached = [cached_tokens(target, c, drafter) for c in CONTEXTS]
    why = ("once per device, model, dtype and batch size" if kept is None else
           f"again: the kept ones are uncertain to +-{100 * kept.noise:.0f} %, profile {kept.profiles + 1} "
           f"of at most {1 + REPROFILES}")
    log(f"auto: profiling the step costs of draft lengths {list(drafter.lengths)}{trees} at batch "
        f"{batch_size} on {key['device_kind']}, cache widths {' and '.join(map(str, key['widths']))} "
        f"({' and '.join(map(str, cached))} tokens cached; {why})")
    begin = time.perf_counter()
    step_s, noise = [], 0.0
    for c, w in zip(cached, key["widths"]):
        phases: dict = {}
        step_s.append(profile_step_costs(target, params, drafter, inner_params, batch_size,
                                         context=c, width=w, phases=phases))
        noise = max(noise, phases.get("noise", 0.0))
    seconds = time.perf_counter() - begin
    PROFILED_HERE.add(str(path))
    names = [f"D={d}" for d in drafter.lengths] + [f"tree{i}" for i in range(len(drafter.trees))]
    log(f"auto: profiled in {seconds:.1f} s (" + "; ".join(
        f"width {w}: " + ", ".join(f"{n} {s * 1e3:.2f} ms" for n, s in zip(names, at))
        for w, at in zip(key["widths"], step_s)) + f"), kept in {path}")
    fresh = KeptCosts(step_s, noise, 1 if kept is None else kept.profiles + 1)
    best = fresh if kept is None or fresh.noise <= kept.noise else dataclasses.replace(
        kept, profiles=fresh.profiles)
    if best is not fresh:
        log(f"auto: kept the earlier profile's costs instead, steadier (+-{100 * kept.noise:.0f} % "
            f"against +-{100 * fresh.noise:.0f} %)")
    if across:  # each process timed its own steps: all take process 0's
        agreed = process_zeros(np.asarray([best.noise, best.profiles] + sum(best.step_s, []), np.float32),
                               across)
        best = KeptCosts(agreed[2:].reshape(shape).tolist(), float(agreed[0]), int(agreed[1]))
    if best.again:
        log(f"auto: the branches' costs are uncertain to +-{100 * best.noise:.0f} % (their rounds "
            f"scatter: a busy machine?); the next process profiles again (at most {1 + REPROFILES - best.profiles} more "
            "times), keeping the steadiest")
    try:
        write_costs(path, key, best, seconds)
    except OSError as err:
        warnings.warn(f"auto step costs not kept ({err})", stacklevel=2)
    return key["widths"], best.step_s


def spans_processes(params) -> bool:
    """Whether the model's weights are sharded over a mesh of several processes (`--mesh` over
    a multi-process job): then every program of the job runs across them."""
    return any(not getattr(leaf, "is_fully_addressable", True) for leaf in jax.tree.leaves(params))


def process_zeros(value: np.ndarray, across: bool) -> np.ndarray:
    """Process 0's `value` on every process where the job's programs run `across` processes
    (`spans_processes`), else `value`. Such processes must all run the same profile programs
    (or none) and price the branches alike: one that picked another branch than the rest
    would wait on them for good (the likely cause of a hang seen once in
    `tests/test_multiprocess.py`: both processes profiled again, each kept its own clock's
    costs). Processes that each run their own rows (no mesh across them) decide alone."""
    if not across:
        return value
    return np.asarray(multihost_utils.broadcast_one_to_all(value))


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
