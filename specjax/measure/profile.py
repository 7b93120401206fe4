"""Latency profiler: what one decoding step costs on the current device.

  T_target(B, T)  the target's forward over T new tokens per row (B rows, `context` tokens
                  already cached), with logits for all T tokens, as verification computes them
  T_draft(B, D)   the drafter's propose + update for one step (chain of D, or a tree)
  T_step(B, D)    one whole speculative step: propose, verify, accept, commit, append, update
  T_ar(B)         one plain decoding step (forward of 1 token, sample, append)

Each number is the median of `repeats` timed calls after `warmup` untimed ones (compilation is
excluded), with the donated state chained from call to call as inside the real loop; the
timers of one batch size take turns call by call, so a shared machine's drifting load hits
them alike.

Models: a loaded model (preset, .gguf, HF folder) or a shape-only one, `random:NAME[:LAYERS]`:
the architecture of `configs/models/shapes/NAME.yaml` with random weights (`init_params`),
optionally cut to LAYERS layers, so that large shapes can be profiled without their weights.
"""
from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from importlib import resources
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import yaml

from specjax.loop import StopCriteria, ar_step, init_state, prefill, spec_step
from specjax.metrics import SpecMetrics
from specjax.models.cache import init_cache
from specjax.models.config import ModelConfig, RopeScaling
from specjax.models.hub import load_model
from specjax.models.llama import forward, init_params
from specjax.models.quant import quantize_params
from specjax.sampling import SamplingParams
from specjax.verify import verify
from specjax.xla_options import program

RANDOM_PREFIX = "random:"
SHAPES_DIR = "models/shapes"


# ---------------------------------------------------------------------------------------------
# Models: real or shape-only
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class RandomModel:
    """A shape-only model: a preset's config with random weights and no tokenizer."""

    cfg: ModelConfig
    params: Any
    tokenizer: None = None
    source: str = ""


def available_shapes() -> list[str]:
    root = resources.files("specjax.configs").joinpath(SHAPES_DIR)
    return sorted(f.name[: -len(".yaml")] for f in root.iterdir() if f.name.endswith(".yaml"))


def shape_config(name: str, num_layers: int | None = None, dtype: str = "float32") -> ModelConfig:
    """The ModelConfig of shape preset `name`, optionally with `num_layers` layers."""
    resource = resources.files("specjax.configs").joinpath(f"{SHAPES_DIR}/{name}.yaml")
    if not resource.is_file():
        raise ValueError(f"unknown shape preset {name!r}; shapes: {', '.join(available_shapes())}")
    fields = dict(yaml.safe_load(resource.read_text(encoding="utf-8"))["config"])
    if fields.get("rope_scaling"):
        fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
    fields["eos_token_ids"] = tuple(fields.get("eos_token_ids", ()))
    if num_layers is not None:
        if num_layers < 1:
            raise ValueError(f"random:{name}:{num_layers}: the number of layers must be >= 1")
        fields["num_layers"] = num_layers
    return ModelConfig(**fields, dtype=dtype, name=f"random:{name}")


def parse_random_spec(spec: str) -> tuple[str, int | None]:
    """`random:NAME[:LAYERS]` -> (NAME, LAYERS or None)."""
    body = spec[len(RANDOM_PREFIX):]
    name, _, layers = body.partition(":")
    if not name:
        raise ValueError(f"{spec!r}: expected random:NAME[:LAYERS]")
    try:
        return name, int(layers) if layers else None
    except ValueError:
        raise ValueError(f"{spec!r}: LAYERS must be an integer") from None


def load_target(spec, dtype: str = "float32", seed: int = 0, shardings=None,
                quantize: str | None = None):
    """A model object with .cfg, .params, .tokenizer (None for shape-only models).

    spec: an already loaded model, `random:NAME[:LAYERS]`, or anything `load_model` takes;
    shardings: `load_model`'s (a checkpoint loads straight into its shards; random params are
    placed when a run shards them); quantize: `load_model`'s (random params too).
    """
    if not isinstance(spec, str):
        return spec
    if spec.startswith(RANDOM_PREFIX):
        cfg = shape_config(*parse_random_spec(spec), dtype=dtype)
        params = quantize_params(init_params(cfg, jax.random.PRNGKey(seed)), quantize)
        return RandomModel(cfg=cfg, params=params, source=spec)

    return load_model(spec, dtype=dtype, shardings=shardings, quantize=quantize)


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


def device_info() -> dict:
    dev = jax.devices()[0]
    return {
        "backend": jax.default_backend(),
        "device_kind": dev.device_kind,
        "num_devices": jax.device_count(),
        "jax_version": jax.__version__,
    }


Timer = tuple[Callable[[Any], Any], Any]  # (step: state -> state, initial state)


def interleaved_medians(timers: dict[str, Timer], *, repeats: int = 5, warmup: int = 2) -> dict[str, float]:
    """Median seconds of `state = step(state)` per timer, timed round-robin.

    Each step should donate its state (as the real loop updates in place). After `warmup`
    untimed calls each (compilation included there), the timers take turns for `repeats`
    rounds, so that a machine whose load drifts (shared CPUs) slows all of them alike.
    """
    states = {}
    for name, (step, state) in timers.items():
        for _ in range(warmup):
            state = jax.block_until_ready(step(state))
        states[name] = state
    times: dict[str, list[float]] = {name: [] for name in timers}
    for _ in range(repeats):
        for name, (step, _) in timers.items():
            start = time.perf_counter()
            states[name] = jax.block_until_ready(step(states[name]))
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def _median(timer: Timer, repeats: int, warmup: int) -> float:
    return interleaved_medians({"t": timer}, repeats=repeats, warmup=warmup)["t"]


@functools.partial(program, static_argnames=("cfg",), donate_argnames=("cache",))
def _forward_tokens(cfg: ModelConfig, params, tokens, cache):
    """The target over tokens `[B, T]` after each row's cached prefix; -> (cache, argmax `[B, T]`).

    Lengths are not advanced, so repeated calls cost the same.
    """
    positions = cache.lengths[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
    out = forward(cfg, params, tokens, positions, cache)
    return out.cache, jnp.argmax(out.logits, axis=-1)


def target_timer(cfg: ModelConfig, params, batch_size: int, num_tokens: int, *, context: int,
                 capacity: int | None = None) -> Timer:
    """Timer of T_target(B, T): forward over T tokens with `context` entries cached."""
    capacity = max(capacity or 0, context + num_tokens)
    cache = init_cache(cfg, batch_size, capacity)
    cache = cache.replace(lengths=jnp.full((batch_size,), context, jnp.int32))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (batch_size, num_tokens), 0, cfg.vocab_size)
    return (lambda c: _forward_tokens(cfg, params, tokens, c)[0]), cache


def target_latency(cfg: ModelConfig, params, batch_size: int, num_tokens: int, *, context: int,
                   capacity: int | None = None, repeats: int = 5, warmup: int = 2) -> float:
    """T_target(B, T) in seconds."""
    timer = target_timer(cfg, params, batch_size, num_tokens, context=context, capacity=capacity)
    return _median(timer, repeats, warmup)


# ---- decode-state fixtures for step / draft timing ------------------------------------------


def _no_stop() -> StopCriteria:
    return StopCriteria.make((), ())


@functools.partial(program, static_argnames=("cfg", "drafter"), donate_argnames=("cache",))
def _prefilled_jit(cfg, params, drafter, drafter_params, prompt_tokens, cache, key, sampling):
    batch, prompt_width = prompt_tokens.shape
    width = cache.capacity
    lengths = jnp.full((batch,), prompt_width, jnp.int32)
    max_new = jnp.full((batch,), width, jnp.int32)
    state = init_state(prompt_tokens, lengths, max_new, cache, key, width)
    hidden = drafter.hidden_layers if drafter is not None else ()
    state, out = prefill(cfg, params, state, prompt_width, sampling, _no_stop(), hidden)
    if drafter is None:
        return state, ()
    dstate = drafter.resume(drafter.init(drafter_params, batch, width), drafter.init_carry(drafter_params))
    return state, drafter.prefill(drafter_params, dstate, state, out)


def _prompt(cfg: ModelConfig, batch_size: int, context: int) -> jax.Array:
    """`[B, context]` random prompt tokens (repeating a short motif, so n-gram drafters match)."""
    motif = jax.random.randint(jax.random.PRNGKey(2), (batch_size, 8), 2, cfg.vocab_size)
    return jnp.tile(motif, (1, -(-context // 8)))[:, :context].astype(jnp.int32)


def _prefilled(cfg, params, drafter, drafter_params, batch_size: int, context: int, num_nodes: int,
               calls: int, capacity: int | None):
    """A running batch right after prefilling `context` prompt tokens, in a buffer and cache
    wide enough for `calls` steps of 1 + num_nodes tokens (rows never finish):
    (DecodeState, drafter state)."""
    width = max(capacity or 0, context + (calls + 1) * (num_nodes + 1))
    return _prefilled_jit(cfg, params, drafter, drafter_params, _prompt(cfg, batch_size, context),
                          init_cache(cfg, batch_size, width), jax.random.PRNGKey(3),
                          SamplingParams.make())


@functools.partial(program, static_argnames=("cfg",), donate_argnames=("state",))
def _ar_step_jit(cfg, params, state, sampling):
    return ar_step(cfg, params, state, sampling, _no_stop())


def ar_step_timer(cfg: ModelConfig, params, batch_size: int, *, context: int,
                  capacity: int | None = None, calls: int = 8) -> Timer:
    """Timer of T_ar(B): one plain decoding step (forward of the root, sample, append)."""
    sampling = SamplingParams.make()
    state, _ = _prefilled(cfg, params, None, None, batch_size, context, 0, calls, capacity)
    return (lambda s: _ar_step_jit(cfg, params, s, sampling)), state


@functools.partial(program, static_argnames=("cfg", "drafter"), donate_argnames=("carry",))
def _spec_step_jit(cfg, params, drafter, drafter_params, carry, sampling):
    state, dstate, metrics = carry
    return spec_step(cfg, params, drafter, drafter_params, state, dstate, metrics, sampling, _no_stop())


def step_timer(cfg: ModelConfig, params, drafter, drafter_params, batch_size: int, *, context: int,
               capacity: int | None = None, calls: int = 8) -> Timer:
    """Timer of T_step(B, drafter): one whole speculative step (draft + verify + accept + ...)."""
    sampling = SamplingParams.make()
    tree = drafter.tree
    state, dstate = _prefilled(cfg, params, drafter, drafter_params, batch_size, context,
                               tree.num_nodes, calls, capacity)
    metrics = jax.tree.map(jnp.copy, SpecMetrics.zeros(batch_size, tree.max_depth))  # distinct buffers
    looped = drafter.loop_params(drafter_params)  # once, as the decoding programs' loops do
    step = lambda c: _spec_step_jit(cfg, params, drafter, looped, c, sampling)
    return step, (state, dstate, metrics)


@functools.partial(program, static_argnames=("cfg", "drafter"))
def _verified(cfg, params, drafter, drafter_params, state, dstate, key, sampling):
    """(target ForwardOutput, AcceptResult) of one step from this state: update's inputs."""

    draft, _ = drafter.propose(drafter_params, dstate, state, key, sampling)
    out = verify(cfg, params, state.cache, state.last_token, draft, drafter.tree, drafter.hidden_layers)
    return out, drafter.accept(drafter_params, key, out.logits, draft, sampling)


@functools.partial(program, static_argnames=("drafter",), donate_argnames=("dstate",))
def _draft_only(drafter, drafter_params, dstate, state, key, sampling, target_out, result):
    """propose + update of the drafter alone -> (drafter state, draft tokens `[B, N]`)."""
    draft, dstate = drafter.propose(drafter_params, dstate, state, key, sampling)
    return drafter.update(drafter_params, dstate, state, result, target_out), draft.tokens


def draft_timer(cfg: ModelConfig, params, drafter, drafter_params, batch_size: int, *, context: int,
                capacity: int | None = None, calls: int = 8) -> Timer:
    """Timer of T_draft(B, drafter): the drafter's propose + update (target excluded)."""
    sampling = SamplingParams.make()
    key = jax.random.PRNGKey(4)
    state, dstate = _prefilled(cfg, params, drafter, drafter_params, batch_size, context,
                               drafter.tree.num_nodes, calls, capacity)
    target_out, result = _verified(cfg, params, drafter, drafter_params, state, dstate, key, sampling)
    looped = drafter.loop_params(drafter_params)  # once, as the decoding programs' loops do
    step = lambda d: _draft_only(drafter, looped, d, state, key, sampling, target_out, result)[0]
    return step, dstate


def draft_latency(cfg, params, drafter, drafter_params, batch_size: int, *, context: int,
                  capacity: int | None = None, repeats: int = 5, warmup: int = 2) -> float:
    """T_draft(B, drafter) in seconds."""
    timer = draft_timer(cfg, params, drafter, drafter_params, batch_size, context=context,
                        capacity=capacity, calls=repeats + warmup)
    return _median(timer, repeats, warmup)


def step_costs(model, batch_size: int, drafters: dict[str, tuple[Any, Any]], *, context: int,
               capacity: int | None = None, repeats: int = 5, warmup: int = 1) -> dict[str, float]:
    """T_step(B, .) in seconds per labelled (drafter, drafter params), and T_ar(B) under "0":
    only the whole-step timers, round-robin, for a quick re-profile."""
    cfg, params = model.cfg, model.params
    where = dict(context=context, capacity=capacity, calls=repeats + warmup)
    timers = {"0": ar_step_timer(cfg, params, batch_size, **where)}
    for label, (drafter, dparams) in drafters.items():
        timers[label] = step_timer(cfg, params, drafter, dparams, batch_size, **where)
    return interleaved_medians(timers, repeats=repeats, warmup=warmup)


# ---------------------------------------------------------------------------------------------
# Profiles
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class LatencyProfile:
    """Measured step costs (seconds) on one device, keyed by batch size.

    target[B][T] = T_target(B, T); ar_step[B] = T_ar(B); draft[B][label] = T_draft(B, .) and
    step[B][label] = T_step(B, .) for draft shapes named by `label` (a chain's D as a string,
    or a tree preset's name).
    """

    model: str
    device: dict
    context: int
    capacity: int | None = None
    target: dict[int, dict[int, float]] = dataclasses.field(default_factory=dict)
    ar_step: dict[int, float] = dataclasses.field(default_factory=dict)
    draft: dict[int, dict[str, float]] = dataclasses.field(default_factory=dict)
    step: dict[int, dict[str, float]] = dataclasses.field(default_factory=dict)

    def target_at(self, batch_size: int, num_tokens: int) -> float:
        """T_target(B, T), linearly interpolated between measured T (clamped at the ends)."""
        curve = self.target[batch_size]
        ts = sorted(curve)
        return float(np.interp(num_tokens, ts, [curve[t] for t in ts]))

    def merged(self, other: LatencyProfile) -> LatencyProfile:
        """This profile plus other's batch sizes (other's entries win where both have one)."""
        return dataclasses.replace(
            self, target=self.target | other.target, ar_step=self.ar_step | other.ar_step,
            draft=self.draft | other.draft, step=self.step | other.step,
        )

    def to_dict(self) -> dict:
        str_keys = lambda d: {str(k): (str_keys(v) if isinstance(v, dict) else v) for k, v in d.items()}
        return {
            "model": self.model, "device": self.device, "context": self.context,
            "capacity": self.capacity, "target_s": str_keys(self.target),
            "ar_step_s": str_keys(self.ar_step), "draft_s": str_keys(self.draft),
            "step_s": str_keys(self.step),
        }

    @classmethod
    def from_dict(cls, data: dict) -> LatencyProfile:
        return cls(
            model=data["model"], device=data["device"], context=data["context"],
            capacity=data.get("capacity"),
            target={int(b): {int(t): s for t, s in c.items()} for b, c in data["target_s"].items()},
            ar_step={int(b): s for b, s in data["ar_step_s"].items()},
            draft={int(b): dict(c) for b, c in data["draft_s"].items()},
            step={int(b): dict(c) for b, c in data["step_s"].items()},
        )


def profile_latency(
    model,
    batch_sizes: Sequence[int],
    target_tokens: Iterable[int],
    drafters: dict[str, tuple[Any, Any]] | None = None,
    *,
    context: int = 256,
    capacity: int | None = None,
    repeats: int = 5,
    warmup: int = 2,
    steps: bool = True,
    log: Callable[[str], None] | None = None,
) -> LatencyProfile:
    """Measures T_target(B, T) for every T in target_tokens, T_ar(B), and for each labelled
    (drafter, drafter params) T_draft(B, .) and (when `steps`) T_step(B, .).

    All timers of one batch size are measured round-robin (`interleaved_medians`).
    """
    cfg, params = model.cfg, model.params
    where = dict(context=context, capacity=capacity)
    calls = repeats + warmup
    prof = LatencyProfile(model=cfg.name, device=device_info(), context=context, capacity=capacity)
    say = log or (lambda _: None)
    tokens = sorted(set(target_tokens))
    for b in batch_sizes:
        timers: dict[str, Timer] = {f"T{t}": target_timer(cfg, params, b, t, **where) for t in tokens}
        timers["ar"] = ar_step_timer(cfg, params, b, calls=calls, **where)
        for label, (drafter, dparams) in (drafters or {}).items():
            timers[f"draft:{label}"] = draft_timer(cfg, params, drafter, dparams, b, calls=calls, **where)
            if steps:
                timers[f"step:{label}"] = step_timer(cfg, params, drafter, dparams, b, calls=calls, **where)
        got = interleaved_medians(timers, repeats=repeats, warmup=warmup)
        prof.target[b] = {t: got[f"T{t}"] for t in tokens}
        prof.ar_step[b] = got["ar"]
        prof.draft[b] = {k[len("draft:"):]: v for k, v in got.items() if k.startswith("draft:")}
        prof.step[b] = {k[len("step:"):]: v for k, v in got.items() if k.startswith("step:")}
        say(f"B={b}: T_ar={prof.ar_step[b] * 1e3:.2f} ms, T_target(T)=" + ", ".join(
            f"{t}:{s * 1e3:.2f}" for t, s in prof.target[b].items()) + " ms")
        for label in drafters or {}:
            say(f"B={b} {label}: T_draft={prof.draft[b][label] * 1e3:.2f} ms" + (
                f", T_step={prof.step[b][label] * 1e3:.2f} ms" if steps else ""))
    return prof
