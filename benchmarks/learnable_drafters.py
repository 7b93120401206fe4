"""Learned drafters in a learnable setting: every head kind on a small target trained here.

One command reproduces every number of docs/drafters.md "Learned heads in a learnable setting":

    python benchmarks/learnable_drafters.py                  # 12.5 min on an idle 2-core CPU
    python benchmarks/learnable_drafters.py --smoke          # ~1-2 min, tiny budgets (CI)

1. corpus: `specjax.train.synthetic` (World 0), its entropy per token (exact per-document
   log-probabilities, averaged);
2. target: a 4-layer Llama (hidden 128) trained with optax on it (`specjax.train.target_lm`),
   saved as a Hugging Face folder and loaded back with `load_model` (the normal path);
3. drafters: self-distilled data (held-in document prefixes continued greedily by the target,
   `trainer.prepare_data`), every kind trained with the existing trainer (`train_drafter`);
   held-out prompts (prefixes of documents of another seed) decoded greedily with each head,
   with n-gram, and with the target drafting for itself (a draft model = the target: AL = D+1);
4. realignment: the target fine-tuned on the shifted corpus (World 1); every drafter measured
   on it before (the drop), then retrained on the new target's outputs from its old
   checkpoint (`init_from`, what `specjax train-drafter --init-from` runs) and from scratch,
   acceptance vs realignment steps / tokens.

Rows go to OUT/results.jsonl, a markdown summary to OUT/summary.md and the curves to
OUT/learnable_drafters.png (matplotlib).
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_drafters import evaluate  # noqa: E402  (benchmarks/ is not a package)

#: kind -> (head options, tree spec builder name, depth); eagle3 is also measured on a tree
HEADS = {
    "eagle3": {"ttt_steps": 5},
    "mtp": {"ttt_steps": 5},
    "medusa": {"num_heads": 5},
    "dflash": {"block_size": 8, "num_anchors": 16},
    "dspark": {"block_size": 8, "num_anchors": 16},
}
#: the draft shapes measured per kind: (label, tree factory args)
SHAPES = {
    "eagle3": [("chain5", ("chain", 5)), ("tree", ("k_ary", (3, 2, 2, 1, 1), 16))],
    "mtp": [("chain5", ("chain", 5))],
    "medusa": [("chain5", ("chain", 5)), ("tree", ("k_ary", (3, 2, 2, 1, 1), 16))],
    "dflash": [("block8", ("chain", 7))],
    "dspark": [("block8", ("chain", 8))],
}

FULL = dict(lm_steps=500, lm_batch=32, seq_len=96, train_docs=4000, drafter_steps=200,
            drafter_batch=16, train_prompts=512, eval_prompts=48, new_tokens=64,
            finetune_steps=200, realign_steps=(25, 50, 100), kinds=",".join(HEADS),
            bound_depths=(5, 7))
SMOKE = dict(lm_steps=20, lm_batch=8, seq_len=48, train_docs=200, drafter_steps=4,
             drafter_batch=4, train_prompts=16, eval_prompts=8, new_tokens=16,
             finetune_steps=4, realign_steps=(2,), kinds="eagle3,dflash", bound_depths=(5,))


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def make_tree(spec):
    from specjax.tree import chain, k_ary

    if spec[0] == "chain":
        return chain(spec[1])
    return k_ary(spec[1], max_nodes=spec[2])


def prefixes(docs, rng, low: int, high: int) -> list[list[int]]:
    """Each document's first n ids, n uniform in [low, high]."""
    return [d.ids[: int(rng.integers(low, high + 1))] for d in docs]


def build_target(folder: Path, world, cfg_args: dict, out_log, base=None, reuse=False):
    """Trains (base=None: from scratch; else fine-tunes base (cfg, params)) a target on world's
    corpus and saves it in folder -> (loaded model, log). reuse: load folder instead when an
    earlier run left it (with its row in folder/target_row.json)."""
    import jax

    from specjax.models.hub import load_model
    from specjax.models.llama import init_params
    from specjax.train import synthetic
    from specjax.train.target_lm import (
        LMConfig,
        eval_loss,
        save_hf,
        synthetic_target_config,
        train_lm,
    )

    if reuse and (folder / "target_row.json").exists():
        row = {**json.loads((folder / "target_row.json").read_text()), "reused": True}
        out_log(row)
        return load_model(folder), row
    seq = cfg_args["seq_len"]
    train = synthetic.token_windows(synthetic.documents(world, cfg_args["train_docs"], seq, 0), seq)
    held = synthetic.token_windows(synthetic.documents(world, 128, seq, 99), seq)
    if base is None:
        cfg = synthetic_target_config(len(synthetic.VOCAB))
        params = init_params(cfg, jax.random.PRNGKey(0))
        lc = LMConfig(steps=cfg_args["lm_steps"], batch_size=cfg_args["lm_batch"], learning_rate=3e-3)
    else:
        cfg, params = base.cfg, base.params
        lc = LMConfig(steps=cfg_args["finetune_steps"], batch_size=cfg_args["lm_batch"],
                      learning_rate=1e-3, warmup_steps=20, seed=1)
    start = time.perf_counter()
    params, log = train_lm(cfg, params, train, lc, on_log=lambda r: say(f"  lm {r}"))
    row = {"what": "target", "world": world.seed, "finetune": base is not None,
           "steps": lc.steps, "tokens": lc.steps * lc.batch_size * seq,
           "train_s": round(time.perf_counter() - start, 1),
           "final_train_loss": round(log[-1]["loss"], 4),
           "held_out_loss": round(eval_loss(cfg, params, held), 4),
           "corpus_entropy": round(synthetic.entropy_per_token(
               synthetic.documents(world, 2000, seq, 7)), 4)}
    shutil.rmtree(folder, ignore_errors=True)
    save_hf(folder, cfg.replace(name=folder.name), params)
    synthetic.write_tokenizer(folder)
    (folder / "target_row.json").write_text(json.dumps(row))
    out_log(row)
    return load_model(folder), row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny budgets: checks the pipeline (CI)")
    p.add_argument("--kinds", default=None, help="comma-separated (default: all; --smoke: eagle3,dflash)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "learnable_drafters"))
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--reuse", action="store_true",
                   help="keep the targets, the data and the base heads an earlier run with the "
                        "same budget left in OUT (their rows are read back) instead of training "
                        "them again; the measurements all run again")
    p.add_argument("--drafter-steps", type=int, default=None,
                   help="training steps of every head (default: the budget's)")
    p.add_argument("--skip-realign", action="store_true", help="stop after the base target's heads")
    p.add_argument("--plot-only", action="store_true",
                   help="only rewrite OUT/summary.md and redraw OUT/learnable_drafters.png "
                        "from OUT/results.jsonl")
    args = p.parse_args(argv)
    budget = dict(SMOKE if args.smoke else FULL)
    if args.drafter_steps:
        budget["drafter_steps"] = args.drafter_steps
    kinds = [k for k in (args.kinds or budget["kinds"]).split(",") if k]
    if args.plot_only:
        rows = [json.loads(line) for line in (Path(args.out) / "results.jsonl").read_text().splitlines()]
        write_summary(Path(args.out), rows)
        plot(Path(args.out), rows)
        return 0

    import numpy as np

    from specjax.drafters.draft_model import DraftModelDrafter
    from specjax.drafters.learned.checkpoint import load_trained
    from specjax.drafters.learned.drafting import drafter_params
    from specjax.drafters.learned.registry import make_learned_drafter
    from specjax.drafters.ngram import NgramDrafter
    from specjax.train import synthetic
    from specjax.train.trainer import TrainConfig, prepare_data, train_drafter
    from specjax.tree import chain

    out = Path(args.out)
    keep = {"target", "target_shifted", "data0", "data1", "drafters"} if args.reuse else set()
    if out.exists():
        for old in out.iterdir():
            if old.name not in keep:
                shutil.rmtree(old) if old.is_dir() else old.unlink()
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    rows: list[dict] = []

    def record(row):
        rows.append(row)
        with open(out / "results.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        say(json.dumps(row))

    seq = budget["seq_len"]
    new = budget["new_tokens"]
    world0, world1 = synthetic.World(0), synthetic.World(1)
    model, _ = build_target(out / "target", world0, budget, record, reuse=args.reuse)
    rng = np.random.default_rng(0)
    eval_docs = {w.seed: synthetic.documents(w, budget["eval_prompts"], seq, 1234) for w in (world0, world1)}
    eval_prompts = {s: prefixes(d, np.random.default_rng(5), 8, seq - new - 1) for s, d in eval_docs.items()}
    train_prompts = {w.seed: prefixes(synthetic.documents(w, budget["train_prompts"], seq, 0), rng, 8,
                                      seq - new - 1) for w in (world0, world1)}
    eval_batch = min(16, budget["eval_prompts"])

    def run_eval(target, world_seed, drafter, dparams):
        return evaluate(target, eval_prompts[world_seed], drafter, dparams, new, eval_batch)

    def bounds(target, world_seed, phase):
        for depth in budget["bound_depths"]:
            self_drafter = DraftModelDrafter(tree=chain(depth), cfg=target.cfg)
            record({"what": "bound", "phase": phase, "drafter": "target-self", "depth": depth,
                    **run_eval(target, world_seed, self_drafter, target.params)})
            record({"what": "bound", "phase": phase, "drafter": "ngram", "depth": depth,
                    **run_eval(target, world_seed, NgramDrafter(chain(depth)), None)})

    def measure(target, world_seed, folder, kind, phase, extra):
        # the checkpoint of the step the row names (None: the stale base head); a missing one
        # fails instead of measuring another step
        step = extra.get("steps") or None
        head, variables = load_trained(folder, target.cfg, step=step)
        dparams = drafter_params(variables, target.params, head)
        for label, spec in SHAPES[kind]:
            drafter = make_learned_drafter(head, make_tree(spec))
            record({"what": "drafter", "phase": phase, "kind": kind, "shape": label,
                    **extra, **run_eval(target, world_seed, drafter, dparams)})

    def tc(steps, save_every=None):
        # a run stopped early (stop_after) must checkpoint where it stops: save_every divides
        # every stop, or the next chunk resumes (and the measurement loads) an earlier step
        return TrainConfig(steps=steps, batch_size=budget["drafter_batch"], learning_rate=2e-3,
                           save_every=save_every or steps, keep=1,
                           log_every=max(1, (save_every or steps) // 5))

    # ---- 1-3: every kind on the base target -------------------------------------------------
    bounds(model, 0, "base")
    data = prepare_data(model, train_prompts[0], out / "data0", seq_len=seq, max_new_tokens=new,
                        temperature=0.0, seed=0, batch_size=64, progress=False)
    for kind in kinds:
        folder = out / "drafters" / kind
        start = time.perf_counter()
        steps = budget["drafter_steps"]
        if args.reuse and (folder / "checkpoints" / str(steps)).exists():
            log = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
            say(f"{kind}: reusing {folder} (trained {log[-1]['elapsed_s']:.0f} s)")
        else:
            shutil.rmtree(folder, ignore_errors=True)
            _, log = train_drafter(model, kind, data, folder, tc(steps), head_options=HEADS[kind],
                                   progress=False)
        measure(model, 0, folder, kind, "base", {
            "steps": budget["drafter_steps"], "train_tokens": log[-1]["tokens"],
            "loss": round(log[-1]["loss"], 4),
            "train_s": round(log[-1]["elapsed_s"] if args.reuse else time.perf_counter() - start, 1),
            "acc": {k: round(v, 3) for k, v in log[-1].items() if k.startswith("acc")}})

    # ---- 4: realignment after the target is fine-tuned on the shifted corpus ----------------
    if args.skip_realign:
        write_summary(out, rows)
        return 0
    tuned, _ = build_target(out / "target_shifted", world1, budget, record, base=model,
                            reuse=args.reuse)
    bounds(tuned, 1, "shifted")
    data1 = prepare_data(tuned, train_prompts[1], out / "data1", seq_len=seq, max_new_tokens=new,
                         temperature=0.0, seed=0, batch_size=64, progress=False)
    for kind in kinds:
        measure(tuned, 1, out / "drafters" / kind, kind, "stale", {"steps": 0})
        for start_from in ("init_from", "scratch"):
            folder = out / "realign" / f"{kind}-{start_from}"
            total = budget["realign_steps"][-1]
            for stop in budget["realign_steps"]:
                init = out / "drafters" / kind if start_from == "init_from" else None
                _, log = train_drafter(tuned, kind, data1, folder,
                                       tc(total, math.gcd(*budget["realign_steps"])), resume=True,
                                       stop_after=stop, progress=False,
                                       head_options=None if init else HEADS[kind], init_from=init)
                measure(tuned, 1, folder, kind, start_from,
                        {"steps": stop, "train_tokens": log[-1]["tokens"] if log else None})
    record({"what": "total", "wall_s": round(time.perf_counter() - t_start, 1)})
    write_summary(out, rows)
    if not args.no_plot:
        try:
            plot(out, rows)
        except ImportError:
            say("matplotlib is missing (the `plots` extra): no PNG; redraw later with --plot-only")
    return 0


def write_summary(out: Path, rows: list[dict]) -> None:
    lines = ["| phase | drafter | shape | steps | AL | conditional acceptance by position | "
             "training accuracy by depth (last log row) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["what"] == "bound":
            lines.append(f"| {r['phase']} | {r['drafter']} | chain{r['depth']} | | {r['al']} | "
                         f"{r['conditional']} | |")
        elif r["what"] == "drafter":
            acc = list(r["acc"].values()) if "acc" in r else ""
            lines.append(f"| {r['phase']} | {r['kind']} | {r['shape']} | {r.get('steps', '')} | "
                         f"{r['al']} | {r['conditional']} | {acc} |")
    targets = [r for r in rows if r["what"] == "target"]
    lines += ["", "| target | world | steps | tokens | train s | held-out loss | corpus entropy |",
              "|---|---|---|---|---|---|---|"]
    lines += [f"| {'fine-tuned' if r['finetune'] else 'base'} | {r['world']} | {r['steps']} | "
              f"{r['tokens']} | {r['train_s']} | {r['held_out_loss']} | {r['corpus_entropy']} |"
              for r in targets]
    (out / "summary.md").write_text("\n".join(lines) + "\n")


def plot(out: Path, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(dict.fromkeys(r["kind"] for r in rows if r["what"] == "drafter"))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    ax = axes[0]
    for r in rows:
        if r["what"] == "drafter" and r["phase"] == "base":
            ax.plot(range(1, len(r["conditional"]) + 1), r["conditional"], marker="o",
                    label=f"{r['kind']} {r['shape']} (AL {r['al']:.2f})")
    for r in rows:
        if r["what"] == "bound" and r["phase"] == "base" and r["depth"] == max(
                x.get("depth", 0) for x in rows if x["what"] == "bound"):
            ax.plot(range(1, len(r["conditional"]) + 1), r["conditional"], ls="--",
                    label=f"{r['drafter']} chain{r['depth']} (AL {r['al']:.2f})")
    ax.set(xlabel="draft position", ylabel="conditional acceptance", ylim=(0, 1.05),
           title="held-out prompts, base target")
    ax.legend(fontsize=7)
    ax = axes[1]
    for i, kind in enumerate(kinds):
        color = f"C{i}"
        first_shape = next(r["shape"] for r in rows if r["what"] == "drafter" and r["kind"] == kind)
        for start_from, ls in (("init_from", "-"), ("scratch", ":")):
            pts = [(r["steps"], r["al"]) for r in rows if r["what"] == "drafter" and r["kind"] == kind
                   and r["phase"] in (start_from, "stale" if start_from == "init_from" else "-")
                   and r["shape"] == first_shape]
            if pts:
                ax.plot(*zip(*pts), ls=ls, marker="o", color=color, label=f"{kind} {start_from}")
    ax.set(xlabel="realignment steps on the fine-tuned target", ylabel="AL (held out)",
           title="realignment: --init-from (solid, step 0 = stale) vs scratch (dotted)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "learnable_drafters.png", dpi=110)


if __name__ == "__main__":
    sys.exit(main())
