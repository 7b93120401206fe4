"""Shared argument helpers of every CLI subcommand: option types, option groups, output checks,
the draft shape and dataset rows, all applied before any model loads.

The `type=` functions make argparse refuse a bad value with the option's name and exit 2
("argument --batch-size: must be an integer >= 1, got -1"); `check_output_path` refuses an
output the run could not write before the work starts. Later modules import these too.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from specjax.distributed import ProcessSpec, process_spec
from specjax.drafters.forced import is_forced
from specjax.drafters.registry import check_spec, make_drafter
from specjax.errors import InputError
from specjax.measure.bench import RunConfig
from specjax.measure.datasets import load_prompt_set, select_rows
from specjax.models.quant import QUANT_MODES
from specjax.options import AUTO_MAX_DRAFT, draft_choice
from specjax.progress import say
from specjax.schedule import load_schedule
from specjax.sharding import MeshSpec, as_mesh, loader_shardings, parse_mesh
from specjax.tree import chain, check_num_draft, load_tree


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` of every subcommand: each option's help ends with "(default: X)" when it has a
    default to show (not for required options, flags that default to off, or options whose
    absence the help text itself explains)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.required or action.default is None or action.default is False or "%(default)" in text:
            return text
        return super()._get_help_string(action)


def add_subcommand(sub, name: str, summary: str) -> argparse.ArgumentParser:
    """A subcommand's parser, formatted by HelpFormatter; `summary` is its line in
    `specjax --help` and the description of `specjax NAME --help`."""
    return sub.add_parser(name, help=summary, description=summary, formatter_class=HelpFormatter)


class RenamedOption(argparse.Action):
    """A former spelling of an option, kept so old commands still run: hidden from `--help`,
    it stores into the new option's dest and prints a one-line note naming the new spelling."""

    def __init__(self, option_strings, dest, renamed_to: str, **kwargs):
        super().__init__(option_strings, dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS,
                         **kwargs)
        self.renamed_to = renamed_to

    def __call__(self, parser, namespace, values, option_string=None):
        say(f"specjax: note: {option_string} is now {self.renamed_to}")
        setattr(namespace, self.dest, values)


def add_renamed_option(p: argparse.ArgumentParser, old: str, new: str, dest: str) -> None:
    """Accepts `old` as a hidden alias of the option `new` (whose dest is `dest`)."""
    p.add_argument(old, dest=dest, action=RenamedOption, renamed_to=new, metavar=dest.upper())


def _parsed(text: str, kind: type):
    try:
        return kind(text)
    except ValueError:
        noun = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"expected {noun}, got {text!r}") from None


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= `low`."""
    def parse(text: str) -> int:
        value = _parsed(text, int)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {value}")
        return value

    parse.__name__ = f"int_at_least_{low}"
    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def finite_float(text: str) -> float:
    """An argparse type: a finite number (no nan, no inf)."""
    value = _parsed(text, float)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def finite_float_above(low: float, *, inclusive: bool) -> Callable[[str], float]:
    """An argparse type: a finite number >= low (inclusive) or > low."""
    bound = f"{'>=' if inclusive else '>'} {low:g}"

    def parse(text: str) -> float:
        value = finite_float(text)
        if not (value >= low if inclusive else value > low):
            raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {text}")
        return value

    return parse


def non_negative_float(text: str) -> float:
    value = finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def probability(text: str) -> float:
    """An argparse type: a number in (0, 1] (top-p)."""
    value = finite_float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def num_draft_or_auto(text: str) -> int | str:
    """An argparse type: "auto" (the draft shape picked every step) or a draft length."""
    return "auto" if text.strip() == "auto" else num_draft(text)


def num_draft(text: str) -> int:
    """An argparse type: a draft length in [1, MAX_DRAFT_NODES] (`specjax.tree.check_num_draft`)."""
    try:
        return check_num_draft(_parsed(text, int), "a draft length")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def seed(text: str) -> int:
    """An argparse type: a PRNG seed, an integer in [0, 2**32)."""
    value = _parsed(text, int)
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 2**32), got {value}")
    return value


def non_empty_text(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def check_output_path(path: str | os.PathLike, option: str, folder: bool = False) -> None:
    """Raises InputError naming `option` and `path` when a run could not write its output there:
    the parent folder is missing, the path is a folder where a file is wanted (or the reverse),
    or the file / folder refuses writes. Creates nothing that outlives the check."""
    target = Path(path)
    if target.exists() and target.is_dir() != folder:
        raise InputError(f"{option} {path}: {'is a folder' if target.is_dir() else 'is not a folder'}")
    where = target if folder and target.is_dir() else target.parent
    if not where.is_dir():
        raise InputError(f"{option} {path}: folder {where} does not exist")
    try:
        if target.exists() and not folder:
            # O_NONBLOCK: a FIFO without a reader fails here instead of hanging
            os.close(os.open(target, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK))
        else:
            tempfile.TemporaryFile(dir=where).close()
    except OSError as e:
        raise InputError(f"{option} {path}: cannot write there ({e.strerror})") from None


def add_process_args(p: argparse.ArgumentParser) -> None:
    """--coordinator, --num-processes, --process-id, --coordinator-timeout: one job over several
    processes (`specjax.distributed`)."""
    group = p.add_argument_group("several processes (jax.distributed)")
    group.add_argument("--coordinator", metavar="HOST:PORT",
                       help="run as one of several processes: process 0 serves HOST:PORT, every "
                            "process names it ('auto': JAX's cluster detection, e.g. SLURM or a "
                            "TPU pod slice; default: $JAX_COORDINATOR_ADDRESS, else one process)")
    group.add_argument("--num-processes", type=int_at_least(1), metavar="N",
                       help="processes in the job (default: $JAX_NUM_PROCESSES)")
    group.add_argument("--process-id", type=int_at_least(0), metavar="I",
                       help="this process, 0..N-1 (default: $JAX_PROCESS_ID)")
    group.add_argument("--coordinator-timeout", type=int_at_least(1), default=120, metavar="S",
                       help="seconds to wait for the coordinator and the other processes")


def process_spec_of(args) -> ProcessSpec:
    """The checked ProcessSpec of add_process_args' options (and the environment)."""
    return process_spec(args.coordinator, args.num_processes, args.process_id,
                        args.coordinator_timeout)


#: the chain length of --draft without --num-draft / --tree
DEFAULT_NUM_DRAFT = 4

def mesh_spec(text: str) -> MeshSpec:
    """An argparse type: a device mesh "dp=N,tp=M" / "auto" that fits the devices there are."""
    try:
        return parse_mesh(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_mesh_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mesh", type=mesh_spec, default=None,
                   help="spread the job over this host's devices: 'auto' (every device on dp: "
                        "rows split), 'dp=N,tp=M' (rows over N, weights and KV heads over M; "
                        "N*M = the device count) (default: none, one device)")


def mesh_shardings(args):
    """(the --mesh Mesh or None, the loaders' `shardings` for it)."""
    mesh = as_mesh(args.mesh)
    return mesh, loader_shardings(mesh)


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m",
                   help="target model: a preset name, a .gguf file or a Hugging Face folder")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="dtype of the weights and the compute")
    p.add_argument("--quantize", default=None, choices=list(QUANT_MODES),
                   help="weight-only quantization of the decoder layers' kernels (qwix): int8 "
                        "per channel, int4 in blocks of 32, fp8 e4m3 where the backend runs it "
                        "(default: off); draft models follow the target's")

DRAFTER_HELP = ("drafter: ngram | ngram:NMIN-NMAX | suffix | layerskip:K | model:NAME_OR_PATH | "
                "eagle3|mtp|medusa|dflash|dspark:DIR (trained or upstream HF folder) | "
                "forced:PROFILE (measurement only)")

def add_draft_args(p: argparse.ArgumentParser, required: bool = False) -> None:
    p.add_argument("--draft", default=None, required=required,
                   help=DRAFTER_HELP + ("" if required else " (default: none, plain decoding)"))
    group = p.add_mutually_exclusive_group()
    group.add_argument("--num-draft", type=num_draft_or_auto, default=None,
                       help="draft a chain of D tokens per step, or 'auto': the shape with the "
                            "highest predicted tokens/s, picked every step from this device's "
                            "step costs and the job's acceptance (default: auto when greedy, for "
                            f"every drafter but forced; {DEFAULT_NUM_DRAFT} when sampling)")
    group.add_argument("--tree", default=None,
                       help="draft a tree instead of a chain: a preset name (configs/trees/) or "
                            "a YAML file (default: a chain)")

def add_sampling_args(p: argparse.ArgumentParser,
                      batch_size_help: str = "prompts per batch") -> None:
    p.add_argument("--max-new-tokens", type=positive_int, default=128,
                   help="new tokens per prompt at most")
    p.add_argument("--temperature", type=non_negative_float, default=0.0,
                   help="sampling temperature; 0 is greedy")
    p.add_argument("--top-k", type=positive_int, default=None,
                   help="sample among the K most likely tokens (default: off)")
    p.add_argument("--top-p", type=probability, default=None,
                   help="sample among the most likely tokens whose probabilities sum to P, "
                        "in (0, 1] (default: off)")
    p.add_argument("--seed", type=seed, default=0, help="PRNG seed of the sampling, in [0, 2**32)")
    p.add_argument("--batch-size", type=positive_int, default=8, help=batch_size_help)
    p.add_argument("--no-chat", action="store_true",
                   help="encode prompts as plain text, without the model's chat template")
    p.add_argument("--stop", action="append", type=non_empty_text, default=None,
                   help="stop when the completion contains this text (repeatable; default: none)")

def check_draft_spec(spec: str, option: str = "--draft") -> None:
    """An InputError unless `spec` starts with a registered drafter name (checked before any
    model loads; the drafter's own argument is checked when it is built)."""

    try:
        check_spec(spec)
    except ValueError as e:
        raise InputError(f"{option} {spec!r}: {e}") from None

def draft_shape(args):
    """The draft tree of --tree / --num-draft (a chain of DEFAULT_NUM_DRAFT when neither is given),
    or None without --draft; loaded before any model so a bad value fails first."""

    if not args.draft:
        if args.num_draft is not None or args.tree:
            raise InputError("--num-draft/--tree need --draft")
        return None
    check_draft_spec(args.draft)
    if args.tree:
        return load_tree(args.tree)
    if draft_auto(args):
        return chain(AUTO_MAX_DRAFT)
    return chain(DEFAULT_NUM_DRAFT if args.num_draft is None else args.num_draft)


def draft_auto(args) -> bool:
    """Whether --draft runs with --num-draft auto (given, or the default of its kind); an
    InputError for auto with a drafter kind that cannot switch shapes."""
    if not args.draft or args.tree:
        return False
    try:
        return draft_choice(args.draft, args.num_draft, sampled=(getattr(args, "temperature", 0) or 0) > 0).auto
    except ValueError as e:
        raise InputError(f"--num-draft auto: {e}") from None

def make_draft(args, tree, model):
    """(drafter, drafter params) for --draft with the draft tree `tree`, or (None, None)."""
    if tree is None:
        return None, None

    return make_drafter(args.draft, tree=tree, target=model, dtype=args.dtype, auto=draft_auto(args))

def load_tuned(args):
    """The --tuned schedule (or None), read and checked before any model loads."""
    if not args.tuned:
        return None

    schedule = load_schedule(args.tuned)
    if not args.draft:
        if not schedule.draft:
            raise InputError(f"--tuned {args.tuned}: the schedule names no drafter; pass --draft")
        check_draft_spec(schedule.draft, f"--tuned {args.tuned}: draft")
    return schedule


DATASET_HELP = ("prompt set: a JSONL file (Spec-Bench/MT-bench rows or {'prompt'} rows), "
                "mtbench | humaneval | gsm8k (when their packages are installed), "
                "or synthetic[:N[:LEN]]")

#: output options of the measurement commands: dest -> (option, is a folder)
OUTPUT_OPTIONS = {"out": ("--out", False), "report": ("--report", False), "plots": ("--plots", True)}

def int_list(text: str | None, option: str) -> tuple[int, ...] | None:
    """Comma-separated integers >= 1 (None when not given); an InputError names `option`."""
    if not text:
        return None
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise InputError(f"{option}: expected comma-separated integers >= 1, got {text!r}")
    return values

def draft_length_list(text: str | None, option: str) -> tuple[int, ...] | None:
    """int_list, each a draft length in [1, MAX_DRAFT_NODES]."""

    values = int_list(text, option)
    return values and tuple(check_num_draft(d, option) for d in values)

def check_outputs(args) -> None:
    """Each output option the command was given must be writable before the work starts."""
    for dest, (option, folder) in OUTPUT_OPTIONS.items():
        if getattr(args, dest, None):
            check_output_path(getattr(args, dest), option, folder=folder)

@contextlib.contextmanager
def writing_output(path: str):
    """Turns an OSError while writing the output `path` (a full disk, ...) into an InputError
    naming it."""
    try:
        yield
    except OSError as e:
        raise InputError(f"cannot write {path}: {e.strerror or e}") from None

def name_list(text: str | None) -> tuple[str, ...]:
    return tuple(x for x in (text or "").split(",") if x)

def dataset_rows(args):
    """The --dataset rows kept by --categories / --per-category; an InputError when none are."""

    rows = select_rows(load_prompt_set(args.dataset), name_list(args.categories) or None, args.per_category)
    if not rows:
        raise InputError(f"--dataset {args.dataset}: no prompts to run")
    return rows

def run_config(args, model, batch_size: int):
    tok = model.tokenizer
    stops = tok.stop_sequences(args.stop) if tok is not None and args.stop else ()
    return RunConfig(
        max_new_tokens=args.max_new_tokens, batch_size=batch_size, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop_token_seqs=tuple(stops),
        ignore_eos=args.ignore_eos or is_forced(args.draft), mesh=args.mesh,
    )

def add_dataset_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset", required=True, help=DATASET_HELP)
    p.add_argument("--categories", help="comma-separated categories to keep (default: all)")
    p.add_argument("--per-category", type=positive_int, default=None,
                   help="first N prompts of each category (default: all)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="rows run to --max-new-tokens (implied by --draft forced:...)")
