"""Train learned drafters on SmolLM2 and measure their acceptance as training goes (not CI).

For each kind: self-distilled data from the target (Spec-Bench prompts outside the MT-bench
categories, chat template, greedy responses; shared by all kinds), then training in chunks of
--eval-every steps (orbax resume between chunks); after each chunk, greedy speculative
decoding of MT-bench first turns (held out) gives AL, per-position acceptance and tokens/s.
`ngram` and plain AR run on the same prompts for reference. Rows go to OUT/curves.jsonl (one
per kind x eval point) and a markdown table to OUT/summary.md.

    python benchmarks/train_drafters.py --kinds eagle3,dflash --steps 200 --eval-every 50

CPU note: one step of a SmolLM2-135M batch (4 x 256 tokens) costs ~10 s on 2 cores, so an hour
is ~300 steps (~300k training tokens); published heads train on 10^8-10^9 tokens. Read the
curves as trends (AL vs training tokens), not as converged numbers.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEC_BENCH = ROOT.parent / "shared" / "data" / "spec_bench" / "question.jsonl"
MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")

#: head options per kind for a SmolLM2-sized target, and the chain depth each drafts
HEADS = {
    "eagle3": ({"draft_vocab_size": 8192, "ttt_steps": 4}, 4),
    "mtp": ({"ttt_steps": 4}, 4),
    "medusa": ({"num_heads": 4}, 4),
    "dflash": ({"block_size": 8, "num_anchors": 16}, 7),
    "dspark": ({"block_size": 8, "num_anchors": 16}, 7),
}


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def evaluate(model, prompts, drafter, dparams, max_new: int, batch_size: int) -> dict:
    """Greedy generation of every prompt; AL and per-position acceptance (spec) and tokens/s."""
    from specjax.api import generate_ids
    from specjax.metrics import job_summary

    start = time.perf_counter()
    res = generate_ids(model.cfg, model.params, prompts, max_new_tokens=max_new,
                       batch_size=batch_size, draft=drafter, drafter_params=dparams)
    elapsed = time.perf_counter() - start
    tokens = sum(len(r.token_ids) for r in res)
    out = {"tokens": tokens, "wall_s": round(elapsed, 2), "tok_s": round(tokens / elapsed, 2)}
    if drafter is not None:
        s = job_summary([r.spec for r in res])
        out.update(al=round(s["acceptance_length"], 4),
                   joint=[round(x, 3) for x in s["joint_acceptance"]],
                   conditional=[round(x, 3) for x in s["conditional_acceptance"]])
    return out


def timed_eval(model, prompts, drafter, dparams, args) -> dict:
    """Second run of the same program (the first one compiles)."""
    evaluate(model, prompts[: args.eval_batch], drafter, dparams, 8, args.eval_batch)
    return evaluate(model, prompts, drafter, dparams, args.eval_new_tokens, args.eval_batch)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--kinds", default="eagle3,dflash,dspark,mtp,medusa")
    p.add_argument("--prompts", nargs="+", default=[str(SPEC_BENCH)],
                   help="training prompt sources (JSONL files or the named sets gsm8k, humaneval), "
                        "pooled in order; MT-bench categories are always left out")
    p.add_argument("--train-prompts", type=int, default=256)
    p.add_argument("--eval-prompts", type=int, default=16, help="MT-bench first turns (2 per category)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=192, help="response tokens in the data")
    p.add_argument("--eval-new-tokens", type=int, default=64)
    p.add_argument("--eval-batch", type=int, default=8)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "train_drafters"))
    args = p.parse_args(argv)

    from specjax.drafters.learned.checkpoint import load_trained
    from specjax.drafters.learned.drafting import drafter_params
    from specjax.drafters.learned.registry import make_learned_drafter
    from specjax.drafters.ngram import NgramDrafter
    from specjax.measure.datasets import load_prompt_set
    from specjax.models.hub import load_model
    from specjax.prompt_io import read_prompts
    from specjax.train.trainer import TrainConfig, prepare_data, train_drafter
    from specjax.tree import chain

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = load_model(args.target)
    tok = model.tokenizer
    pooled = [r for source in args.prompts for r in load_prompt_set(source)]
    train_rows = [r for r in pooled if r["category"] not in MT_BENCH][: args.train_prompts]
    rows = read_prompts(SPEC_BENCH)  # the held-out evaluation prompts
    per_cat = max(1, args.eval_prompts // len(MT_BENCH))
    eval_rows = [r for c in MT_BENCH for r in [x for x in rows if x["category"] == c][:per_cat]]
    eval_ids = [tok.encode_chat(r["prompt"]) for r in eval_rows]
    data = prepare_data(model, [tok.encode_chat(r["prompt"]) for r in train_rows], out,
                        seq_len=args.seq_len, max_new_tokens=args.max_new_tokens, temperature=0.0,
                        seed=0, batch_size=16)
    say(f"data: {data.num_sequences} sequences x {data.seq_len}; eval: {len(eval_ids)} MT-bench prompts")

    def record(row):
        row = {"target": args.target, **row}
        with open(out / "curves.jsonl", "a") as curves:
            curves.write(json.dumps(row) + "\n")
        say(json.dumps(row))

    record({"kind": "ar", **timed_eval(model, eval_ids, None, None, args)})
    record({"kind": "ngram", "depth": 4, **timed_eval(model, eval_ids, NgramDrafter(chain(4)), None, args)})
    for kind in [k for k in args.kinds.split(",") if k]:
        options, depth = HEADS[kind]
        tc = TrainConfig(steps=args.steps, batch_size=args.batch_size, learning_rate=args.lr,
                         save_every=args.eval_every, keep=2, log_every=10)
        for stop in range(args.eval_every, args.steps + 1, args.eval_every):
            _, log = train_drafter(model, kind, data, out / kind, tc, head_options=options,
                                   resume=True, stop_after=stop)
            head, variables = load_trained(out / kind, model.cfg)
            drafter = make_learned_drafter(head, chain(depth))
            result = timed_eval(model, eval_ids, drafter, drafter_params(variables, model.params, head), args)
            last = log[-1] if log else {}
            record({"kind": kind, "depth": depth, "step": stop,
                    "train_tokens": stop * args.batch_size * args.seq_len,
                    "loss": round(last.get("loss", float("nan")), 4), **result})
    write_summary(out)
    return 0


def write_summary(out: Path) -> None:
    rows = [json.loads(line) for line in (out / "curves.jsonl").read_text().splitlines()]
    lines = ["| kind | step | train tokens | loss | AL | joint acceptance | tok/s |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['kind']} | {r.get('step', '')} | {r.get('train_tokens', '')} | "
                     f"{r.get('loss', '')} | {r.get('al', '')} | {r.get('joint', '')} | {r['tok_s']} |")
    (out / "summary.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
