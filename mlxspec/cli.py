"""The ``mlxspec`` command: dispatches to one subcommand module, imported only when named."""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS = {
    "generate": ("mlxspec.commands.generate", "generate text with speculative decoding"),
    "chat": ("mlxspec.commands.chat", "terminal chat that shows speculation as it happens"),
    "train": ("mlxspec.commands.train", "build a corpus; train Medusa, EAGLE, DFlash or MTP heads or a draft model; measure drafters"),
    "verify": ("mlxspec.commands.verify", "check that speculation samples exactly as the target (a G-test)"),
    "bench": ("mlxspec.commands.bench", "speed of every drafter against plain decoding (and mlx-lm's speculative decoding) here"),
    "convert": ("mlxspec.commands.convert", "write any model spec (GGUF, named model, folder) as an mlx-lm folder"),
}


def _usage() -> str:
    lines = ["usage: mlxspec <command> [options]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    lines += ["", "Run 'mlxspec <command> --help' for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``mlxspec`` console script and ``python -m mlxspec``.

    Returns:
        int: The process exit status.
    """
    entry = argv is None  # the process's own command line: a subcommand may re-run itself (OpenBLAS)
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"mlxspec: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    return module.main(rest, entry=entry)
