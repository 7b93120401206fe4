"""Compile time of each decoding program: plain (AR) and speculative per drafter, chain and tree,
batch 1 and 8.

    python benchmarks/compile_time.py [--model smollm2-135m] [--batches 1 8]
        [--drafts ngram suffix layerskip:4 model:smollm2-135m eagle3 mtp medusa dflash dspark]
        [--trees chain4 eagle_small] [--prompt-width 64] [--max-new 128] [--repeat 1]
        [--temperature 0] [--fused] [--baseline REV] [--out benchmarks/results/compile_time.json]

Each program goes through JAX's ahead-of-time path, `jitted.lower(*args)` then
`lowered.compile()`, timed apart, with the persistent compilation cache OFF and every
in-memory cache cleared before each program (`jax.clear_caches()`), so each number is a
first-time compile in a warm process. A "program" is what `api.run_batch` compiles for one
batch shape: the prefill program and the decode program (`--fused`: the one program of both),
summed. Arguments are shapes only (`jax.ShapeDtypeStruct`): compilation does not read
weights, so learned heads (`eagle3`, `mtp`, ... without a folder) get the shapes of their
records' random init and nothing is computed. `--trees auto` is `num_draft="auto"`'s program
(every branch of `auto_costs.auto_drafter` in one program; step costs as shapes, no profile
run). `--temperature 0` (the default) measures the
greedy programs, `> 0` the sampling ones (greedy or not is static, `SamplingParams.greedy`).

Per program it records lower and compile seconds and the size of what was compiled:
operations of the lowered StableHLO (`lowered.as_text()`), its `while` loops, the bytes of the
constants folded into it, the instructions of the optimised HLO, and its kernels (optimised
instructions that run as a kernel of their own: XLA CPU's default compiles each distinct one
as its own MLIR + LLVM module, most of the time; specjax's programs emit them into the
program's one LLVM module, `xla_options`, whose codegen is then most of it). Every speculative
compile runs between two AR compiles of its batch and its "x AR" is the median over rounds
of its time over theirs, so drift of a shared machine cancels; `--repeat N` runs N rounds in
rotating order and reports medians.

`--baseline REV` compiles every program twice, with specjax as of git revision REV ("before",
a snapshot on PYTHONPATH) and as in this working tree ("after"), in two worker processes that
take turns compile by compile, and adds a before/after table.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specjax.api import bucket, draft_margin
from specjax.drafters.learned.drafting import drafter_params as head_params
from specjax.drafters.learned.registry import (
    KINDS,
    get_kind,
    init_head,
    make_head_config,
    make_learned_drafter,
)
from specjax.drafters.registry import make_drafter
from specjax.loop import (
    StopCriteria,
    ar_finish_program,
    ar_start_program,
    generate_program,
    spec_finish_program,
    spec_generate_program,
    spec_start_program,
)
from specjax.models.hub import load_model
from specjax.sampling import SamplingParams
from specjax.target import as_target
from specjax.tree import TreeSpec, chain, load_tree

DEFAULT_DRAFTS = ("ngram", "suffix", "layerskip:4", "model:smollm2-135m",
                  "eagle3", "mtp", "medusa", "dflash", "dspark")
DEFAULT_TREES = ("chain4", "eagle_small")
#: the `--trees` name of auto's program (`num_draft="auto"`: every branch in one program)
AUTO = "auto"
RESULTS = Path(__file__).resolve().parent / "results"


class Program(NamedTuple):
    """One program to compile: `draft` None = plain decoding (AR)."""

    batch: int
    draft: str | None = None
    tree: str | None = None

    @property
    def label(self) -> str:
        return "ar" if self.draft is None else f"{self.draft} {self.tree}"


def shapes(tree):
    """The pytree as `jax.ShapeDtypeStruct`s (what `lower` needs; no data)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), tree)


def abstract_params(params):
    return shapes(params) if params is not None else None


def learned_drafter(kind: str, tree: TreeSpec, cfg, params):
    """(drafter, abstract params) of a learned head of `kind` with its record's random init (a
    head whose default depth is shallower than the tree gets its `--depth` option = the tree's)."""
    head_cfg = make_head_config(kind, cfg)
    try:
        drafter = make_learned_drafter(head_cfg, tree)
    except ValueError:
        depth = [o.field for o in get_kind(kind).options if o.flag == "depth"]
        if not depth:
            raise
        head_cfg = make_head_config(kind, cfg, **{depth[0]: tree.max_depth})
        drafter = make_learned_drafter(head_cfg, tree)
    variables = jax.eval_shape(lambda: init_head(head_cfg, jax.random.PRNGKey(0)))
    return drafter, head_params(variables, params, head_cfg)


def build_drafter(draft: str, tree: TreeSpec, model, loader):
    """(drafter, drafter params) of a spec; a learned kind without `:DIR` gets random weights."""
    if draft in KINDS:
        return learned_drafter(draft, tree, model.cfg, model.params)
    return make_drafter(draft, tree=tree, target=model, loader=loader)


def build_auto(draft: str, model, loader):
    """(AutoDrafter, abstract AutoParams) of `num_draft="auto"` over the drafter of `draft`:
    the branches `auto_costs.auto_drafter` compiles (the plain step and `auto_lengths` chains
    up to what the drafter can draft), step costs as shapes (compiling reads no cost)."""
    # here, not at the top: `--baseline REV` imports this module with older specjax revisions
    from specjax.drafters.auto import AutoDrafter, AutoParams, auto_lengths, auto_max_draft

    probe, _ = build_drafter(draft, chain(1), model, loader)
    deepest = auto_max_draft(probe)
    inner, inner_params = build_drafter(draft, chain(deepest), model, loader)
    auto = AutoDrafter.wrap(inner, auto_lengths(getattr(model.cfg, "group_size", None), deepest))
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    return auto, AutoParams(inner_params, f32(2, auto.num_shapes), f32(2))


def drafter_of(prog: Program, model, loader):
    """(drafter, drafter params) a program compiles: `--trees auto` is auto's program."""
    if prog.tree == AUTO:
        return build_auto(prog.draft, model, loader)
    return build_drafter(prog.draft, load_tree(prog.tree), model, loader)


def program_call(model, program: Program, drafter=None, drafter_params=None, *,
                 prompt_width: int = 64, max_new: int = 128, temperature: float = 0.0,
                 fused: bool = False) -> list:
    """The stages to compile, as `api.run_batch` calls them, with shapes for arguments: the
    prefill program then the decode program (`loop.ar_start_program` / `ar_finish_program`, or
    the spec pair), or with `fused` the one program of both (`generate_program` /
    `spec_generate_program`). A stage is (jitted function, args, kwargs), or a function of the
    previous stage's `Lowered.out_info` that returns one."""
    target, batch = as_target(model.cfg), program.batch
    prompt_width = bucket(prompt_width)
    width = prompt_width + bucket(max_new) + draft_margin(None if drafter is None else drafter.tree)
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
    args = (i32(batch, prompt_width), i32(batch), i32(batch),
            shapes(jax.eval_shape(lambda: target.init_cache(batch, width))),
            jax.ShapeDtypeStruct((batch, 2), jnp.uint32),
            shapes(SamplingParams.make(temperature)),
            shapes(StopCriteria.make(model.cfg.eos_token_ids)))
    params = abstract_params(model.params)
    sampling, criteria = args[-2:]
    if drafter is None:
        if fused:
            return [(generate_program, (target, params) + args, {"width": width})]
        return [(ar_start_program, (target, params) + args, {"width": width}),
                lambda state: (ar_finish_program, (target, params, state, sampling, criteria), {})]
    head = (target, params, drafter, abstract_params(drafter_params))
    carry = shapes(jax.eval_shape(lambda: drafter.init_carry(drafter_params)))
    if fused:
        return [(spec_generate_program, head + args + (carry,), {"width": width})]
    return [(spec_start_program, head + args + (carry,), {"width": width}),
            lambda started: (spec_finish_program, head + (started, sampling, criteria), {})]


_OP = re.compile(r"=\s*\"?([a-z_]+\.[a-z_.]+)")
_CONST = re.compile(r"stablehlo\.constant dense<(.*?)> : tensor<([0-9x]*)x?([a-z0-9]+)>")


_TRIVIAL = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "while",
            "conditional", "call", "after-all", "opt-barrier"}


def kernel_count(optimised: str) -> int:
    """Instructions of the optimised HLO that become a kernel of their own (fusions, copies,
    sorts, ...; not those inside a fused computation): on CPU each is compiled on its own
    (MLIR + LLVM), which is most of the compile time."""
    fused = set(re.findall(r"(?:calls|to_apply)=%([\w.\-]+)", optimised))
    count, computation = 0, None
    for line in optimised.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            name = re.match(r"(?:ENTRY )?%?([\w.\-]+)", line)
            computation = name.group(1) if name else None
            continue
        op = re.match(r"\s*(?:ROOT )?%[\w.\-]+ = .*? ([a-z][\w\-]*)\(", line)
        if computation and computation not in fused and op and op.group(1) not in _TRIVIAL:
            count += 1
    return count


def hlo_stats(lowered, compiled) -> dict:
    """Sizes of the lowered StableHLO and the optimised HLO."""
    text = lowered.as_text()
    ops = Counter(_OP.findall(text))
    const_bytes = 0
    for _, dims, dtype in _CONST.findall(text):
        count = int(np.prod([int(d) for d in dims.split("x") if d])) if dims else 1
        bits = int(re.sub(r"\D", "", dtype) or 8)
        const_bytes += count * max(bits, 8) // 8
    optimised = compiled.as_text() or ""
    return {
        "hlo_chars": len(text),
        "hlo_ops": sum(ops.values()),
        "while_ops": ops.get("stablehlo.while", 0),
        "const_bytes": const_bytes,
        "top_ops": dict(ops.most_common(8)),
        "opt_hlo_instructions": sum(1 for line in optimised.splitlines() if " = " in line),
        "kernels": kernel_count(optimised),
    }


def measure(stages: list) -> dict:
    """Lower and compile the stages (`program_call`) once from cold in-memory caches: seconds
    and sizes, summed over the stages (and each stage's under "stages")."""
    jax.clear_caches()
    out, lowered = [], None
    for stage in stages:
        fn, args, kwargs = stage(lowered.out_info) if callable(stage) else stage
        start = time.perf_counter()
        lowered = fn.lower(*args, **kwargs)
        lowered_at = time.perf_counter()
        compiled = lowered.compile()
        done = time.perf_counter()
        out.append({"lower_s": lowered_at - start, "compile_s": done - lowered_at,
                    **hlo_stats(lowered, compiled)})
    total = {key: sum(m[key] for m in out) for key in out[0] if key != "top_ops"}
    total["top_ops"] = dict(sum((Counter(m["top_ops"]) for m in out), Counter()).most_common(8))
    if len(out) > 1:
        total["stages"] = [{k: m[k] for k in ("lower_s", "compile_s", "hlo_ops", "kernels")}
                           for m in out]
    return total


@contextlib.contextmanager
def persistent_cache_off():
    """JAX's persistent compilation cache off (specjax turns it on for the CLI and the API),
    restored afterwards.

    jax decides once per process whether the cache is used (`compilation_cache.is_cache_used`
    memoizes its answer), so in a process that already used the cache the config flag alone
    changes nothing and a compile here would be a cache hit. That decision is set to "not
    used" for the block and put back after it."""
    before = jax.config.jax_enable_compilation_cache
    decided = _cache_decision()
    jax.config.update("jax_enable_compilation_cache", False)
    _set_cache_decision((True, False))
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", before)
        _set_cache_decision(decided)


def _cache_decision():
    """(checked, used): jax's memoized answer to "is the persistent cache used in this process"
    (private module state; None where a jax version keeps it elsewhere)."""
    from jax._src import compilation_cache as cc
    if not (hasattr(cc, "_cache_checked") and hasattr(cc, "_cache_used")):
        return None
    return cc._cache_checked, cc._cache_used


def _set_cache_decision(decision) -> None:
    from jax._src import compilation_cache as cc
    if decision is not None and _cache_decision() is not None:
        with getattr(cc, "_cache_initialized_mutex", contextlib.nullcontext()):
            cc._cache_checked, cc._cache_used = decision


def warm_up() -> None:
    """One small compile, so the first program does not pay the compiler's start-up."""
    jax.jit(lambda x: jnp.tanh(x @ x).sum()).lower(jnp.ones((8, 8))).compile()


def programs(batches, drafts, trees) -> list[Program]:
    out = []
    for batch in batches:
        out.append(Program(batch))
        out += [Program(batch, d, t) for d in drafts for t in trees]
    return out


class Measurer:
    """Compiles programs of one model in this process (`measure`), arguments built once each."""

    def __init__(self, model, *, prompt_width: int = 64, max_new: int = 128,
                 temperature: float = 0.0, fused: bool = False, loader=None):
        self.model, self.loader = model, loader
        self.options = {"prompt_width": prompt_width, "max_new": max_new,
                        "temperature": temperature, "fused": fused}
        self.calls: dict[Program, tuple] = {}

    def __call__(self, prog: Program) -> dict:
        if prog not in self.calls:
            drafter = drafter_params = None
            if prog.draft is not None:
                drafter, drafter_params = drafter_of(prog, self.model, self.loader)
            self.calls[prog] = program_call(self.model, prog, drafter, drafter_params,
                                            **self.options)
        return measure(self.calls[prog])


def timeline(progs: list[Program], repeat: int) -> list[Program]:
    """The order of the compiles: per round, the speculative programs in rotating order, each
    right after an AR program of its batch, and one more AR per batch to close the round, so
    every speculative compile has an AR compile of its batch on both sides (its ratio to AR
    sees the machine as it was then)."""
    ar = {p.batch: p for p in progs if p.draft is None}
    spec = [p for p in progs if p.draft is not None]
    order = []
    for r in range(repeat):
        shift = r % len(spec) if spec else 0
        for prog in spec[shift:] + spec[:shift]:
            order += [ar[prog.batch], prog] if prog.batch in ar else [prog]
        order += list(ar.values())
    return order


def summarise(progs: list[Program], events: list[tuple[Program, dict]]) -> list[dict]:
    """One record per program from the compiles `events` (in time order): medians of the
    seconds, and x_ar = the median over its compiles of total / (the mean of the AR compiles of
    its batch just before and just after it)."""
    total = lambda m: m["lower_s"] + m["compile_s"]
    records = []
    for prog in progs:
        mine = [(i, m) for i, (p, m) in enumerate(events) if p == prog]
        if not mine:
            continue
        rec = {"batch": prog.batch, "draft": prog.draft or "ar", "tree": prog.tree, **mine[-1][1]}
        for key in ("lower_s", "compile_s"):
            rec[key] = statistics.median(m[key] for _, m in mine)
            rec[key + "_all"] = [round(m[key], 3) for _, m in mine]
        rec["total_s"] = statistics.median(total(m) for _, m in mine)
        ratios = []
        for i, m in mine:
            ars = [j for j, (p, _) in enumerate(events) if p.draft is None and p.batch == prog.batch]
            near = [max((j for j in ars if j < i), default=None),
                    min((j for j in ars if j > i), default=None)]
            near = [total(events[j][1]) for j in near if j is not None]
            if near:
                ratios.append(total(m) / statistics.mean(near))
        if prog.draft is None:
            rec["x_ar"] = 1.0
        elif ratios:
            rec["x_ar"] = statistics.median(ratios)
            rec["x_ar_all"] = [round(x, 3) for x in ratios]
        records.append(rec)
    return records


def run(model, progs: list[Program], *, repeat: int = 1, prompt_width: int = 64, max_new: int = 128,
        temperature: float = 0.0, fused: bool = False, loader=None, log=print) -> list[dict]:
    """One record per program (`summarise`), compiled in this process in `timeline` order."""
    with persistent_cache_off():
        warm_up()
        measurer = Measurer(model, prompt_width=prompt_width, max_new=max_new,
                            temperature=temperature, fused=fused, loader=loader)
        events = []
        for prog in timeline(progs, repeat):
            events.append((prog, measurer(prog)))
            log(describe(prog, events[-1][1]))
    return summarise(progs, events)


def describe(prog: Program, m: dict, side: str = "") -> str:
    return (f"  {side}B={prog.batch} {prog.label}: lower {m['lower_s']:.2f} s, compile "
            f"{m['compile_s']:.2f} s, {m['hlo_ops']} ops, {m['kernels']} kernels")


# ---- before/after: two source trees compiling side by side -----------------------------------

#: where setuptools takes the packages from (pyproject.toml, [tool.setuptools.package-dir])
PACKAGE_DIRS = {"specjax": "specjax", "specjax/models": "models", "specjax/kernels": "kernels",
                "specjax/configs": "configs"}


def snapshot(rev: str, repo: Path) -> Path:
    """A folder to put on PYTHONPATH that imports specjax as it was at git revision `rev`."""
    out = Path(tempfile.mkdtemp(prefix="specjax-compile-time-"))
    archive = subprocess.run(["git", "-C", str(repo), "archive", rev], check=True,
                             capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(out / "src", filter="data")
    for package, folder in PACKAGE_DIRS.items():
        shutil.copytree(out / "src" / folder, out / "pkg" / package)
    return out / "pkg"


class Worker:
    """This script in `--worker` mode in a subprocess (PYTHONPATH first: another specjax)."""

    def __init__(self, args: list[str], pythonpath: Path | None = None):
        env = dict(os.environ)
        if pythonpath is not None:
            env["PYTHONPATH"] = os.pathsep.join([str(pythonpath)] + [env.get("PYTHONPATH", "")])
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", *args], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.ask({"ping": True})

    def ask(self, request: dict) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"compile_time worker exited with {self.proc.wait()}")
        return json.loads(line)

    def __call__(self, prog: Program) -> dict:
        return self.ask(prog._asdict())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def serve(measurer: Measurer) -> None:
    """Worker mode: one JSON program per stdin line -> one JSON measurement per stdout line."""
    out = sys.stdout
    sys.stdout = sys.stderr  # anything else printed goes to stderr
    with persistent_cache_off():
        warm_up()
        for line in sys.stdin:
            request = json.loads(line)
            reply = {} if "ping" in request else measurer(Program(**request))
            out.write(json.dumps(reply) + "\n")
            out.flush()


def compare(progs: list[Program], sides: dict, repeat: int, log=print) -> dict[str, list[dict]]:
    """{side: records}: every compile of `timeline` runs on each side in turn (which side goes
    first alternates), so both face the same machine."""
    events = {name: [] for name in sides}
    names = list(sides)
    for i, prog in enumerate(timeline(progs, repeat)):
        for name in names[i % 2:] + names[: i % 2]:
            events[name].append((prog, sides[name](prog)))
            log(describe(prog, events[name][-1][1], f"{name}: "))
    return {name: summarise(progs, ev) for name, ev in events.items()}


def comparison_table(before: list[dict], after: list[dict]) -> str:
    head = ("| B | program | tree | before s | after s | after/before | before x AR | "
            "after x AR | kernels before -> after |")
    lines = [head, "|---" * 9 + "|"]
    for b, a in zip(before, after):
        lines.append(
            f"| {a['batch']} | {a['draft']} | {a['tree'] or '-'} | {b['total_s']:.2f} | "
            f"{a['total_s']:.2f} | {a['total_s'] / b['total_s']:.2f} | {b['x_ar']:.2f} | "
            f"{a['x_ar']:.2f} | {b['kernels']} -> {a['kernels']} |")
    return "\n".join(lines)


def table(records: list[dict]) -> str:
    head = ("| B | program | tree | lower s | compile s | total s | x AR | HLO ops | while | "
            "const KB | opt HLO instr | kernels |")
    lines = [head, "|---" * 12 + "|"]
    for r in records:
        lines.append(
            f"| {r['batch']} | {r['draft']} | {r['tree'] or '-'} | {r['lower_s']:.2f} | "
            f"{r['compile_s']:.2f} | {r['total_s']:.2f} | {r.get('x_ar', float('nan')):.2f} | "
            f"{r['hlo_ops']} | {r['while_ops']} | {r['const_bytes'] / 1024:.0f} | "
            f"{r['opt_hlo_instructions']} | {r['kernels']} |"
        )
    return "\n".join(lines)


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"backend": jax.default_backend(), "cpu": cpu, "cores": os.cpu_count(),
            "jax": jax.__version__, "python": platform.python_version()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--drafts", nargs="+", default=list(DEFAULT_DRAFTS))
    parser.add_argument("--trees", nargs="+", default=list(DEFAULT_TREES))
    parser.add_argument("--prompt-width", type=int, default=64)
    parser.add_argument("--max-new", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: the greedy programs (the default run), > 0: the sampling ones")
    parser.add_argument("--fused", action="store_true",
                        help="compile the one program of prefill + decode per batch instead of "
                             "the prefill and decode programs the API runs")
    parser.add_argument("--baseline", metavar="REV", default=None,
                        help="also compile every program with specjax as of git revision REV, "
                             "side by side (two worker processes taking turns)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv

    model_args = ["--model", args.model, "--prompt-width", str(args.prompt_width),
                  "--max-new", str(args.max_new), "--temperature", str(args.temperature)]
    model_args += ["--fused"] if args.fused else []
    log = lambda s: print(s, file=sys.stderr, flush=True)
    progs = programs(args.batches, args.drafts, args.trees)
    report = {"date": datetime.date.today().isoformat(), "machine": machine(),
              "model": args.model, "prompt_width": args.prompt_width, "max_new": args.max_new,
              "temperature": args.temperature, "fused": args.fused, "repeat": args.repeat,
              "command": " ".join(["python", "benchmarks/compile_time.py", *argv])}
    if args.baseline:
        repo = Path(__file__).resolve().parents[1]
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True).stdout.strip()
        sides = {"before": Worker(model_args, snapshot(args.baseline, repo)),
                 "after": Worker(model_args)}
        try:
            results = compare(progs, sides, args.repeat, log=log)
        finally:
            for worker in sides.values():
                worker.close()
        for name, records in results.items():
            print(f"\n{name}:\n{table(records)}")
        print(f"\n{comparison_table(results['before'], results['after'])}")
        report["sides"] = {"before": {"source": f"git {args.baseline}", "programs": results["before"]},
                           "after": {"source": f"working tree at {head}",
                                     "programs": results["after"]}}
    else:
        model = load_model(args.model)
        loaded = {args.model: model}

        def loader(name, dtype):
            if name not in loaded:
                loaded[name] = load_model(name, dtype)
            return loaded[name]

        if args.worker:
            serve(Measurer(model, prompt_width=args.prompt_width, max_new=args.max_new,
                           temperature=args.temperature, fused=args.fused, loader=loader))
            return 0
        records = run(model, progs, repeat=args.repeat, prompt_width=args.prompt_width,
                      max_new=args.max_new, temperature=args.temperature, fused=args.fused,
                      loader=loader, log=log)
        print(table(records))
        report["programs"] = records
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
