"""The `specjax` command: one parser with a subcommand per module of this package, and one
error path (every expected failure is one `specjax: error:` line and exit status 2)."""
from __future__ import annotations

import argparse
import importlib.metadata
import sys
from collections.abc import Sequence

from specjax import __version__
from specjax.cli import bench, export, generate, merge, profile, train, tune
from specjax.cli.options import HelpFormatter, add_process_args, process_spec_of
from specjax.compile_cache import use_compile_cache
from specjax.distributed import initialize

#: the subcommand modules, each with add_parser(subparsers), in the order `--help` lists them
SUBCOMMANDS = (generate, bench, profile, tune, train, export, merge)
#: the subcommands one job of several processes runs (`specjax.distributed`)
PROCESS_COMMANDS = ("generate",)


def fail(message: str) -> int:
    """Prints `message` as one `specjax: error:` line; returns the exit status of a user error."""
    print(f"specjax: error: {' '.join(message.split())}", file=sys.stderr)
    return 2


def version() -> str:
    """The installed package's version (importlib.metadata), or the source tree's when specjax
    runs without being installed."""
    try:
        return importlib.metadata.version("specjax")
    except importlib.metadata.PackageNotFoundError:
        return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specjax", description="Speculative decoding in JAX.",
                                     formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}",
                        help="print the version of specjax and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in SUBCOMMANDS:
        module.add_parser(sub)
    for command in sub.choices.values():
        command.add_argument("--no-compile-cache", action="store_true",
                             help="compile every program anew: no persistent compilation cache "
                                  "(default: compiled programs are kept in $SPECJAX_CACHE/compile; "
                                  "SPECJAX_COMPILE_CACHE=0 also turns it off)")
    return parser


def start_processes(argv: Sequence[str] | None) -> None:
    """Joins the job's other processes (`specjax.distributed.initialize`) when the command line
    or the environment names a coordinator; before anything touches a device."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in PROCESS_COMMANDS:
        return
    parser = argparse.ArgumentParser(add_help=False)
    add_process_args(parser)
    known, _ = parser.parse_known_args(argv)
    initialize(process_spec_of(known))


def main(argv: Sequence[str] | None = None) -> int:
    """Runs a subcommand. Every expected failure (InputError, PromptError and the other
    ValueErrors of the checks, an OSError on a named file) ends as one error line and exit
    status 2; anything else is a bug and keeps its traceback."""
    try:  # before argparse: checking --mesh counts devices, which makes the backend
        start_processes(argv)
    except ValueError as e:
        return fail(str(e))
    args = build_parser().parse_args(argv)
    if getattr(args, "resume", False) and not args.out:
        return fail("--resume needs --out")
    use_compile_cache(not args.no_compile_cache)
    try:
        return args.func(args)
    except ValueError as e:
        return fail(str(e))
    except OSError as e:
        if e.filename is None:
            raise
        return fail(f"{e.filename}: {e.strerror or e}")


if __name__ == "__main__":
    sys.exit(main())
