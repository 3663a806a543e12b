"""Files written whole: under a temporary name beside the target, unique to this process and thread, then
renamed onto it. A reader never sees half a file, a failed write leaves the target as it was, and two
processes filling one cache at once (two ranks on one machine, two servers started together, two test
workers) each write their own file: the last rename wins, and both are whole."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def written_whole(path: str | Path, suffix: str = ".part") -> Iterator[Path]:
    """A temporary path beside ``path`` to write to; renamed onto ``path`` when the block ends, removed if
    it raises.

    Args:
        path: The file to write (its folder must exist).
        suffix: The temporary file's ending (a writer that insists on one: ``".part.npz"``). Default:
            ``".part"``.

    Raises:
        OSError: the temporary file could not be made, or the rename failed (``path`` is as it was).
    """
    path = Path(path)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-", suffix=suffix)
    os.close(fd)
    try:
        yield Path(temporary)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
