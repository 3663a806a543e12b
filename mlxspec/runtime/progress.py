"""Progress bars for long work (calibration, loading a big GGUF): tqdm on standard error, never stdout.

A bar is drawn only when standard error is the process's own terminal: not in a pipe or a log file,
not under pytest's capture, and not inside the chat app (Textual replaces ``sys.stderr`` while it
owns the screen, and the engine thread must not write there).
"""

from __future__ import annotations

import sys

from tqdm import tqdm

#: Seconds before a bar appears, so quick work stays silent.
DEFAULT_DELAY_S = 1.0


def progress_bar(total: int, desc: str, unit: str = "it", *, delay_s: float = DEFAULT_DELAY_S) -> tqdm:
    """A tqdm bar on stderr that disappears when done; disabled unless stderr is the real terminal.

    Args:
        total: Steps the work takes.
        desc: What is being done, e.g. ``"mlxspec: measuring the verify cost"``.
        unit: What a step is. Default: ``"it"``.
        delay_s: Seconds before the bar shows. Default: ``1.0``.

    Returns:
        tqdm: Use as a context manager; ``update(n)`` after each step.
    """
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False, delay=delay_s,
                disable=not shows_progress())


def shows_progress() -> bool:
    """Whether progress bars are drawn: stderr is the process's own stderr and a terminal."""
    stream = sys.stderr
    return stream is not None and stream is sys.__stderr__ and stream.isatty()
