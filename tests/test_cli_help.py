"""The command line's surface: every option has help and shows its default, `--version`, the
renamed options still accepted, progress bars only on a terminal."""
from __future__ import annotations

import argparse
import importlib.metadata
import io
import re
import shlex
from pathlib import Path

import pytest

from specjax.cli import build_parser, main
from specjax.cli.options import RenamedOption
from specjax.progress import progress_bar


def subcommand_parsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def flat(text: str) -> str:
    return " ".join(text.split())


def test_every_subcommand_is_listed():
    assert {"generate", "bench", "profile", "tune", "train-drafter"} <= set(subcommand_parsers())


@pytest.mark.parametrize("name", sorted(subcommand_parsers()))
def test_every_option_has_help_and_shows_its_default(name):
    parser = subcommand_parsers()[name]
    shown = flat(parser.format_help())
    for action in parser._actions:
        if not action.option_strings:
            continue
        option = action.option_strings[0]
        if action.help == argparse.SUPPRESS:
            assert isinstance(action, RenamedOption), f"{name} {option}: hidden but not a renamed option"
            continue
        assert action.help and action.help.strip(), f"{name} {option} has no help text"
        if action.default is not None and action.default is not False and not action.required \
                and action.default != argparse.SUPPRESS:
            assert f"(default: {action.default})" in shown, f"{name} {option}: default not shown"


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.strip() == f"specjax {importlib.metadata.version('specjax')}"


@pytest.mark.parametrize("argv,dest,value", [
    (["train-drafter", "--target", "m", "--kind", "eagle3", "--prompts", "p", "--steps", "1",
      "--out", "o"], "model", "m"),
    (["bench", "--draft", "ngram", "--dataset", "d", "--json", "r.json"], "out", "r.json"),
    (["profile", "--json", "p.json"], "out", "p.json"),
    (["tune", "--draft", "ngram", "--dataset", "d", "--json", "r.json"], "report", "r.json"),
])
def test_renamed_options_still_run_with_a_note(argv, dest, value, capsys):
    args = build_parser().parse_args(argv)
    assert getattr(args, dest) == value
    old = next(a for a in argv if a in ("--target", "--json"))
    assert f"specjax: note: {old} is now --" in capsys.readouterr().err


def test_new_option_names():
    parse = build_parser().parse_args
    assert parse(["train-drafter", "--model", "m", "--kind", "mtp", "--prompts", "p", "--steps",
                  "1", "--out", "o"]).model == "m"
    assert parse(["train-drafter", "--kind", "mtp", "--prompts", "p", "--steps", "1",
                  "--out", "o"]).model == "smollm2-135m"
    assert parse(["bench", "--draft", "ngram", "--dataset", "d", "--out", "r.json"]).out == "r.json"
    assert parse(["profile", "--out", "p.json"]).out == "p.json"
    tune = parse(["tune", "--draft", "ngram", "--dataset", "d", "--out", "s.yaml", "--report", "r.json"])
    assert (tune.out, tune.report) == ("s.yaml", "r.json")
    for name, parser in subcommand_parsers().items():
        assert "--json" not in parser.format_help() and "--target" not in parser.format_help(), name


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def bar_output(stream, monkeypatch, **options) -> tuple[bool, str]:
    """(whether the bar was on, what it wrote) for a progress bar of 2 steps on `stream`."""
    monkeypatch.setattr("sys.stderr", stream)
    with progress_bar(total=2, desc="x", **options) as bar:
        bar.update(2)
        shown = not bar.disable  # close() sets disable
    return shown, stream.getvalue()


def test_progress_bars_show_on_a_terminal_only(monkeypatch):
    assert bar_output(io.StringIO(), monkeypatch) == (False, "")
    shown, text = bar_output(Terminal(), monkeypatch)
    assert shown and "2/2" in text
    assert bar_output(Terminal(), monkeypatch, enabled=False) == (False, "")


ROOT = Path(__file__).resolve().parents[1]


def documented_commands() -> list[tuple[str, str]]:
    """(file, command) for each `specjax ...` line of a bash block in the README and docs/,
    continuation lines joined, comments and bracketed optional parts dropped (lines that
    abbreviate with "..." are left out)."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in re.findall(r"```bash\n(.*?)```", path.read_text(encoding="utf-8"), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                command = re.sub(r"\[[^\]]*\]", "", line.split(" # ")[0]).strip()
                if command.startswith("specjax ") and "..." not in command:
                    found.append((path.name, command))
    return found


def test_every_subcommand_is_documented_in_the_readme():
    readme = {shlex.split(c)[1] for f, c in documented_commands() if f == "README.md"}
    assert set(subcommand_parsers()) <= readme


@pytest.mark.parametrize("where,command", documented_commands())
def test_documented_commands_parse(where, command, capsys):
    try:
        build_parser().parse_args(shlex.split(command)[1:])
    except SystemExit:
        pytest.fail(f"{where}: `{command}` does not parse: {capsys.readouterr().err}")
