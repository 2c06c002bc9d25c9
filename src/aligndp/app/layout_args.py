"""The flags of ``aligndp layout``, in the vocabulary of ``aligndp train`` (``--nproc``,
``--sharding none|zero1``, ``--optimizer``); the old ``--dp`` and ``--mode`` are refused naming
the new spelling. Imports no torch: ``aligndp layout --help`` answers at once; the planning lives
in ``layout_cli.py``."""

from __future__ import annotations

import argparse
import typing

from aligndp.app.train_config import Optimizer, Sharding

__all__ = ["RENAMED", "Renamed", "add_arguments"]

RENAMED = {
    "--dp": "--nproc N (the rank count, as aligndp train counts it)",
    "--mode": "--sharding none|zero1 (replicated -> none, sharded -> zero1; layerwise -> zero1 "
    "with --optimizer muon)",
}
"""Old ``aligndp layout`` flags and what to write instead."""


class Renamed(argparse.Action):
    """A flag that was renamed (a key of :data:`RENAMED`): using it is a one-line error naming
    the new one; ``aligndp rehearse`` refuses ``--dp`` with it too."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs="?", help=argparse.SUPPRESS)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is now {RENAMED[option_string]}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``aligndp layout``; each maps to one field of ``layout_cli.LayoutOptions``."""
    source = parser.add_argument_group("params (at most one; neither: --preset demo)")
    source.add_argument(
        "--preset",
        help="GPT preset, as aligndp train --preset (its help lists them with their sizes)",
    )
    source.add_argument(
        "--shapes",
        help="comma-separated shapes in registration order, e.g. '768x2304,2304,50257x768'",
    )
    parser.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="ranks of the job, all replicas together, as aligndp train --nproc (default 1)",
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="replicas of the job, as aligndp train --replicas: the plan is made for one "
        "replica's --nproc / --replicas ranks (the shard group), and every replica holds it "
        "(default 1: one flat group)",
    )
    parser.add_argument(
        "--sharding",
        choices=typing.get_args(Sharding),
        default="none",
        help="as aligndp train --sharding: none (replicated buffers, all-reduce) or zero1 "
        "(optimizer state sharded: a sharded buffer, and with --optimizer muon a layer-wise one "
        "for the hidden matrices) (default none)",
    )
    parser.add_argument(
        "--optimizer",
        choices=typing.get_args(Optimizer),
        default="adamw",
        help="as aligndp train --optimizer: muon routes hidden matrices to Muon as parallelize() "
        "does (default adamw)",
    )
    parser.add_argument(
        "--wgrad",
        default="none",
        help="wgrad recipe whose alignment requirement the layout must meet, as aligndp train "
        "--wgrad (default none)",
    )
    parser.add_argument(
        "--capability",
        default="9.0",
        help="CUDA compute capability (major.minor) the --wgrad recipe's layer rule is judged "
        "for, or 'cpu' (default 9.0: H100/H200)",
    )
    parser.add_argument(
        "--bucket-numel",
        type=int,
        default=None,
        help="elements per bucket (default: parallelize()'s)",
    )
    parser.add_argument(
        "--dtype", choices=("bf16", "fp32"), default="fp32", help="param dtype (default fp32)"
    )
    parser.add_argument(
        "--grad-dtype",
        choices=("bf16", "fp32"),
        default=None,
        help="grad dtype (default: param dtype)",
    )
    parser.add_argument(
        "--start-alignment",
        type=int,
        default=None,
        help="param start alignment in elements (default: parallelize()'s); a wgrad "
        "requirement may raise it",
    )
    parser.add_argument(
        "--json", action="store_true", help="print the layouts as JSON instead of a table"
    )
    parser.add_argument("--png", metavar="FILE", help="also draw the layouts into this PNG")
    for old in RENAMED:
        parser.add_argument(old, action=Renamed)
