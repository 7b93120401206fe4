"""`specjax train-drafter`: self-distill a prompt set with the target, train a learned drafter.

    specjax train-drafter --target smollm2-135m --kind eagle3 --prompts a.jsonl b.jsonl \
        --steps 2000 --batch-size 8 --out runs/eagle3 [--resume]

OUT holds the data, the orbax checkpoints and drafter.json (`specjax.train.trainer`); load the
result with `specjax generate --draft eagle3:OUT` (likewise mtp, medusa, dflash, dspark).
Registered by `specjax.cli.build_parser`; heavy imports happen inside the command.
"""
from __future__ import annotations

import argparse
import sys

from specjax.cli import InputError, read_prompts

KINDS = ("eagle3", "mtp", "medusa", "dflash", "dspark")

#: CLI option -> head config field, per kind (unset options keep the config's defaults)
HEAD_OPTIONS = {
    "eagle3": {"depth": "ttt_steps", "draft_vocab": "draft_vocab_size"},
    "mtp": {"depth": "ttt_steps"},
    "medusa": {"depth": "num_heads"},
    "dflash": {"block_size": "block_size", "draft_layers": "num_draft_layers"},
    "dspark": {"block_size": "block_size", "draft_layers": "num_draft_layers"},
}


def add_subcommands(sub) -> None:
    p = sub.add_parser("train-drafter", help="train a learned drafter on the target's own outputs",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", default="smollm2-135m", help="preset name, .gguf file or HF folder")
    p.add_argument("--kind", required=True, choices=KINDS)
    p.add_argument("--prompts", nargs="+", required=True, help="JSONL prompt files")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--out", required=True, help="output folder (data, checkpoints, drafter.json)")
    p.add_argument("--resume", action="store_true", help="continue from OUT's last checkpoint")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=0, help="warmup steps (0: 5%% of --steps)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--keep", type=int, default=3, help="checkpoints kept")
    p.add_argument("--seq-len", type=int, default=256, help="training sequence length")
    p.add_argument("--max-new-tokens", type=int, default=192, help="response tokens per prompt")
    p.add_argument("--num-prompts", type=int, default=None, help="use the first N prompts")
    p.add_argument("--gen-batch-size", type=int, default=16, help="batch of the data generation")
    p.add_argument("--gen-temperature", type=float, default=0.0)
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--depth", type=int, help="eagle3/mtp: training-time-test steps; medusa: heads")
    p.add_argument("--draft-vocab", type=int, help="eagle3: reduced draft vocabulary size")
    p.add_argument("--block-size", type=int, help="dflash/dspark: block size")
    p.add_argument("--draft-layers", type=int, help="dflash/dspark: draft decoder layers")
    p.set_defaults(func=cmd_train_drafter)


def head_options(args) -> dict:
    return {field: getattr(args, opt) for opt, field in HEAD_OPTIONS[args.kind].items()
            if getattr(args, opt) is not None}


def cmd_train_drafter(args) -> int:
    from pathlib import Path

    from specjax.models.hub import load_model
    from specjax.train.trainer import TrainConfig, prepare_data, train_drafter

    rows = [r for path in args.prompts for r in read_prompts(path)][: args.num_prompts]
    if not rows:
        raise InputError("no prompts")
    target = load_model(args.target, dtype=args.dtype)
    tok = target.tokenizer
    prompts = [tok.encode(r["prompt"]) if args.no_chat else tok.encode_chat(r["prompt"]) for r in rows]
    out = Path(args.out)
    data = prepare_data(target, prompts, out, seq_len=args.seq_len, max_new_tokens=args.max_new_tokens,
                        temperature=args.gen_temperature, seed=args.seed,
                        batch_size=args.gen_batch_size)
    tc = TrainConfig(steps=args.steps, batch_size=args.batch_size, learning_rate=args.lr,
                     warmup_steps=args.warmup, seed=args.seed, save_every=args.save_every,
                     keep=args.keep)
    _state, log = train_drafter(target, args.kind, data, out, tc, head_options=head_options(args),
                               resume=args.resume)
    if log:
        last = log[-1]
        print(f"{args.kind}: step {last['step']}, loss {last['loss']:.4f}, "
              f"{last['tokens']} tokens in {last['elapsed_s']:.1f} s -> {out}", file=sys.stderr)
    return 0
