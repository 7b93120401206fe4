"""Compile time of each decoding program: plain (AR) and speculative per drafter, chain and tree,
batch 1 and 8.

    python benchmarks/compile_time.py [--model smollm2-135m] [--batches 1 8]
        [--drafts ngram suffix layerskip:4 model:smollm2-135m eagle3 mtp medusa dflash dspark]
        [--trees chain4 eagle_small] [--prompt-width 64] [--max-new 128] [--repeat 1]
        [--out benchmarks/results/compile_time_cpu.json]

Each program goes through JAX's ahead-of-time path, `jitted.lower(*args)` then
`lowered.compile()`, timed apart, with the persistent compilation cache OFF and every
in-memory cache cleared before each program (`jax.clear_caches()`), so each number is a
first-time compile in a warm process. Arguments are shapes only (`jax.ShapeDtypeStruct`):
compilation does not read weights, so learned heads (`eagle3`, `mtp`, ... without a folder)
get the shapes of their records' random init and nothing is computed.

Per program it records lower and compile seconds, the ratio of the compile time to the AR
program's of the same batch, and the size of what was compiled: characters and operations of
the lowered StableHLO (`lowered.as_text()`), its `while` loops, the bytes of the constants
folded into it, and the instructions of the optimised HLO. With `--repeat N` the programs take
turns N times (in rotating order) and the medians are reported, so drift of a shared machine
hits them alike.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import re
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specjax.api import bucket, draft_margin
from specjax.loop import StopCriteria, generate_program, spec_generate_program
from specjax.sampling import SamplingParams
from specjax.target import as_target
from specjax.tree import TreeSpec, load_tree

DEFAULT_DRAFTS = ("ngram", "suffix", "layerskip:4", "model:smollm2-135m",
                  "eagle3", "mtp", "medusa", "dflash", "dspark")
DEFAULT_TREES = ("chain4", "eagle_small")
RESULTS = Path(__file__).resolve().parent / "results"


@dataclasses.dataclass(frozen=True)
class Program:
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
    from specjax.drafters.learned.drafting import drafter_params
    from specjax.drafters.learned.registry import (
        get_kind,
        init_head,
        make_head_config,
        make_learned_drafter,
    )

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
    return drafter, drafter_params(variables, params, head_cfg)


def build_drafter(draft: str, tree: TreeSpec, model, loader):
    """(drafter, drafter params) of a spec; a learned kind without `:DIR` gets random weights."""
    from specjax.drafters.learned.registry import KINDS
    from specjax.drafters.registry import make_drafter

    if draft in KINDS:
        return learned_drafter(draft, tree, model.cfg, model.params)
    return make_drafter(draft, tree=tree, target=model, loader=loader)


def program_call(model, program: Program, drafter=None, drafter_params=None, *,
                 prompt_width: int = 64, max_new: int = 128):
    """(jitted function, args, kwargs) exactly as `api.run_batch` calls it, as shapes."""
    target, batch = as_target(model.cfg), program.batch
    prompt_width = bucket(prompt_width)
    width = prompt_width + bucket(max_new) + draft_margin(None if drafter is None else drafter.tree)
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
    args = (i32(batch, prompt_width), i32(batch), i32(batch),
            shapes(jax.eval_shape(lambda: target.init_cache(batch, width))),
            jax.ShapeDtypeStruct((batch, 2), jnp.uint32),
            shapes(SamplingParams.make()), shapes(StopCriteria.make(model.cfg.eos_token_ids)))
    params = abstract_params(model.params)
    if drafter is None:
        return generate_program, (target, params) + args, {"width": width}
    carry = shapes(jax.eval_shape(lambda: drafter.init_carry(drafter_params)))
    return (spec_generate_program, (target, params, drafter, abstract_params(drafter_params))
            + args + (carry,), {"width": width})


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


def measure(fn, args, kwargs) -> dict:
    """Lower and compile once from cold in-memory caches: seconds and sizes."""
    jax.clear_caches()
    start = time.perf_counter()
    lowered = fn.lower(*args, **kwargs)
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    done = time.perf_counter()
    return {"lower_s": lowered_at - start, "compile_s": done - lowered_at, **hlo_stats(lowered, compiled)}


def disable_persistent_cache() -> None:
    jax.config.update("jax_enable_compilation_cache", False)
    jax.config.update("jax_compilation_cache_dir", None)


def warm_up() -> None:
    """One small compile, so the first program does not pay the compiler's start-up."""
    jax.jit(lambda x: jnp.tanh(x @ x).sum()).lower(jnp.ones((8, 8))).compile()


def programs(batches, drafts, trees) -> list[Program]:
    out = []
    for batch in batches:
        out.append(Program(batch))
        out += [Program(batch, d, t) for d in drafts for t in trees]
    return out


def run(model, progs: list[Program], *, repeat: int = 1, prompt_width: int = 64, max_new: int = 128,
        loader=None, log=print) -> list[dict]:
    """One record per program (medians over `repeat` rotating rounds)."""
    disable_persistent_cache()
    warm_up()
    calls = {}
    for prog in progs:
        drafter = drafter_params = None
        if prog.draft is not None:
            drafter, drafter_params = build_drafter(prog.draft, load_tree(prog.tree), model, loader)
        calls[prog] = program_call(model, prog, drafter, drafter_params,
                                   prompt_width=prompt_width, max_new=max_new)
    samples: dict[Program, list[dict]] = {p: [] for p in progs}
    for r in range(repeat):
        shift = r % len(progs)
        for prog in progs[shift:] + progs[:shift]:
            samples[prog].append(measure(*calls[prog]))
            last = samples[prog][-1]
            log(f"  [{r + 1}/{repeat}] B={prog.batch} {prog.label}: lower {last['lower_s']:.2f} s, "
                f"compile {last['compile_s']:.2f} s, {last['hlo_ops']} ops, {last['kernels']} kernels")
    records = []
    for prog in progs:
        runs = samples[prog]
        rec = {"batch": prog.batch, "draft": prog.draft or "ar", "tree": prog.tree, **runs[-1]}
        for key in ("lower_s", "compile_s"):
            rec[key] = statistics.median(s[key] for s in runs)
            rec[key + "_all"] = [round(s[key], 3) for s in runs]
        rec["total_s"] = rec["lower_s"] + rec["compile_s"]
        records.append(rec)
    ar = {r["batch"]: r["total_s"] for r in records if r["draft"] == "ar"}
    for rec in records:
        if rec["batch"] in ar:
            rec["x_ar"] = rec["total_s"] / ar[rec["batch"]]
    return records


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
    import os

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
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    from specjax.models.hub import load_model

    model = load_model(args.model)
    loaded = {args.model: model}

    def loader(name, dtype):
        if name not in loaded:
            loaded[name] = load_model(name, dtype)
        return loaded[name]

    progs = programs(args.batches, args.drafts, args.trees)
    records = run(model, progs, repeat=args.repeat, prompt_width=args.prompt_width,
                  max_new=args.max_new, loader=loader, log=lambda s: print(s, file=sys.stderr))
    print(table(records))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        report = {"date": datetime.date.today().isoformat(), "machine": machine(),
                  "model": args.model, "prompt_width": args.prompt_width, "max_new": args.max_new,
                  "repeat": args.repeat, "command": " ".join(["python", "benchmarks/compile_time.py"]
                                                             + (argv if argv is not None else sys.argv[1:])),
                  "programs": records}
        args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
