"""`specjax train-drafter`: self-distill a prompt set with the target, train a learned drafter.

    specjax train-drafter --model smollm2-135m --kind eagle3 --prompts a.jsonl b.jsonl \
        --steps 2000 --batch-size 8 --out runs/eagle3 [--resume]

OUT holds the data, the orbax checkpoints and drafter.json (`specjax.train.trainer`); load the
result with `specjax generate --draft eagle3:OUT` (likewise every kind of
`specjax.drafters.learned.registry.KINDS`, whose records also declare the head options).
Registered by `specjax.cli.main.build_parser`; heavy imports happen inside the command.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from specjax.cli.options import (
    InputError,
    add_mesh_arg,
    add_model_args,
    add_renamed_option,
    add_subcommand,
    finite_float_above,
    int_at_least,
    mesh_shardings,
)
from specjax.drafters.learned.checkpoint import trained_folder_problem
from specjax.drafters.learned.kind import HeadOption
from specjax.drafters.learned.registry import KINDS, get_kind, make_head_config, option_flags
from specjax.models import hub
from specjax.prompt_io import read_prompts


def option_help(takers: list[tuple[str, HeadOption]]) -> str:
    """"eagle3/mtp: training-time-test steps; medusa: heads": the kinds taking a head option,
    grouped by what it means for them."""
    meanings: dict[str, list[str]] = {}
    for kind, option in takers:
        meanings.setdefault(option.help, []).append(kind)
    return "; ".join(f"{'/'.join(kinds)}: {meaning}" for meaning, kinds in meanings.items())


def add_head_options(p) -> None:
    """One `--FLAG N` per head option of the kinds (unset: the head config's default)."""
    for flag, takers in option_flags().items():
        minimum = max(option.minimum for _, option in takers)
        p.add_argument(f"--{flag}", type=int_at_least(minimum), help=option_help(takers))


def add_parser(sub) -> None:
    p = add_subcommand(sub, "train-drafter", "train a learned drafter on the target's own outputs")
    add_model_args(p)
    add_renamed_option(p, "--target", "--model", dest="model")
    p.add_argument("--kind", required=True, choices=list(KINDS), help="the drafter head to train")
    p.add_argument("--prompts", nargs="+", required=True, help="JSONL prompt files")
    p.add_argument("--steps", type=int_at_least(1), required=True, help="optimizer steps")
    p.add_argument("--batch-size", type=int_at_least(1), default=8, help="sequences per step")
    p.add_argument("--out", required=True, help="output folder (data, checkpoints, drafter.json); "
                   "must be empty or new unless --resume")
    p.add_argument("--resume", action="store_true", help="continue from OUT's last checkpoint")
    p.add_argument("--init-from", metavar="DRAFTER_DIR", default=None,
                   help="start from this trained drafter (a train-drafter OUT of the same --kind "
                        "and target shapes), e.g. to realign it after the target was fine-tuned; "
                        "its head config is kept")
    p.add_argument("--lr", type=finite_float_above(0, inclusive=False), default=3e-4,
                   help="peak learning rate (AdamW, warmup then cosine decay)")
    p.add_argument("--warmup", type=int_at_least(0), default=0,
                   help="warmup steps, below --steps (0: 5%% of --steps)")
    p.add_argument("--seed", type=int_at_least(0), default=0,
                   help="seed of the head's init, the batch order and the data's sampling")
    p.add_argument("--save-every", type=int_at_least(1), default=100,
                   help="checkpoint every N steps (and at the end)")
    p.add_argument("--keep", type=int_at_least(1), default=3, help="checkpoints kept")
    p.add_argument("--seq-len", type=int_at_least(2), default=256, help="training sequence length")
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=192,
                   help="response tokens per prompt")
    p.add_argument("--num-prompts", type=int_at_least(1), default=None,
                   help="use the first N prompts (default: all)")
    p.add_argument("--gen-batch-size", type=int_at_least(1), default=16,
                   help="batch of the data generation")
    p.add_argument("--gen-temperature", type=finite_float_above(0, inclusive=True), default=0.0,
                   help="sampling temperature of the data generation; 0 is greedy")
    p.add_argument("--no-chat", action="store_true",
                   help="encode prompts as plain text, without the model's chat template")
    add_mesh_arg(p)
    add_head_options(p)
    p.set_defaults(func=cmd_train_drafter)


def head_options(args) -> dict:
    """{head config field: value} of the head options given for --kind."""
    return {option.field: getattr(args, option.dest) for option in get_kind(args.kind).options
            if getattr(args, option.dest) is not None}


def check_options(args) -> None:
    """Checks across options (each option's own range is its argparse type's)."""
    own = {option.flag for option in get_kind(args.kind).options}
    given = [f"--{flag}" for flag in option_flags()
             if flag not in own and getattr(args, flag.replace("-", "_")) is not None]
    if given:
        raise InputError(f"{', '.join(given)} does not apply to --kind {args.kind}")
    if args.warmup >= args.steps:
        raise InputError(f"--warmup {args.warmup} must be below --steps {args.steps}")
    problem = args.init_from and trained_folder_problem(Path(args.init_from))
    if problem:
        raise InputError(f"--init-from {args.init_from}: {problem}")


def check_out_folder(out: Path, resume: bool) -> None:
    """OUT is (made) a writable folder, and empty unless resuming: checked before anything
    loads. A leftover staging folder of a killed run does not count (it is regenerated)."""

    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} is a file, not a folder: name a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        raise InputError(f"--out {out}: cannot write there ({e.strerror})") from None
    from specjax.train.trainer import STAGING_DIR  # optax + orbax: ~1.5 s other commands skip

    held = sorted(p.name for p in out.iterdir() if p.name != STAGING_DIR)
    if held and not resume:
        raise InputError(f"--out {out} is not empty (holds {', '.join(held[:4])}): pass --resume "
                         "to continue the run in it, or name another folder")


def check_against_target(args, cfg) -> None:
    """The head options make a head for the loaded target (e.g. --draft-vocab at most its
    vocabulary) and --seq-len fits its context, checked before the data is generated."""
    try:
        make_head_config(args.kind, cfg, **head_options(args))
    except ValueError as e:
        raise InputError(f"--kind {args.kind} for {cfg.name}: {e}") from None
    if args.seq_len > cfg.max_position_embeddings:
        raise InputError(f"--seq-len {args.seq_len} is longer than {cfg.name}'s context "
                         f"({cfg.max_position_embeddings} positions): pass at most that")


def check_init_from(args, cfg) -> None:
    """--init-from holds a drafter of --kind for this target's shapes (and the head options
    given, if any), checked before the data is generated."""
    from specjax.train.trainer import load_init  # optax + orbax: ~1.5 s other commands skip

    try:
        load_init(args.init_from, args.kind, cfg, head_options(args))
    except ValueError as e:
        raise InputError(f"--init-from {e}") from None


def cmd_train_drafter(args) -> int:
    from specjax.train.trainer import (  # optax + orbax: ~1.5 s other commands skip
        TrainConfig,
        prepare_data,
        train_drafter,
    )

    out = Path(args.out)
    check_options(args)
    check_out_folder(out, args.resume)
    rows = [r for path in args.prompts for r in read_prompts(path)][: args.num_prompts]
    if not rows:
        raise InputError("no prompts")
    mesh, shardings = mesh_shardings(args)
    target = hub.load_model(args.model, dtype=args.dtype, shardings=shardings,
                            quantize=args.quantize)
    check_against_target(args, target.cfg)
    if args.init_from is not None:
        check_init_from(args, target.cfg)
    tok = target.tokenizer
    prompts = [tok.encode(r["prompt"]) if args.no_chat else tok.encode_chat(r["prompt"]) for r in rows]
    data = prepare_data(target, prompts, out, seq_len=args.seq_len, max_new_tokens=args.max_new_tokens,
                        temperature=args.gen_temperature, seed=args.seed,
                        batch_size=args.gen_batch_size, mesh=mesh)
    tc = TrainConfig(steps=args.steps, batch_size=args.batch_size, learning_rate=args.lr,
                     warmup_steps=args.warmup, seed=args.seed, save_every=args.save_every,
                     keep=args.keep)
    _state, log = train_drafter(target, args.kind, data, out, tc, head_options=head_options(args),
                               resume=args.resume, mesh=mesh, init_from=args.init_from)
    if log:
        last = log[-1]
        print(f"{args.kind}: step {last['step']}, loss {last['loss']:.4f}, "
              f"{last['tokens']} tokens in {last['elapsed_s']:.1f} s -> {out}", file=sys.stderr)
    return 0
