"""Where a command writes: checked before the work starts, written whole (a temporary name, then a rename) or
not at all, and never lost when the final write fails (``mlxspec bench -o``)."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from ..runtime.files import written_whole


def check_output_file(path: str | Path, flag: str) -> Path:
    """Refuse, before any work, a file that could not be written: a folder, a missing or unwritable folder.

    Writability is probed by creating (and removing) a temporary file beside ``path``, so the answer is the
    filesystem's own (a read-only mount, permissions, quotas), not a guess from mode bits.

    Raises:
        ValueError: naming ``flag``, the path, the reason and the fix.
    """
    path = Path(path).expanduser()
    parent = path.parent
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a folder; name a file, e.g. {flag} {path / 'out.json'}")
    if not parent.exists():
        raise ValueError(
            f"{flag} {path}: the folder {parent} does not exist; create it (mkdir -p {parent}) or "
            "name a file in another folder"
        )
    if not parent.is_dir():
        raise ValueError(f"{flag} {path}: {parent} is not a folder; name a file in a folder")
    try:
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".mlxspec-probe-"):
            pass
    except OSError as e:
        raise ValueError(
            f"{flag} {path}: cannot write in {parent} ({e.strerror or e}); name a file in a folder "
            "you can write to"
        ) from None
    return path


def write_whole(path: str | Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path``, then rename it onto ``path``: ``path`` is never
    left half-written (a full disk fails the temporary file, which is removed).

    Raises:
        OSError: the write or the rename failed (``path`` is as it was).
    """
    with written_whole(path) as temporary:
        temporary.write_text(text)


def save_or_keep(path: str | Path, text: str) -> str | None:
    """Write ``text`` (finished results) to ``path``; if that fails, to a file in the temporary folder, and if
    that fails too, print it on stdout: finished measurements are never lost.

    Returns:
        str | None: ``None`` when ``path`` was written, else the one-line error naming where the results are.
    """
    path = Path(path).expanduser()
    try:
        write_whole(path, text)
        return None
    except OSError as e:
        failed = f"could not write {path} ({e.strerror or e})"
    spare = (
        Path(tempfile.gettempdir())
        / f"{path.stem}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}{path.suffix}"
    )
    try:
        write_whole(spare, text)
        return f"{failed}; the results are in {spare}"
    except OSError:
        print(text, flush=True)
        return f"{failed}, nor in {spare.parent}; the results are printed above"
