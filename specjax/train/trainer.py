"""Drafter training: optax AdamW + warmup-cosine, one jitted step, orbax checkpoints, resume.

One step = one frozen target forward over a batch of self-distilled sequences (features and
logits on the fly), the head's loss (its kind's `HeadKind.loss`), an AdamW update. The batch and
the PRNG key of step s are pure functions of (seed, s) (`data.get_batch`, `fold_in`), and the
whole TrainState (step, params, optimizer state, consts) is checkpointed, so a run killed at
any point and resumed from its last checkpoint ends with exactly the parameters of an
uninterrupted run.

Output folder layout (read back by `specjax.drafters.learned.checkpoint`):

  OUT/drafter.json        kind, head config, target name and config, train config, data meta
  OUT/checkpoints/<step>/ orbax CheckpointManager (keep-last-N, every save_every steps + final)
  OUT/metrics.jsonl       {"step", "loss", per-step metrics, "tokens", "elapsed_s"} rows; "tokens"
                          counts from step 0 (a resumed run continues it), "elapsed_s" this run
  OUT/data/               the self-distilled sequences (`data.Sequences` format), generated
                          and checked in OUT/.data.partial and renamed only when complete
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import struct

from specjax.drafters.learned import checkpoint
from specjax.drafters.learned.blocks import TargetView
from specjax.drafters.learned.objectives import target_pass
from specjax.drafters.learned.registry import (
    init_from_target,
    init_head,
    kind_of,
    make_head_config,
)
from specjax.jsonfile import write_text_atomic
from specjax.progress import progress_bar
from specjax.sharding import put, replicated, rows_sharding, shard_params
from specjax.train import data as training_data
from specjax.train.data import (
    Sequences,
    get_batch,
    response_mask,
    response_tokens,
    tokens_before,
)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimisation and bookkeeping knobs (static)."""

    steps: int
    batch_size: int = 8
    learning_rate: float = 3e-4
    warmup_steps: int = 0  # 0: 5% of steps
    end_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0
    save_every: int = 100
    keep: int = 3
    log_every: int = 10

    def __post_init__(self):
        if self.steps < 1 or self.batch_size < 1:
            raise ValueError(f"steps and batch_size must be >= 1, got {self.steps}, {self.batch_size}")

    @property
    def warmup(self) -> int:
        return self.warmup_steps or max(1, self.steps // 20)


def adamw_cosine(learning_rate: float, warmup: int, decay_steps: int, end_lr_ratio: float,
                 weight_decay: float, grad_clip: float) -> optax.GradientTransformation:
    """Global-norm clipping + AdamW on a linear-warmup, cosine-decay schedule (the drafter
    trainer's and the synthetic target's, `train.target_lm`)."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=learning_rate, warmup_steps=warmup, decay_steps=decay_steps,
        end_value=learning_rate * end_lr_ratio,
    )
    return optax.chain(optax.clip_by_global_norm(grad_clip),
                       optax.adamw(schedule, weight_decay=weight_decay))


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    return adamw_cosine(tc.learning_rate, tc.warmup, max(tc.steps, tc.warmup + 1), tc.end_lr_ratio,
                        tc.weight_decay, tc.grad_clip)


@struct.dataclass
class TrainState:
    step: jax.Array  # [] int32 steps done
    params: dict  # trainable head params
    opt_state: optax.OptState
    consts: dict  # non-trained head variables (e.g. EAGLE-3's draft_to_target)

    @property
    def variables(self) -> dict:
        return {"params": self.params, "consts": self.consts}


def init_train_state(head_cfg, tc: TrainConfig, consts: dict | None = None,
                     target_params=None, start: dict | None = None) -> TrainState:
    """Fresh state: head params from PRNGKey(seed) (the LM-head-side pieces from the target's
    when target_params is given, the kind's `init_from_target`), optimizer state, step 0.

    start: head variables {"params", "consts"} to start from instead (an earlier drafter,
    `load_init`); their shapes must be the head config's."""
    if start is not None:
        variables = {"params": start["params"], "consts": dict(start.get("consts", {}))}
        check_shapes(head_cfg, variables)
    else:
        variables = init_head(head_cfg, jax.random.PRNGKey(tc.seed), consts)
        if target_params is not None:
            variables = init_from_target(head_cfg, variables, target_params)
    params = variables["params"]
    return TrainState(step=jnp.int32(0), params=params, opt_state=make_optimizer(tc).init(params),
                      consts=variables.get("consts", {}))


def check_shapes(head_cfg, variables: dict) -> None:
    """ValueError naming the first leaf whose shape is not the one a fresh head of head_cfg has."""
    want = jax.eval_shape(lambda: init_head(head_cfg, jax.random.PRNGKey(0)))
    want = {"params": want["params"], "consts": want.get("consts", {})}
    got = jax.tree_util.tree_flatten_with_path(variables)[0]
    expected = dict(jax.tree_util.tree_flatten_with_path(want)[0])
    if {path for path, _ in got} != set(expected):
        raise ValueError(f"its {head_cfg.kind} head has other parameters than this head config")
    for path, leaf in got:
        if tuple(np.shape(leaf)) != tuple(expected[path].shape):
            raise ValueError(f"{jax.tree_util.keystr(path)} has shape {tuple(np.shape(leaf))}, "
                             f"this {head_cfg.kind} head needs {tuple(expected[path].shape)}")


@functools.partial(jax.jit, static_argnames=("head_cfg", "tc"))
def train_step(head_cfg, tc: TrainConfig, state: TrainState, target_params, batch, key):
    """One optimisation step -> (state, metrics {"loss", ...})."""
    tout = target_pass(head_cfg.target, target_params, batch["tokens"], head_cfg.hidden_layers)
    parts = TargetView(head_cfg.target).parts(target_params)
    loss = kind_of(head_cfg).loss

    def objective(params):
        return loss(head_cfg, {"params": params, "consts": state.consts}, parts, tout, batch, key)

    (value, metrics), grads = jax.value_and_grad(objective, has_aux=True)(state.params)
    updates, opt_state = make_optimizer(tc).update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
    return state, {"loss": value, **metrics}


def step_key(seed: int, step: int) -> jax.Array:
    return jax.random.fold_in(jax.random.PRNGKey(seed), step)


# ---------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------


def checkpoint_manager(out_dir: str | Path, tc: TrainConfig) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(
        max_to_keep=tc.keep, save_interval_steps=tc.save_every, create=True,
    )
    return ocp.CheckpointManager(Path(out_dir).absolute() / checkpoint.CHECKPOINTS, options=options)


def save_state(mngr: ocp.CheckpointManager, state: TrainState, force: bool = False) -> bool:
    return mngr.save(int(state.step), args=ocp.args.Composite(state=ocp.args.StandardSave(state)),
                     force=force)


def restore_state(mngr: ocp.CheckpointManager, like: TrainState, step: int | None = None) -> TrainState:
    """The state saved at `step` (default: the latest), with `like`'s tree structure."""
    step = mngr.latest_step() if step is None else step
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
    restored = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))
    return restored["state"]


def write_description(out_dir: Path, head_cfg, tc: TrainConfig, data_meta: dict) -> None:
    desc = checkpoint.describe(head_cfg, dataclasses.asdict(tc), data_meta)
    write_text_atomic(out_dir / checkpoint.DESCRIPTION, json.dumps(desc, indent=1))


def read_description(folder: Path, target_cfg) -> tuple[dict, object, TrainConfig]:
    """(OUT/drafter.json, its head config for target_cfg, its TrainConfig); a malformed file
    -> one-line ValueError naming it."""
    desc, head_cfg = checkpoint.read_description(folder, target_cfg)
    try:
        return desc, head_cfg, TrainConfig(**desc["train"])
    except (TypeError, ValueError) as e:
        raise ValueError(f"{folder / checkpoint.DESCRIPTION}: unusable train config ({e})") from None


def metric_lines_until(lines: list[str], step: int) -> tuple[list[str], int]:
    """(the lines of rows with "step" <= step, how many non-blank lines were not rows)."""
    kept, unreadable = [], 0
    for line in filter(str.strip, lines):
        try:
            row_step = json.loads(line)["step"]
            if row_step <= step:
                kept.append(line)
        except (json.JSONDecodeError, KeyError, TypeError):
            unreadable += 1
    return kept, unreadable


def keep_metrics_until(path: Path, step: int) -> None:
    """Drops the rows of metrics.jsonl past `step`, the checkpoint a run starts from: those
    steps are redone, so the log never repeats a step. Torn or corrupt lines are dropped too,
    with a warning naming the file."""
    if not path.exists():
        return
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    kept, unreadable = metric_lines_until(lines, step)
    if unreadable:
        print(f"warning: {path}: dropped {unreadable} unreadable line(s)", file=sys.stderr)
    write_text_atomic(path, "".join(line + "\n" for line in kept))  # also ends a torn last line


# ---------------------------------------------------------------------------------------------
# The training loop
# ---------------------------------------------------------------------------------------------


def batch_on(mesh, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """A training batch on the default device, or on `mesh`: rows split over dp when dp divides
    them, else replicated."""
    if mesh is None:
        return {k: jnp.asarray(v) for k, v in batch.items()}
    rows = next(iter(batch.values())).shape[0]
    sharding = rows_sharding(mesh) if rows % mesh.shape["dp"] == 0 else replicated(mesh)
    return {k: put(v, sharding) for k, v in batch.items()}


def train(head_cfg, target_params, data: Sequences, tc: TrainConfig, out_dir: str | Path, *,
          consts: dict | None = None, resume: bool = False, stop_after: int | None = None,
          progress: bool = True, mesh=None, init_variables: dict | None = None
          ) -> tuple[TrainState, list[dict]]:
    """Trains a head for `tc.steps` steps; checkpoints into out_dir; returns (state, log rows).

    mesh: a `jax.sharding.Mesh` (axes dp, tp) that target_params are placed on
    (`specjax.sharding`): the head's state is placed by the same rules (small leaves
    replicated), each batch's rows are split over dp when dp divides them; GSPMD partitions the
    one train step (the gradients' sum over dp included). None: one device.

    resume: continue from the latest checkpoint in out_dir (a fresh start when there is none).
    stop_after: stop (as if killed) once this many steps are done -- for tests.
    init_variables: head variables a fresh run starts from (`load_init`; ignored when resuming from a
    checkpoint); default: a random head (`init_train_state`).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    mngr = checkpoint_manager(out_dir, tc)
    state = shard_params(init_train_state(head_cfg, tc, consts, target_params, init_variables), mesh)
    if resume and mngr.latest_step() is not None:
        state = restore_state(mngr, state)
    elif mngr.latest_step() is not None:
        raise ValueError(f"{out_dir} already holds checkpoints: pass resume=True (--resume) "
                         "or use an empty folder")
    write_description(out_dir, head_cfg, tc, data.meta)
    start = int(state.step)
    keep_metrics_until(out_dir / "metrics.jsonl", start)
    end = tc.steps if stop_after is None else min(tc.steps, stop_after)
    log: list[dict] = []
    tokens_start = tokens_before(data, tc.batch_size, tc.seed, start)
    tokens_done, t0 = tokens_start, time.perf_counter()
    bar = progress_bar(range(start, end), initial=start, total=tc.steps,
                       desc=f"train {head_cfg.kind}", unit="step", enabled=progress)
    with open(out_dir / "metrics.jsonl", "a") as metrics_file:
        for step in bar:
            batch = batch_on(mesh, get_batch(data, tc.batch_size, tc.seed, step))
            state, metrics = train_step(head_cfg, tc, state, target_params, batch,
                                        step_key(tc.seed, step))
            tokens_done += int(np.sum(batch["lengths"]))
            save_state(mngr, state)
            if (step + 1) % tc.log_every == 0 or step + 1 == end:
                row = {"step": step + 1, **{k: float(v) for k, v in jax.device_get(metrics).items()},
                       "tokens": tokens_done, "elapsed_s": time.perf_counter() - t0}
                log.append(row)
                metrics_file.write(json.dumps(row) + "\n")
                metrics_file.flush()
                rate = (tokens_done - tokens_start) / max(row["elapsed_s"], 1e-9)
                bar.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{rate:.0f}")
    bar.close()
    if int(state.step) == tc.steps and mngr.latest_step() != tc.steps:
        save_state(mngr, state, force=True)
    mngr.wait_until_finished()
    mngr.close()
    return state, log


# ---------------------------------------------------------------------------------------------
# End to end: data from the target, then training (the `specjax train-drafter` command)
# ---------------------------------------------------------------------------------------------


DATA_DIR = "data"
#: where the data is generated and checked before its rename to OUT/data
STAGING_DIR = ".data.partial"


def distill_request(target_name: str, prompts: list[list[int]], *, seq_len: int,
                    max_new_tokens: int, temperature: float, seed: int) -> dict:
    """What decides the self-distilled data (stored in its meta.json and compared on reuse)."""
    ids = json.dumps([[int(t) for t in p] for p in prompts]).encode()
    return {"generated_by": target_name, "seq_len": seq_len, "max_new_tokens": max_new_tokens,
            "temperature": temperature, "seed": seed,
            "prompts_sha256": hashlib.sha256(ids).hexdigest()}


def request_mismatches(meta: dict, request: dict) -> list[str]:
    """'key: stored -> requested' for each key the stored meta records with another value."""
    return [f"{k}: {meta[k]!r} -> {v!r}" for k, v in request.items() if k in meta and meta[k] != v]


def check_distilled(data: Sequences, vocab_size: int, where: Path) -> None:
    """Token ids in range and at least one response token to learn from."""
    if data.tokens.min() < 0 or data.tokens.max() >= vocab_size:
        raise ValueError(f"{where}: token ids outside [0, {vocab_size}); nothing saved")
    if not response_mask(data.lengths, data.prompt_lens, data.seq_len).any():
        raise ValueError(f"{where}: no response tokens (the target ended every prompt at once, "
                         "or --seq-len leaves no room after the prompts); nothing saved")


def reuse_data(folder: Path, request: dict) -> Sequences:
    data = Sequences.load(folder)
    changed = request_mismatches(data.meta, request)
    if changed:
        raise ValueError(f"{folder / 'meta.json'}: the data was made with other options "
                         f"({'; '.join(changed)}): rerun with the same options or another --out")
    return data


def prepare_data(target, prompts: list[list[int]], out_dir: Path, *, seq_len: int,
                 max_new_tokens: int, temperature: float, seed: int, batch_size: int,
                 progress: bool = True, mesh=None) -> Sequences:
    """OUT/data if it exists (a resumed run reuses its data; it must have been made with the
    same prompts and options), else the target's continuations of `prompts` (token ids),
    generated, saved and checked in OUT/.data.partial, then renamed to OUT/data: a failed or
    killed run leaves no folder a later run could take for finished data."""
    out_dir = Path(out_dir)
    folder, staging = out_dir / DATA_DIR, out_dir / STAGING_DIR
    request = distill_request(target.cfg.name, prompts, seq_len=seq_len,
                              max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    if (folder / "meta.json").exists():
        return reuse_data(folder, request)
    if folder.exists():  # only an older version writes OUT/data in place: never complete here
        print(f"{folder}: incomplete (no meta.json), generating it again", file=sys.stderr)
        shutil.rmtree(folder)
    shutil.rmtree(staging, ignore_errors=True)
    if progress:
        print(f"self-distillation: {len(prompts)} prompts, {max_new_tokens} new tokens each",
              file=sys.stderr)
    try:
        with progress_bar(total=len(prompts), desc="self-distillation", unit="prompt",
                          enabled=progress) as bar:
            data = training_data.self_distill(
                target.cfg, target.params, prompts, max_new_tokens=max_new_tokens, seq_len=seq_len,
                temperature=temperature, seed=seed, batch_size=batch_size, on_batch=bar.update,
                mesh=mesh)
        dataclasses.replace(data, meta={**data.meta, **request}).save(staging)
        data = Sequences.load(staging)
        check_distilled(data, target.cfg.vocab_size, folder)
        os.replace(staging, folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return data


def load_init(folder: str | Path, kind: str, target_cfg, head_options: dict | None = None):
    """(head config, variables) of the trained drafter in `folder` to start a new run from
    (`train-drafter --init-from`, e.g. to realign a drafter after its target was fine-tuned).

    The head config is the old drafter's, for target_cfg; head_options, when given, must agree
    with it. A missing folder, another kind, a target of other shapes or a head of other shapes
    -> one-line ValueError naming the folder."""
    folder = Path(folder)
    problem = checkpoint.trained_folder_problem(folder)
    if problem:
        raise ValueError(f"{folder}: {problem}")
    desc, head_cfg = checkpoint.read_description(folder, target_cfg)
    if desc["kind"] != kind:
        raise ValueError(f"{folder} holds a {desc['kind']} drafter, not {kind}")
    old_target = checkpoint.described_target(folder)
    if old_target is not None:
        for field in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                      "head_dim"):
            if getattr(old_target, field) != getattr(target_cfg, field):
                raise ValueError(f"{folder}: trained for a target with {field}="
                                 f"{getattr(old_target, field)}, this target has "
                                 f"{getattr(target_cfg, field)}")
    if head_options:
        wanted = make_head_config(kind, target_cfg, **head_options)
        differ = [f.name for f in dataclasses.fields(wanted)
                  if getattr(wanted, f.name) != getattr(head_cfg, f.name)]
        if differ:
            raise ValueError(f"{folder}: its {kind} head has other "
                             + ", ".join(f"{n}={getattr(head_cfg, n)!r} (asked {getattr(wanted, n)!r})"
                                         for n in differ))
    try:
        _, variables = checkpoint.load_trained(folder, target_cfg)
    except (OSError, KeyError, TypeError, RuntimeError) as e:  # orbax: stored arrays of other shapes than the head config's
        raise ValueError(f"{folder}: its checkpoint does not fit its {kind} head config "
                         f"({type(e).__name__})") from None
    try:
        check_shapes(head_cfg, variables)
    except ValueError as e:
        raise ValueError(f"{folder}: {e}") from None
    return head_cfg, variables


def train_drafter(target, kind: str, data: Sequences, out_dir: str | Path, tc: TrainConfig, *,
                  head_options: dict | None = None, resume: bool = False, progress: bool = True,
                  stop_after: int | None = None, mesh=None, init_from: str | Path | None = None):
    """Builds the head of `kind` for the loaded target (cfg, params) and trains it on `data`.

    On resume the head config comes from OUT/drafter.json (head_options are ignored).
    Non-trained head constants come from the data (the kind's `consts_from_data`: EAGLE-3's
    reduced vocabulary is the data's most frequent response tokens).
    init_from: a trained drafter folder of the same kind to start from (`load_init`: its head
    config, params and consts; a run resumed from its own checkpoint ignores it).
    """
    out_dir = Path(out_dir)
    described = out_dir / checkpoint.DESCRIPTION
    start = None
    if init_from is not None:
        head_cfg, start = load_init(init_from, kind, target.cfg, head_options)
    if resume and described.exists():
        desc, head_cfg, _tc = read_description(out_dir, target.cfg)
        if desc["kind"] != kind:
            raise ValueError(f"{out_dir} holds a {desc['kind']} drafter, not {kind}")
    elif start is None:
        head_cfg = make_head_config(kind, target.cfg, **(head_options or {}))
    from_data = kind_of(head_cfg).consts_from_data
    consts = from_data(head_cfg, response_tokens(data)) if from_data and start is None else None
    return train(head_cfg, target.params, data, tc, out_dir, consts=consts, resume=resume,
                 progress=progress, stop_after=stop_after, mesh=mesh, init_variables=start)
