"""`specjax export-drafter`: write a trained drafter in an upstream Hugging Face layout.

    specjax export-drafter --format eagle3-hf runs/eagle3 exported/eagle3

SRC is a `specjax train-drafter` output (drafter.json + checkpoints; its latest checkpoint is
exported); OUT receives config.json and model.safetensors in the layout the format names
(`specjax.drafters.learned.checkpoint.export_drafter`). OUT loads back with
`--draft eagle3:OUT` and in the upstream projects that read that layout.
"""
from __future__ import annotations

import sys

from specjax.cli.options import add_subcommand, check_output_path
from specjax.drafters.learned.checkpoint import export_drafter
from specjax.drafters.learned.registry import upstream_formats
from specjax.models.hub import load_model


def add_parser(sub) -> None:
    formats = upstream_formats()
    p = add_subcommand(sub, "export-drafter",
                       "write a trained drafter in an upstream Hugging Face layout")
    p.add_argument("--format", required=True, choices=sorted(formats),
                   help="; ".join(f"{name}: {kind.name} heads" for name, kind in sorted(formats.items())))
    p.add_argument("--model", default=None,
                   help="the target the drafter was trained for; needed only when SRC's "
                        "drafter.json records no target config (runs of older versions)")
    p.add_argument("src", metavar="SRC", help="a `specjax train-drafter` output folder")
    p.add_argument("out", metavar="OUT", help="output folder (created; its files are replaced)")
    p.set_defaults(func=cmd_export_drafter)


def cmd_export_drafter(args) -> int:
    check_output_path(args.out, "OUT", folder=True)
    target_cfg = load_model(args.model).cfg if args.model else None
    out = export_drafter(args.src, args.out, args.format, target_cfg)
    print(f"{args.src} -> {out} ({args.format})", file=sys.stderr)
    return 0
