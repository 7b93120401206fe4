"""Where a program's compile goes on XLA CPU: its phases and how many kernels it compiles.

    python benchmarks/compile_trace.py [--batch 1] [--programs ar ngram/chain4 ngram/auto]
        [--stage decode|prefill] [--option xla_cpu_use_fusion_emitters=true]
        [--out benchmarks/results/compile_trace.json]

Each program (`compile_time.py`'s: `ar`, or `DRAFT/TREE` with TREE a preset or `auto`) is
lowered with shapes for arguments, then compiled once from cold in-memory caches (persistent
cache off) under `jax.profiler.trace`; from the trace it prints the compile's seconds, XLA's
phases (the HLO passes, the thunk emitter, the LLVM codegen of the whole module) and
`FusionCompiler::Compile`: the fusions XLA compiled, each once however many instructions of
the optimised HLO run it (`kernels`, `compile_time.kernel_count`). What a program costs to
compile follows the distinct fusions it compiles, not its instruction count: a copy of a block
(the same fusions at the same shapes) costs close to nothing.

That is XLA CPU's default. specjax's programs compile with `xla_cpu_use_fusion_emitters=False`
(`specjax.xla_options`): the fusions go into the program's one LLVM module instead, no
`FusionCompiler::Compile` runs ("fusions compiled" 0) and the module codegen holds the work.
`--option NAME=VALUE` (repeatable) compiles with XLA options on top of specjax's, e.g.
`--option xla_cpu_use_fusion_emitters=true` for XLA's default, to compare in one process.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import compile_time as bench

from specjax.models.hub import load_model

#: the trace events reported, as (label, event name)
PHASES = (("HLO passes", "HLO passes through layout assignment"),
          ("HLO passes after layout", "HLO passes after layout assignment"),
          ("thunk emitter", "ThunkEmitter"),
          ("module codegen (LLVM)", "JitCompiler::Compile"))


def parse_program(spec: str, batch: int) -> bench.Program:
    """`ar` or `DRAFT/TREE` -> the Program of `compile_time.py`."""
    return bench.Program(batch) if spec == "ar" else bench.Program(batch, *spec.split("/", 1))


def parse_option(item: str) -> tuple[str, bool | int | str]:
    """"NAME=VALUE" -> (NAME, VALUE): an XLA compile option, VALUE a bool (true / false), an
    int, or a string as given (an enum's name)."""
    name, sep, value = item.partition("=")
    if not (sep and name and value):
        raise SystemExit(f"--option {item!r}: expected NAME=VALUE")
    if value.lower() in ("true", "false"):
        return name, value.lower() == "true"
    return name, int(value) if value.lstrip("-").isdigit() else value


def trace_events(folder: Path) -> list[dict]:
    """The complete ('X') events of the one trace written under folder."""
    files = list(folder.rglob("*.trace.json.gz"))
    if len(files) != 1:
        raise RuntimeError(f"expected one trace under {folder}, found {len(files)}")
    with gzip.open(files[0]) as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "dur" in e]


def phases(events: list[dict]) -> dict:
    """Seconds of each of `PHASES` (the event's first prefix match, summed) and the fusions
    compiled: their count and summed seconds (over XLA's compile threads)."""
    out = {}
    for label, name in PHASES:
        out[label] = sum(e["dur"] for e in events if e["name"].startswith(name)) / 1e6
    fusions = [e for e in events if e["name"].startswith("FusionCompiler::Compile")]
    out["fusions compiled"] = len(fusions)
    out["fusion compile s (summed over threads)"] = sum(e["dur"] for e in fusions) / 1e6
    slowest = sorted(fusions, key=lambda e: -e["dur"])[:5]
    out["slowest fusions"] = {e.get("args", {}).get("module", "?"): round(e["dur"] / 1e3, 1)
                              for e in slowest}
    return out


def traced_compile(model, prog: bench.Program, stage: str, options: dict | None = None) -> dict:
    """Compile the program's `stage` once, traced, with XLA `options` on top of specjax's ->
    seconds, kernels and `phases`."""
    drafter = bench.drafter_of(prog, model, None) if prog.draft else (None, None)
    stages = bench.program_call(model, prog, *drafter)
    fn, args, kwargs = stages[0]
    lowered = fn.lower(*args, **kwargs)
    if stage == "decode":
        fn, args, kwargs = stages[1](lowered.out_info)
        lowered = fn.lower(*args, **kwargs)
    jax.clear_caches()
    with tempfile.TemporaryDirectory() as folder:
        with jax.profiler.trace(folder):
            begin = time.perf_counter()
            compiled = lowered.compile(compiler_options=options or None)
            seconds = time.perf_counter() - begin
        events = trace_events(Path(folder))
    return {"program": prog.label, "stage": stage, "options": options or {}, "compile_s": seconds,
            "kernels": bench.kernel_count(compiled.as_text() or ""), **phases(events)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--programs", nargs="+", default=["ar", "ngram/chain4", "ngram/auto"])
    parser.add_argument("--stage", choices=("decode", "prefill"), default="decode")
    parser.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                        help="an XLA compile option on top of specjax's (repeatable)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    options = dict(parse_option(item) for item in args.option)
    model = load_model(args.model, dtype="float32")
    records = []
    with bench.persistent_cache_off():
        bench.warm_up()
        for spec in args.programs:
            record = traced_compile(model, parse_program(spec, args.batch), args.stage, options)
            records.append(record)
            print(json.dumps(record))
    if args.out:
        args.out.write_text(json.dumps({"machine": bench.machine(), "records": records}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
