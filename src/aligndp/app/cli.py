"""`aligndp` / `python -m aligndp`: subcommands `train`, `layout` and `rehearse`.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``. User errors (ValueError/TypeError) and OSErrors (a file that cannot be
written) print one line and exit 2; Ctrl-C prints one line and exits 130.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {
    "train": (
        "aligndp.app.train",
        "train a GPT data-parallel (CPU demo on 2 gloo ranks by default)",
    ),
    "layout": ("aligndp.app.layout_cli", "plan and show the flat buffer layout of a model"),
    "rehearse": (
        "aligndp.app.rehearse_cli",
        "play rank r of a D-rank job on one device: memory, step time, collectives",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="aligndp", description="Data-parallel training where alignment is a contract."
    )
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
    except (ValueError, TypeError, OSError) as e:
        print(f"aligndp {args.command}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"aligndp {args.command}: interrupted", file=sys.stderr)
        return 130


def _one_line(e: BaseException) -> str:
    """The message of ``e`` on one line (an OSError without its own words gets its type's)."""
    text = " ".join(str(e).split())
    return text or type(e).__name__


if __name__ == "__main__":
    sys.exit(main())
