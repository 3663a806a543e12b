"""The ``mlxspec`` command: dispatches to one subcommand module, imported only when named."""

from __future__ import annotations

import difflib
import importlib
import platform
import sys
from importlib.metadata import PackageNotFoundError, version

SUBCOMMANDS = {
    "generate": ("mlxspec.commands.generate", "generate text with speculative decoding"),
    "chat": ("mlxspec.commands.chat", "terminal chat that shows speculation as it happens"),
    "train": (
        "mlxspec.commands.train",
        "build a corpus; train a draft model or Medusa, EAGLE, MTP, DFlash or DSpark drafters; measure "
        "drafters",
    ),
    "verify": ("mlxspec.commands.verify", "check that speculation samples exactly as the target (a G-test)"),
    "bench": (
        "mlxspec.commands.bench",
        "speed of every drafter against plain decoding (and mlx-lm's speculative decoding) here",
    ),
    "convert": (
        "mlxspec.commands.convert",
        "write any model spec (GGUF, named model, folder) as an mlx-lm folder",
    ),
    "serve": (
        "mlxspec.commands.serve",
        "OpenAI- and Anthropic-compatible local server (pip install 'mlxspec[serve]')",
    ),
}


def _usage() -> str:
    lines = ["usage: mlxspec <command> [options]", "       mlxspec --version", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    lines += ["", "Run 'mlxspec <command> --help' for a command's options."]
    return "\n".join(lines)


def _version() -> str:
    """``mlxspec 0.1.0 (mlx 0.32.4, mlx-lm 0.29.1, Python 3.12.3)``, from the installed packages' metadata."""
    def of(package: str) -> str:
        try:
            return version(package)
        except PackageNotFoundError:
            return "not installed"

    python = platform.python_version()
    return f"mlxspec {of('mlxspec')} (mlx {of('mlx')}, mlx-lm {of('mlx-lm')}, Python {python})"


def _unknown(name: str) -> str:
    """One line naming the unknown command and the fix."""
    if name.startswith("-"):
        return (f"mlxspec: error: {name} comes after a command, as in 'mlxspec generate {name} ...'; "
                f"choose one of {', '.join(SUBCOMMANDS)} (run 'mlxspec --help')")
    close = difflib.get_close_matches(name, SUBCOMMANDS, n=1)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return (f"mlxspec: error: unknown command {name!r}; {hint}choose one of {', '.join(SUBCOMMANDS)} "
            "(run 'mlxspec --help')")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``mlxspec`` console script and ``python -m mlxspec``.

    Returns:
        int: The process exit status: 2 for no command or an unknown one (one line on stderr), 130
        for Ctrl+C while the command's modules import.
    """
    entry = argv is None  # the process's own command line: a subcommand may re-run itself (OpenBLAS)
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(_version())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(_unknown(name), file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(SUBCOMMANDS[name][0])
    except KeyboardInterrupt:  # Ctrl+C in the seconds its modules import (mlx-lm, transformers)
        print("mlxspec: interrupted (Ctrl+C) while starting", file=sys.stderr)
        return 130
    return module.main(rest, entry=entry)
