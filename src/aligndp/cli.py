"""`aligndp` / `python -m aligndp`: subcommands `train` and `layout`.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``. User errors (ValueError/TypeError) print one line and exit 2.
"""
from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {
    "train": ("aligndp.train", "train a GPT data-parallel (CPU demo on 2 gloo ranks by default)"),
    "layout": ("aligndp.layout_cli", "plan and show the flat buffer layout of a model"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aligndp", description="Data-parallel training where alignment is a contract.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        mod = importlib.import_module(module)
        mod.add_arguments(p)
        p.set_defaults(run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except (ValueError, TypeError) as e:
        print(f"aligndp {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
