"""Decoding against this machine's memory-bandwidth floor, side by side in one run.

1. Streaming-read bandwidth of a >= 1 GB buffer, with numpy and with jnp (best of N sums).
2. For each mode (f32, bf16, int8, int4; `<mode>_xla`, e.g. `float32_xla` / `int8_xla`: the
   same weights multiplied by XLA's path (f32 / bf16: a slice of each layer's kernel copied
   out of the stack, then XLA's dot; int8 / int4: qwix's dequantize + dot) instead of the CPU
   kernels: SPECJAX_CPU_KERNELS=0 while they run, which also keeps XLA's attention): the bytes a B=1 decode step must read (weights at their stored width, the
   float LM head left out where an int8 one replaces it in the step, + the KV cache at the mean
   length) / the bandwidth = the floor step time;
   the measured plain (AR) step time; floor / measured = the fraction of the floor reached.
3. tokens/s at B=1 of specjax plain decoding and of the best of the given drafters, per mode,
   on Spec-Bench summarization and on open chat (writing) prompts (`--num-draft`: a chain of 4
   by default, or auto): the median of `--repeats` passes over the prompts, plain decoding and
   the drafters taking turns in an order rotated each pass (before 2026-12-07 evening: one pass
   each, plain first, so the machine's drift between them read as a drafter's gain); with each
   drafter's acceptance length and auto's picks (steps per draft length).
4. llama.cpp: run through llama-cpp-python when it imports (the shipped Q4_1 GGUF, the same
   prompt token ids and threads, greedy, prefill excluded as for specjax), else the column
   holds the reason. llama-cpp-python is a benchmark dependency, built from its sdist (cmake +
   g++; on a CPU that reports AMX build it without: docs/quantization.md has the flags).
5. Hugging Face transformers (the `hf` extra: torch CPU) on the same GGUF loaded in f32: plain
   greedy, its prompt lookup drafting, and torch's dynamic int8 quantization (`HF_VARIANTS`),
   same token ids and threads, prefill excluded; `--no-hf` skips it.

    .venv/bin/python benchmarks/cpu_floor.py --prompts-per-set 2 --max-new 64 \
        --out benchmarks/results/cpu_floor_smollm2.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import specjax
from specjax.kernels.qmatmul_cpu import ENV_SWITCH
from specjax.measure.datasets import load_prompt_set, select_rows
from specjax.metrics import job_summary
from specjax.models.quant import HEAD, pack_params, quantize_params

SPEC_BENCH = "../shared/data/spec_bench/question.jsonl"
SETS = {"summarization": "summarization", "open_chat": "writing"}
MODES = ("float32", "bfloat16", "int8", "int4")
XLA_SUFFIX = "_xla"


def numpy_bandwidth(nbytes: int, repeats: int) -> float:
    """GB/s of the best `np.sum` over a float32 buffer of `nbytes`."""
    buf = np.ones(nbytes // 4, np.float32)
    best = min(_timed(lambda: buf.sum()) for _ in range(repeats))
    return nbytes / best / 1e9


def jnp_bandwidth(nbytes: int, repeats: int) -> float:
    """GB/s of the best jitted `jnp.sum` over a float32 device buffer of `nbytes`."""
    buf = jnp.ones(nbytes // 4, jnp.float32)
    total = jax.jit(jnp.sum)
    total(buf).block_until_ready()
    best = min(_timed(lambda: total(buf).block_until_ready()) for _ in range(repeats))
    return nbytes / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def stored_bytes(params) -> int:
    """Bytes a step reads of `params` as stored on the device (int4: two values a byte in the
    CPU kernel's layout, one a byte in XLA CPU's QArrays, `int4_xla`). With an int8 LM head
    (`quant.HEAD`) the float head it replaces is left out: `lm_head`, or a tied embedding; an
    untied embedding is left out too (the lookups read B of its rows)."""
    inner = params["params"]
    if HEAD in inner:
        inner = {k: v for k, v in inner.items() if k not in ("lm_head", "embed_tokens")}
    elif "lm_head" in inner:
        inner = {k: v for k, v in inner.items() if k != "embed_tokens"}
    return sum(_device_bytes(leaf) for leaf in jax.tree.leaves(inner))


def _device_bytes(leaf) -> int:
    """An array's bytes on its device (an accelerator may pack 4-bit values two a byte)."""
    try:
        return int(leaf.on_device_size_in_bytes())
    except (AttributeError, NotImplementedError, RuntimeError):
        return leaf.size * leaf.dtype.itemsize


def kv_bytes(cfg, length: float) -> float:
    """KV cache bytes one row reads per step at `length` cached tokens."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * length * jnp.dtype(cfg.dtype).itemsize


def model_in(f32, mode: str):
    """The f32-loaded model as `mode` (bf16 params, or int8 / int4 layer kernels; the `_xla`
    suffix changes nothing here: `main` switches the CPU kernels off around it)."""
    base = mode.removesuffix(XLA_SUFFIX)
    if base == "bfloat16":
        return dataclasses.replace(f32, cfg=f32.cfg.replace(dtype="bfloat16"),
                                   params=jax.tree.map(lambda x: x.astype(jnp.bfloat16), f32.params))
    if base in ("int8", "int4"):
        return dataclasses.replace(f32, params=pack_params(quantize_params(f32.params, base)))
    return f32


def cell_parser(description: str, modes: list[str], repeats: int) -> argparse.ArgumentParser:
    """The options of a side-by-side benchmark over (weight mode, prompt set, batch size) cells
    (`cells`): --model, --prompts, --modes, --sets, --batch-sizes, --max-new, --repeats, --out."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", default=SPEC_BENCH)
    ap.add_argument("--modes", nargs="+", default=modes)
    ap.add_argument("--sets", nargs="+", default=list(SETS))
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=repeats)
    ap.add_argument("--out", default=None)
    return ap


def cells(args, report: dict):
    """Yields (key "mode set B=b", model in that mode, b, the set's prompts: max(2, b) of
    them) for each cell of `cell_parser`'s args; `report` gets the command and the CPU count,
    and `save_cell` adds each cell's result."""
    f32 = specjax.load(args.model, dtype="float32")
    rows = load_prompt_set(args.prompts)
    report.update({"command": " ".join(["python", *sys.argv]), "cpu_count": os.cpu_count(), "cells": {}})
    for mode in args.modes:
        model = model_in(f32, mode)
        for name in args.sets:
            for batch in args.batch_sizes:
                texts = [r["prompt"] for r in select_rows(rows, [SETS[name]], max(2, batch))]
                yield f"{mode} {name} B={batch}", model, batch, [model.tokenizer.encode_chat(t) for t in texts]


def save_cell(report: dict, key: str, cell: dict, out: str | None, shown: dict) -> None:
    """Prints `shown` (the cell without its per-pass lists) and keeps `cell` in the report,
    written to `out` after each cell: a long run stopped early keeps what it measured."""
    report["cells"][key] = cell
    print(key, json.dumps(shown), flush=True)
    if out:
        with open(out, "w") as f:
            json.dump(report, f, indent=1)


def decode_pass(model, prompts, max_new: int, draft=None, num_draft: int | str = 4) -> dict:
    """One pass of B=1 generations of `prompts`: tokens/s (decode only, compile and prefill
    excluded; static batches: a refilled slot's prefill runs inside the decode loop, so its time
    would count as decoding), with the drafter's acceptance and auto's picks when drafting."""
    options = dict(max_new_tokens=max_new, batch_size=1, draft=draft,
                   num_draft=num_draft if draft else None, refill=False)
    tokens = seconds = 0.0
    lengths, spec_rows = [], []
    for prompt in prompts:
        (g,) = specjax.generate(model, [prompt], **options)
        tokens += g.num_new_tokens
        seconds += g.times.decode_s
        lengths.append(len(prompt) + g.num_new_tokens / 2)
        spec_rows += [g.spec] if g.spec is not None else []
    rate = {"tokens_per_s": tokens / seconds, "mean_length": float(np.mean(lengths))}
    if spec_rows:  # the drafter's acceptance, and auto's picks (steps per draft length)
        job = job_summary(spec_rows)
        rate |= {"acceptance_length": round(job["acceptance_length"], 3),
                 "shape_histogram": job.get("shape_histogram", {})}
    return rate


def decode_rates(model, prompts, max_new: int, drafts, num_draft, repeats: int) -> dict:
    """{None (plain) or drafter: its rate} over `repeats` passes, the modes taking turns in an
    order rotated each pass (the machine's drift spread over all of them): the median pass's
    tokens/s (and its step ms), each pass's, and the last pass's acceptance and picks. Each
    mode's programs are compiled first."""
    modes = [None, *drafts]
    for draft in modes:
        decode_pass(model, prompts[:1], max_new, draft, num_draft)  # compile
    passes: dict = {draft: [] for draft in modes}
    for rep in range(repeats):
        for draft in modes[rep % len(modes):] + modes[:rep % len(modes)]:
            passes[draft].append(decode_pass(model, prompts, max_new, draft, num_draft))
    out = {}
    for draft, runs in passes.items():
        median = statistics.median(r["tokens_per_s"] for r in runs)
        out[draft] = {**runs[-1], "tokens_per_s": round(median, 2), "step_ms": round(1e3 / median, 2),
                      "passes": [round(r["tokens_per_s"], 2) for r in runs]}
    return out


def llama_cpp_rate(gguf_path: str, prompts: list[list[int]], max_new: int, threads: int,
                   eos_ids, repeats: int = 1) -> dict | str:
    """llama.cpp greedy decoding through llama-cpp-python over the same token ids (specjax's
    chat template), or why it did not run. Counted as specjax's `decode_pass` counts: the new
    tokens (the first included) over the seconds after the first token came out (prefill
    excluded)."""
    try:
        import llama_cpp  # a benchmark dependency only, not installed by .[dev]
    except ImportError as e:
        return f"not run: llama-cpp-python does not import ({e})"
    llm = llama_cpp.Llama(gguf_path, n_threads=threads, n_threads_batch=threads, verbose=False,
                          n_ctx=2048)
    stop = set(eos_ids)
    passes = []
    for rep in range(1 + repeats):  # the first pass warms up; the median of the others
        tokens = seconds = prefill = 0.0
        for prompt in prompts:
            t0 = time.perf_counter()
            count = 0
            for token in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0,
                                      reset=True):
                count += 1
                if count == 1:
                    t1 = time.perf_counter()
                if token in stop or count >= max_new:
                    break
            prefill += t1 - t0
            seconds += time.perf_counter() - t1
            tokens += count
        if rep:
            passes.append(tokens / seconds)
    return {"tokens_per_s": round(statistics.median(passes), 2), "prefill_s": round(prefill, 3),
            "new_tokens": int(tokens), "threads": threads, "version": llama_cpp.__version__,
            "passes": [round(p, 2) for p in passes]}


#: the Hugging Face transformers runs: f32 greedy; with its prompt lookup drafting (its n-gram
#: drafter, 4 tokens); int8 by torch's dynamic quantization of the Linear layers (W8A8: what a
#: torch user on CPU gets for int8; not weight-only, so not the same numbers as specjax int8)
HF_VARIANTS = ("f32", "f32_prompt_lookup", "int8_dynamic")


def hf_rates(gguf_path: str, prompts: list[list[int]], max_new: int, threads: int,
             eos_ids) -> dict | str:
    """Hugging Face transformers greedy decoding (torch CPU, `threads` threads) over the same
    token ids, per `HF_VARIANTS`, or why it did not run. Counted as specjax's `decode_pass`
    counts: the new tokens over the seconds after the first one (a 1-token generate of the
    same prompt, timed just before, is the prefill)."""
    try:
        import torch  # the optional `hf` extra (torch CPU wheel), not installed by .[dev]
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        return f"not run: the hf extra does not import ({e})"
    torch.set_num_threads(threads)
    folder, name = os.path.split(gguf_path)
    f32 = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, torch_dtype=torch.float32).eval()
    models = {"f32": f32, "f32_prompt_lookup": f32,
              "int8_dynamic": torch.ao.quantization.quantize_dynamic(f32, {torch.nn.Linear}, dtype=torch.qint8)}
    extra = {"f32_prompt_lookup": {"prompt_lookup_num_tokens": 4}}

    def generate(model, ids, new, **kw):
        x = torch.tensor([ids])
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, do_sample=False,
                                 eos_token_id=list(eos_ids), pad_token_id=0, **kw)
        return out.shape[1] - x.shape[1], time.perf_counter() - t0

    results = {}
    for variant in HF_VARIANTS:
        model, kw = models[variant], extra.get(variant, {})
        generate(model, prompts[0], 4, **kw)  # warm-up
        tokens = seconds = 0.0
        for ids in prompts:
            _, prefill = generate(model, ids, 1, **kw)
            count, total = generate(model, ids, max_new, **kw)
            tokens += count
            seconds += max(total - prefill, 1e-9)
        results[variant] = {"tokens_per_s": round(tokens / seconds, 2), "new_tokens": int(tokens)}
    return results | {"threads": threads, "torch": torch.__version__}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", default=SPEC_BENCH)
    ap.add_argument("--prompts-per-set", type=int, default=2)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--modes", nargs="+", default=list(MODES))
    ap.add_argument("--drafts", nargs="*", default=["ngram", "suffix"])
    ap.add_argument("--num-draft", type=lambda v: v if v == "auto" else int(v), default=4,
                    help="the drafters' draft length: an int (a chain), or auto (picked per step)")
    ap.add_argument("--bandwidth-gb", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=5,
                    help="bandwidth sums (best of), and passes of each mode's decoding (median), "
                         "the modes taking turns in a rotated order; llama.cpp's passes too")
    ap.add_argument("--no-hf", dest="hf", action="store_false",
                    help="skip the Hugging Face transformers runs (the hf extra)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    nbytes = int(args.bandwidth_gb * 1e9)
    bandwidth = {"numpy_gb_s": round(numpy_bandwidth(nbytes, args.repeats), 2),
                 "jnp_gb_s": round(jnp_bandwidth(nbytes, args.repeats), 2), "bytes": nbytes}
    print("bandwidth", bandwidth, flush=True)
    floor_gb_s = max(bandwidth["numpy_gb_s"], bandwidth["jnp_gb_s"])
    f32 = specjax.load(args.model, dtype="float32")
    rows = load_prompt_set(args.prompts)
    sets = {name: [r["prompt"] for r in select_rows(rows, [cat], args.prompts_per_set)]
            for name, cat in SETS.items()}
    results: dict = {}
    for mode in args.modes:
        os.environ[ENV_SWITCH] = "0" if mode.endswith(XLA_SUFFIX) else "1"
        jax.clear_caches()  # the switch is read at trace time: f32 and f32_xla trace alike
        model = model_in(f32, mode)
        weights = stored_bytes(model.params)
        for name, texts in sets.items():
            prompts = [model.tokenizer.encode_chat(t) for t in texts]
            drafted = decode_rates(model, prompts, args.max_new, args.drafts, args.num_draft, args.repeats)
            ar = drafted.pop(None)
            step_bytes = weights + kv_bytes(model.cfg, ar["mean_length"])
            floor_ms = 1e3 * step_bytes / (floor_gb_s * 1e9)
            best = max(drafted, key=lambda d: drafted[d]["tokens_per_s"]) if drafted else None
            results.setdefault(mode, {})[name] = {
                "weight_bytes": weights, "step_bytes": int(step_bytes),
                "floor_step_ms": round(floor_ms, 2), "ar": ar,
                "fraction_of_floor": round(floor_ms / ar["step_ms"], 3),
                "drafters": drafted, "best_drafter": best}
            print(mode, name, json.dumps(results[mode][name]), flush=True)
    gguf = str(f32.source)
    llama = {name: llama_cpp_rate(gguf, [f32.tokenizer.encode_chat(t) for t in texts],
                                  args.max_new, os.cpu_count() or 1, f32.cfg.eos_token_ids, args.repeats)
             for name, texts in sets.items()}
    print("llama.cpp", llama, flush=True)
    hf = {name: hf_rates(gguf, [f32.tokenizer.encode_chat(t) for t in texts], args.max_new,
                         os.cpu_count() or 1, f32.cfg.eos_token_ids)
          for name, texts in sets.items()} if args.hf else "not run (--no-hf)"
    print("hf transformers", hf, flush=True)
    report = {"command": " ".join([sys.executable.split("/")[-1], *sys.argv]),
              "device": str(jax.devices()[0]), "cpu_count": os.cpu_count(), "bandwidth": bandwidth,
              "specjax": results, "llama_cpp": llama, "hf_transformers": hf}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
