"""`aligndp` / `python -m aligndp`: subcommands `train`, `layout` and `rehearse`.

A subcommand is one :class:`Subcommand` row in :data:`SUBCOMMANDS`: a module whose
``add_arguments(parser)`` declares its flags and imports no torch (so ``aligndp --help``, ``aligndp
train --help`` and a mistyped flag answer at once), and a module whose ``run(args) -> int`` does
the work, imported only when the subcommand runs. Every user error is one line on stderr and exit
2, with no usage dump: a bad flag names the closest real one ("did you mean"), and ValueError,
TypeError and OSError (a file that cannot be written) from ``run`` print their message. Ctrl-C
prints one line and exits 130.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib
import re
import sys

from aligndp.models.presets import describe_presets

__all__ = ["SUBCOMMANDS", "Subcommand", "build_parser", "main"]


@dataclasses.dataclass(frozen=True)
class Subcommand:
    arguments: str
    """Module with ``add_arguments(parser)``; it must not import torch (tests pin that)."""
    runner: str
    """Module with ``run(args: argparse.Namespace) -> int``, imported when the command runs."""
    help: str


SUBCOMMANDS = {
    "train": Subcommand(
        "aligndp.app.train_config",
        "aligndp.app.train",
        "train a GPT data-parallel (CPU demo on 2 gloo ranks by default)",
    ),
    "layout": Subcommand(
        "aligndp.app.layout_args",
        "aligndp.app.layout_cli",
        "plan and show the flat buffer layout of a model (the demo's by default)",
    ),
    "rehearse": Subcommand(
        "aligndp.app.rehearse_cli",
        "aligndp.app.rehearse_cli",
        "play rank r of an N-rank job on one device: memory, step time, collectives",
    ),
}


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line that names the closest valid spelling."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {suggest(self, message)} (see {self.prog} --help)\n")


def suggest(parser: argparse.ArgumentParser, message: str) -> str:
    """``message`` with ``; did you mean --steps?`` for a mistyped flag or choice."""
    unknown = re.match(r"unrecognized arguments: (.*)", message)
    if unknown:
        flags = [s for a in parser._actions for s in a.option_strings if s.startswith("--")]
        for word in unknown.group(1).split():
            close = difflib.get_close_matches(word.split("=")[0], flags, n=1, cutoff=0.6)
            if word.startswith("-") and close:
                return f"{message}; did you mean {close[0]}?"
        return message
    choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
    if choice:
        options = [c.strip(" '\"") for c in choice.group(2).split(",")]
        close = difflib.get_close_matches(choice.group(1), options, n=1, cutoff=0.6)
        if close:
            return f"{message}; did you mean {close[0]}?"
    return message


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The ``aligndp`` parser and each subcommand's (none of them imports torch)."""
    parser = Parser(
        prog="aligndp",
        description="Data-parallel training where alignment is a contract.",
        epilog=f"GPT presets (--preset): {describe_presets()}. "
        "Run 'aligndp COMMAND --help' for a command's options.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parsers = {}
    for name, command in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=command.help, description=command.help)
        importlib.import_module(command.arguments).add_arguments(p)
        parsers[name] = p
    return parser, parsers


def main(argv: list[str] | None = None) -> int:
    parser, parsers = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # name the subcommand's own flags, not the top-level usage
        parsers[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        run = importlib.import_module(SUBCOMMANDS[args.command].runner).run
        return int(run(args) or 0)
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
