"""``mlxspec train``: build a corpus, train heads (Medusa, EAGLE, MTP), a draft model or a DFlash or DSpark
drafter, and measure drafters.

One subcommand per module (``corpus``, ``medusa``, ``eagle``, ``draft``, ``mtp``, ``dflash``, ``dspark``,
``measure``), each with ``HELP``, ``DESCRIPTION``, ``add_flags(parser)`` and ``run(args) -> int``; the
training methods share their run flags, progress loop and evaluation line through ``shared``. Every training
command resumes when run again with the same settings.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from ..common import ArgumentParser, run_main
from . import corpus, dflash, draft, dspark, eagle, measure, medusa, mtp

#: Subcommands in the order ``--help`` lists them.
METHODS = {"medusa": medusa, "corpus": corpus, "eagle": eagle, "draft": draft, "mtp": mtp, "dflash": dflash,
           "dspark": dspark, "measure": measure}


def setup_arg_parser() -> argparse.ArgumentParser:
    """The ``mlxspec train`` parser: one subparser per method."""
    parser = ArgumentParser(prog="mlxspec train", description="Train draft heads for a target model.")
    sub = parser.add_subparsers(dest="method", required=True)
    for name, module in METHODS.items():
        module.add_flags(sub.add_parser(name, help=module.HELP, description=module.DESCRIPTION))
    return parser


def main(argv: list[str] | None = None, *, entry: bool = False) -> int:
    """Run ``mlxspec train``; returns the exit status (2 on user errors, printed as one line)."""
    argv = sys.argv[1:] if argv is None else list(argv)

    def run(args: argparse.Namespace) -> int:
        args.command = "mlxspec train " + shlex.join(argv)
        return METHODS[args.method].run(args)

    return run_main("train", setup_arg_parser(), run, argv, entry=entry)
