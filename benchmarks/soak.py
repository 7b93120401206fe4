"""Soak test of a long `specjax generate` job (not CI): memory, recompilation, exactly-once rows.

Runs ONE `specjax generate` job in this process on N prompts (Spec-Bench questions of at most
--max-prompt-chars characters, cycled with distinct ids) while a thread samples the resident
set size and the rows written so far, and a `jax_log_compiles` handler records every program
compiled (with the rows written then). Warm-up
= the batches holding the first pass over the distinct prompts (batches follow the file's
order, so every prompt bucket appears in it). Checks, and prints as one JSON object:
  - resident memory flat after warm-up: the peak RSS of each window of rows after it (as many
    rows as the warm-up) does not climb from the first window to the last,
  - no compile after warm-up (the names of any late ones are listed),
  - every id exactly once in the output JSONL.

  python benchmarks/soak.py --prompts ../shared/data/spec_bench/question.jsonl --num-prompts 2000 \
      --max-new-tokens 16 --out /tmp/soak.jsonl [--draft ngram --num-draft 4] [--model PATH]

Exit status 1 when a check fails.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import jax


def rss_mib() -> float:
    """This process's resident set size in MiB (Linux /proc)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def rows_written(path: Path) -> int:
    """Complete lines in the output JSONL so far (0 before it exists)."""
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


class Sampler(threading.Thread):
    """Samples (seconds since start, RSS MiB, rows written) every `period` seconds until stopped."""

    def __init__(self, out_path: Path, period: float = 0.5):
        super().__init__(daemon=True)
        self.out_path, self.period, self.samples = out_path, period, []
        self._halt = threading.Event()
        self.start_time = time.perf_counter()

    def sample(self):
        self.samples.append(
            (time.perf_counter() - self.start_time, rss_mib(), rows_written(self.out_path)))

    def run(self):
        while not self._halt.is_set():
            self.sample()
            self._halt.wait(self.period)

    def stop(self):
        self._halt.set()
        self.join()
        self.sample()


class CompileLog(logging.Handler):
    """Every program JAX compiles (its `jax_log_compiles` line), with the rows written then."""

    def __init__(self, out_path: Path):
        super().__init__(level=logging.DEBUG)
        self.out_path, self.compiles = out_path, []

    def emit(self, record):
        message = record.getMessage()
        if message.startswith("Compiling "):
            self.compiles.append((rows_written(self.out_path), message.split(" with ")[0][:160]))


def window_peaks(samples, warm_rows: int, total_rows: int) -> list[float]:
    """Peak RSS (MiB) of each window of `warm_rows` rows after warm-up. The resident set follows
    the running batch's shape (a long prompt's batch holds a wider cache), so a leak shows as
    peaks that climb window after window, not as one sample above another."""
    peaks = []
    for start in range(warm_rows, total_rows, warm_rows):
        inside = [m for _, m, n in samples if start <= n < start + warm_rows]
        if inside and start + warm_rows <= total_rows:
            peaks.append(round(max(inside), 1))
    return peaks


def cycled_prompts(source: str, count: int, path: Path, max_chars: int) -> int:
    """Writes `count` rows cycling the first turns of `source` of at most `max_chars`
    characters (ids 0..count-1); returns the number of distinct prompts."""
    from specjax.prompt_io import read_prompts

    base = [row for row in read_prompts(source) if len(row["prompt"]) <= max_chars]
    if not base:
        raise SystemExit(f"{source}: no prompt of at most {max_chars} characters")
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
    p.add_argument("--max-prompt-chars", type=int, default=1000,
                   help="use the prompts of at most this many characters (the long Spec-Bench "
                        "ones, up to 6k tokens, make a 2,000-prompt job take hours on 2 cores)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--draft", default=None)
    p.add_argument("--num-draft", type=int, default=None)
    p.add_argument("--out", default=None, help="output JSONL (default: a temporary file)")
    p.add_argument("--no-compile-cache", dest="compile_cache", action="store_false",
                   help="compile everything in this run (default: the persistent cache is used)")
    p.add_argument("--max-growth-mib", type=float, default=64.0,
                   help="allowed growth of the peak RSS from the first window of rows after "
                        "warm-up to the last (a window = as many rows as the warm-up)")
    p.add_argument("--samples", default=None, help="write every (s, RSS MiB, rows) sample here")
    args = p.parse_args(argv)

    from specjax.cli import main as cli_main

    work = Path(tempfile.mkdtemp(prefix="specjax_soak_"))
    prompts_path = work / "prompts.jsonl"
    distinct = cycled_prompts(args.prompts, args.num_prompts, prompts_path, args.max_prompt_chars)
    out_path = Path(args.out) if args.out else work / "out.jsonl"
    if out_path.exists():
        out_path.unlink()

    argv_job = ["generate", "--model", args.model, "--prompts", str(prompts_path), "--out",
                str(out_path), "--max-new-tokens", str(args.max_new_tokens),
                "--batch-size", str(args.batch_size)]
    if args.draft:
        argv_job += ["--draft", args.draft]
    if args.num_draft:
        argv_job += ["--num-draft", str(args.num_draft)]
    if not args.compile_cache:
        argv_job += ["--no-compile-cache"]

    # ONE job in this process. Warm-up = the batches holding the first pass over the distinct
    # prompts (every prompt bucket appears in it: batches follow the file's order); after it,
    # RSS must stay flat and nothing may compile.
    warm_rows = -(-min(distinct, args.num_prompts) // args.batch_size) * args.batch_size
    compile_log = CompileLog(out_path)
    jax.config.update("jax_log_compiles", True)
    jax_logger = logging.getLogger("jax")
    jax_logger.addHandler(compile_log)
    sampler = Sampler(out_path)
    sampler.start()
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):  # quiet the compile log lines (kept above)
        rc = cli_main(argv_job)
    if rc:
        print("\n".join(line for line in stderr.getvalue().splitlines()
                        if not line.startswith("Compiling ")), file=sys.stderr)
    sampler.stop()
    jax_logger.removeHandler(compile_log)
    total_s = time.perf_counter() - sampler.start_time

    after = [(t, m) for t, m, n in sampler.samples if n >= warm_rows]
    rss_after_warm = after[0][1] if after else float("nan")
    late = [name for n, name in compile_log.compiles if n >= warm_rows]
    rows = check_rows(out_path, args.num_prompts)
    report = {
        "prompts": args.num_prompts, "distinct_prompts": distinct, "model": args.model,
        "draft": args.draft, "max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size,
        "exit_code": rc, "seconds": round(total_s, 1), "warmup_rows": warm_rows,
        "rss_mib_after_warmup": round(rss_after_warm, 1),
        "rss_mib_max_after_warmup": round(max((m for _, m in after), default=rss_after_warm), 1),
        "rss_mib_end": round(sampler.samples[-1][1], 1),
        "rss_samples_after_warmup": len(after),
        "compiles_warmup": len(compile_log.compiles) - len(late),
        "compiles_after_warmup": len(late), "late_compiles": late[:10],
        **rows,
    }
    windows = window_peaks(sampler.samples, warm_rows, args.num_prompts)
    report["rss_mib_peak_per_window"] = windows
    report["rss_growth_mib"] = round(windows[-1] - windows[0], 1) if windows else float("nan")
    if args.samples:
        Path(args.samples).write_text(json.dumps(
            [{"s": round(t, 2), "rss_mib": round(m, 1), "rows": n} for t, m, n in sampler.samples]))
    ok = (rc == 0 and len(windows) >= 2 and report["compiles_after_warmup"] == 0
          and report["rss_growth_mib"] <= args.max_growth_mib and not rows["missing"]
          and not rows["duplicated"] and rows["rows"] == args.num_prompts)
    report["ok"] = ok
    print(json.dumps(report))
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.exit(main())
