"""Soak test of a long `specjax generate` job (not CI): memory, recompilation, exactly-once rows.

Runs `specjax generate` in this process on N prompts (Spec-Bench questions cycled with distinct
ids) while a thread samples the resident set size and a `jax.monitoring` listener records every
backend compile. Checks, and prints as one JSON object:
  - resident memory flat after the first chunk (growth from the end of the first pass over the
    distinct prompts to the end of the job, MiB and %),
  - no compile after warm-up (the first pass over the distinct prompts sees every bucket),
  - every id exactly once in the output JSONL.

  python benchmarks/soak.py --prompts ../shared/data/spec_bench/question.jsonl --num-prompts 2000 \
      --max-new-tokens 16 --out /tmp/soak.jsonl [--draft ngram --num-draft 4] [--model PATH]

Exit status 1 when a check fails.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import jax

COMPILE_EVENT = "/jax/compilation_cache/compile_requests_use_cache"
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def rss_mib() -> float:
    """This process's resident set size in MiB (Linux /proc)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Sampler(threading.Thread):
    """Samples (seconds since start, RSS MiB) every `period` seconds until stopped."""

    def __init__(self, period: float = 0.5):
        super().__init__(daemon=True)
        self.period, self.samples, self._halt = period, [], threading.Event()
        self.start_time = time.perf_counter()

    def run(self):
        while not self._halt.is_set():
            self.samples.append((time.perf_counter() - self.start_time, rss_mib()))
            self._halt.wait(self.period)

    def stop(self):
        self._halt.set()
        self.join()


def cycled_prompts(source: str, count: int, path: Path) -> int:
    """Writes `count` rows cycling the first turns of `source` (ids 0..count-1); returns the
    number of distinct prompts."""
    from specjax.prompt_io import read_prompts

    base = read_prompts(source)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(count):
            row = base[i % len(base)]
            f.write(json.dumps({"id": i, "category": row["category"], "prompt": row["prompt"]}) + "\n")
    return len(base)


def check_rows(out_path: Path, count: int) -> dict:
    """Counts ids in the output: missing, duplicated, and rows that ended with an error."""
    seen: dict = {}
    errors = 0
    for line in out_path.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        seen[row["id"]] = seen.get(row["id"], 0) + 1
        errors += row["stop_reason"] == "error"
    return {
        "rows": sum(seen.values()),
        "missing": sorted(set(range(count)) - set(seen))[:20],
        "duplicated": sorted(i for i, n in seen.items() if n > 1)[:20],
        "error_rows": errors,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", default="../shared/data/spec_bench/question.jsonl")
    p.add_argument("--num-prompts", type=int, default=2000)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--draft", default=None)
    p.add_argument("--num-draft", type=int, default=None)
    p.add_argument("--out", default=None, help="output JSONL (default: a temporary file)")
    p.add_argument("--max-growth-mib", type=float, default=64.0,
                   help="allowed RSS growth after warm-up before the check fails")
    args = p.parse_args(argv)

    from specjax.cli import main as cli_main

    work = Path(tempfile.mkdtemp(prefix="specjax_soak_"))
    prompts_path = work / "prompts.jsonl"
    distinct = cycled_prompts(args.prompts, args.num_prompts, prompts_path)
    out_path = Path(args.out) if args.out else work / "out.jsonl"
    if out_path.exists():
        out_path.unlink()

    compiles: list[float] = []
    sampler = Sampler()

    def on_duration(event: str, duration: float, **_):
        if event == BACKEND_COMPILE_EVENT:
            compiles.append(time.perf_counter() - sampler.start_time)

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    argv_job = ["generate", "--model", args.model, "--prompts", str(prompts_path), "--out",
                str(out_path), "--max-new-tokens", str(args.max_new_tokens),
                "--batch-size", str(args.batch_size)]
    if args.draft:
        argv_job += ["--draft", args.draft]
    if args.num_draft:
        argv_job += ["--num-draft", str(args.num_draft)]

    # Warm-up = the first pass over the distinct prompts (every prompt bucket appears in it);
    # run it as its own job, then the rest with --resume: the same process, the same programs.
    warm_count = min(distinct, args.num_prompts)
    warm_path = work / "warm.jsonl"
    warm_path.write_text("".join(prompts_path.read_text().splitlines(True)[:warm_count]))
    sampler.start()
    rc_warm = cli_main(argv_job[:4] + [str(warm_path)] + argv_job[5:])
    warm_end = time.perf_counter() - sampler.start_time
    rss_after_warm = rss_mib()
    compiles_warm = len(compiles)
    rc = cli_main(argv_job + ["--resume"])
    sampler.stop()
    total_s = time.perf_counter() - sampler.start_time

    after = [m for t, m in sampler.samples if t >= warm_end]
    rows = check_rows(out_path, args.num_prompts)
    report = {
        "prompts": args.num_prompts, "distinct_prompts": distinct, "model": args.model,
        "draft": args.draft, "max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size,
        "exit_codes": [rc_warm, rc], "seconds": round(total_s, 1),
        "rss_mib_after_warmup": round(rss_after_warm, 1),
        "rss_mib_max_after_warmup": round(max(after, default=rss_after_warm), 1),
        "rss_mib_end": round(rss_mib(), 1),
        "compiles_warmup": compiles_warm, "compiles_after_warmup": len(compiles) - compiles_warm,
        **rows,
    }
    report["rss_growth_mib"] = round(report["rss_mib_max_after_warmup"] - rss_after_warm, 1)
    ok = (rc_warm == rc == 0 and report["compiles_after_warmup"] == 0
          and report["rss_growth_mib"] <= args.max_growth_mib and not rows["missing"]
          and not rows["duplicated"] and rows["rows"] == args.num_prompts)
    report["ok"] = ok
    print(json.dumps(report))
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.exit(main())
