"""Offline batch jobs: continuous batching (slots refilled inside the one program) vs static
batches (each batch runs to its slowest row), side by side in one run.

    python benchmarks/batch_offline.py                        # quick: 16 rows, small budgets
    # what docs/batch_jobs.md reports (2 shared CPU cores: about 1.5 h + 0.5 h under load)
    python benchmarks/batch_offline.py --rows 96 --tail 16 512 --workloads long_tail \
        --batch-sizes 8 --drafts ar ngram --repeats 1 --hf-workloads \
        --out benchmarks/results/batch_offline_long_tail.json
    python benchmarks/batch_offline.py --rows 24 --spec-bench-max-new 256 --workloads spec_bench \
        --batch-sizes 8 --drafts ar ngram --repeats 1 \
        --out benchmarks/results/batch_offline_spec_bench.json
    # the full issue-14 run (hours on a CPU)
    python benchmarks/batch_offline.py --rows 480 --spec-bench-max-new 256 --tail 16 512 \
        --batch-sizes 8 32 --repeats 3 --out benchmarks/results/batch_offline_full.json

SmolLM2-135M (f32, greedy, CPU). Two workloads over Spec-Bench first turns (chat template):
(a) `spec_bench`: max_new_tokens --spec-bench-max-new for every row, EOS ends rows;
(b) `long_tail`: EOS off, each row's max_new drawn log-uniformly in [--tail LO, HI] (seeded),
so a batch's rows end at very different steps.
Modes per (workload, drafter, B): `static` (the API's static batches: `loop.generate_program` /
`spec_generate_program` per batch of B in file order, rows padded to the batch's buckets), one
`refill:RxK` per refill policy (`api.run_chunks`: `refill.refill_program` over chunks of up to
8·B prompts, the slots carried from call to call, R rows per refill pass, refill when K slots
are free) and, with the ar rows of --hf-workloads, `hf`: Hugging Face transformers' padded
batched greedy `generate` over the same batches of B (left-padded, the same GGUF in f32; needs
the `hf` extra; a row's tokens count up to its first EOS). Every program is built (compiled, or
found compiled) before it runs and only its run is timed (compile excluded); the modes take
turns in a rotating order --repeats times; medians are reported.
Slot utilisation = busy slot-steps / (decoding steps · B) (static: each row is busy from its
first decoding step to its last). Tokens/s counts emitted tokens over the programs' run time.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
from pathlib import Path

import jax
import numpy as np

from specjax.api import batch_bucket, bucket, draft_margin, run_chunks
from specjax.drafters.registry import make_drafter
from specjax.loop import StopCriteria, generate_program, spec_generate_program
from specjax.metrics import job_summary, row_summaries
from specjax.models.hub import load_model
from specjax.refill import PromptQueue, RefillPolicy
from specjax.rng import job_row_keys, seed_key
from specjax.sampling import SamplingParams
from specjax.target import as_target
from specjax.timing import build_and_run
from specjax.tree import chain

DEFAULT_PROMPTS = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "spec_bench" / "question.jsonl"


def workloads(tokenizer, args) -> dict[str, tuple[list[list[int]], list[int], tuple[int, ...]]]:
    """{name: (prompts, max_new per prompt, eos ids)}."""
    rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    prompts = [tokenizer.encode_chat(r["turns"][0])[: args.max_prompt] for r in rows[: args.rows]]
    low, high = args.tail
    rng = np.random.default_rng(args.seed)
    tail = np.exp(rng.uniform(np.log(low), np.log(high), len(prompts))).round().astype(int).tolist()
    eos = tuple(tokenizer.eos_token_ids)
    return {"spec_bench": (prompts, [args.spec_bench_max_new] * len(prompts), eos),
            "long_tail": (prompts, tail, ())}


def static_run(model, drafter, dparams, prompts, max_new, eos, batch_size):
    """(run seconds, new tokens, busy slot-steps, slot-steps, spec rows) of static batches of
    batch_size (run seconds: the programs' runs, each built before it runs)."""
    cfg, params = model.cfg, model.params
    keys = job_row_keys(seed_key(0), list(range(len(prompts))))
    sampling, criteria = SamplingParams.make(0.0), StopCriteria.make(eos, ())
    seconds = new = busy = slot_steps = 0
    spec_rows = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start: start + batch_size]
        rows = batch_size if len(chunk) == batch_size else batch_bucket(len(chunk))
        width_p = bucket(max(len(p) for p in chunk))
        limit = max_new[start: start + len(chunk)]
        width = width_p + bucket(max(limit)) + draft_margin(None if drafter is None else drafter.tree)
        queue = PromptQueue.build(chunk, limit, keys[start: start + len(chunk)], rows, width_p)
        args = (queue.tokens, queue.lengths, queue.max_new, as_target(cfg).init_cache(rows, width),
                queue.keys, sampling, criteria)
        if drafter is None:
            (state, _, run_s), metrics = build_and_run(generate_program, cfg, params, *args,
                                                       width=width), None
        else:
            (state, metrics, _), _, run_s = build_and_run(
                spec_generate_program, cfg, params, drafter, dparams, *args,
                drafter.init_carry(dparams), width=width)
        seconds += run_s
        state, metrics = jax.device_get((state, metrics))
        emitted = (state.num_tokens - state.prompt_lens)[: len(chunk)]
        new += int(emitted.sum())
        # a row is busy from its first decoding step to its last (AR: one token per step)
        busy += int(np.sum(emitted - 1) if metrics is None else np.sum(metrics.steps[: len(chunk)]))
        slot_steps += int(state.step) * rows
        if metrics is not None:
            spec_rows += row_summaries(metrics, len(chunk))
    return seconds, new, busy, slot_steps, spec_rows


def refill_run(model, drafter, dparams, prompts, max_new, eos, batch_size, policy):
    """(run seconds, new tokens, busy slot-steps, slot-steps, spec rows, refills) through
    refilled slots (`api.run_chunks`: chunks of up to 8·B prompts, the slots carried from one
    call to the next; run seconds: the calls' runs, each built before it runs)."""
    keys = job_row_keys(seed_key(0), list(range(len(prompts))))
    sampling, criteria = SamplingParams.make(0.0), StopCriteria.make(eos, ())
    seconds = busy = slot_steps = refills = 0
    rows = {}
    calls = run_chunks(model.cfg, model.params, prompts, max_new_tokens=max_new, sampling=sampling,
                       criteria=criteria, row_keys=keys, batch_size=batch_size, drafter=drafter,
                       drafter_params=dparams,
                       drafter_carry=() if drafter is None else drafter.init_carry(dparams),
                       policy=policy)
    for ended in calls:
        rows.update(ended)
        times = next(iter(ended.values())).times
        seconds += times.run_s
        busy += times.slots.busy_slot_steps
        slot_steps += times.slots.slot_steps
        refills += times.slots.refills
    assert sorted(rows) == list(range(len(prompts)))
    new = sum(len(r.token_ids) for r in rows.values())
    spec_rows = [rows[i].spec for i in range(len(prompts))] if drafter is not None else []
    return seconds, new, busy, slot_steps, spec_rows, refills


def hf_run(hf, prompts, max_new, eos, batch_size):
    """(run seconds, new tokens, 0, 0, []) of Hugging Face transformers' padded batched greedy `generate`
    over batches of batch_size prompts (left-padded; a row's new tokens end at its first EOS)."""
    import torch  # the optional hf extra, only this mode needs it

    seconds = new = 0
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start: start + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(chunk):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        begin = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=max(max_new[start: start + len(chunk)]),
                              do_sample=False, eos_token_id=list(eos) or None, pad_token_id=0)
        seconds += time.perf_counter() - begin
        for row in out[:, width:].tolist():
            ends = [j for j, t in enumerate(row) if t in eos]
            new += ends[0] + 1 if ends else len(row)
    return seconds, new, 0, 0, []


def load_hf(model):
    """The same GGUF checkpoint in transformers (f32, eval), or None without the hf extra."""
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None
    torch.set_num_threads(os.cpu_count() or 1)
    path = Path(model.source)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                              torch_dtype=torch.float32).eval()
    with torch.no_grad():  # warm-up, as the specjax modes' programs are built before they run
        hf.generate(torch.ones((2, 8), dtype=torch.long), max_new_tokens=4, do_sample=False,
                    pad_token_id=0)
    return hf


def parse_policy(text: str) -> RefillPolicy:
    rows, _, min_free = text.partition("x")
    return RefillPolicy(rows=int(rows), min_free=int(min_free or 1))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default=str(DEFAULT_PROMPTS))
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=128, help="prompt tokens kept (head)")
    parser.add_argument("--spec-bench-max-new", type=int, default=64)
    parser.add_argument("--tail", type=int, nargs=2, default=(8, 128), metavar=("LO", "HI"))
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[8])
    parser.add_argument("--drafts", nargs="+", default=["ar", "ngram"])
    parser.add_argument("--policies", nargs="+", default=["1x1"], help="refill policies RxK")
    parser.add_argument("--workloads", nargs="+", default=["long_tail", "spec_bench"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf-workloads", nargs="*", default=["spec_bench"],
                        help="workloads that also run transformers' padded batched generate (the "
                        "'hf' extra; with the ar rows)")
    parser.add_argument("--out", help="JSON results")
    args = parser.parse_args(argv)

    model = load_model("smollm2-135m", dtype="float32")
    loads = workloads(model.tokenizer, args)
    hf = load_hf(model) if args.hf_workloads else None
    drafters = {name: (None, None) if name == "ar" else
                make_drafter(name, tree=chain(4), target=model, target_cfg=model.cfg,
                             target_params=model.params) for name in args.drafts}
    results = []
    for workload in args.workloads:
        prompts, max_new, eos = loads[workload]
        for name, (drafter, dparams) in drafters.items():
            for batch_size in args.batch_sizes:
                job = (model, drafter, dparams, prompts, max_new, eos, batch_size)
                modes = {"static": functools.partial(static_run, *job)}
                for text in args.policies:
                    modes[f"refill:{text}"] = functools.partial(refill_run, *job, parse_policy(text))
                if hf is not None and name == "ar" and workload in args.hf_workloads:
                    modes["hf"] = functools.partial(hf_run, hf, prompts, max_new, eos, batch_size)
                times, outcome, order = {mode: [] for mode in modes}, {}, list(modes)
                for repeat in range(args.repeats):
                    for mode in order[repeat % len(order):] + order[: repeat % len(order)]:
                        outcome[mode] = modes[mode]()
                        times[mode].append(outcome[mode][0])
                for mode in modes:
                    new, busy, slot_steps, spec_rows = outcome[mode][1:5]
                    seconds = statistics.median(times[mode])
                    record = {
                        "workload": workload, "draft": name, "batch_size": batch_size, "mode": mode,
                        "rows": len(prompts), "new_tokens": new, "time_s": round(seconds, 3),
                        "tokens_per_s": round(new / seconds, 2),
                        "slot_utilisation": round(busy / slot_steps, 3) if slot_steps else 0.0,
                        "refills": outcome[mode][5] if len(outcome[mode]) > 5 else None,
                        "acceptance_length": round(job_summary(spec_rows)["acceptance_length"], 3)
                        if spec_rows else None,
                    }
                    results.append(record)
                    print(json.dumps(record), flush=True)
                static = next(r for r in results[-len(modes):] if r["mode"] == "static")
                for r in results[-len(modes):]:
                    r["x_static"] = round(r["tokens_per_s"] / static["tokens_per_s"], 3)
                    print(f"{workload:10s} {name:6s} B={batch_size:<3d} {r['mode']:12s} "
                          f"{r['tokens_per_s']:8.1f} tok/s  x{r['x_static']:.2f}  "
                          f"util {r['slot_utilisation']:.2f}", flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
