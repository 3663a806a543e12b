"""Files written whole: under a temporary name beside the target, unique to this process and thread, then
renamed onto it. A reader never sees half a file, a failed write leaves the target as it was, and two
processes filling one cache at once (two ranks on one machine, two servers started together, two test
workers) each write their own file: the last rename wins, and both are whole."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def written_whole(path: str | Path, suffix: str = ".part") -> Iterator[Path]:
    """A temporary path beside ``path`` for the block to create and write (with the permissions any new file
    gets); renamed onto ``path`` when the block ends, removed if it raises.

    Args:
        path: The file to write (its folder must exist).
        suffix: The temporary file's ending (a writer that insists on one: ``".part.npz"``). Default:
            ``".part"``.

    Raises:
        OSError: the block did not create the file, or the rename failed (``path`` is as it was).
    """
    path = Path(path)
    temporary = path.with_name(f".{path.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}{suffix}")
    try:
        yield temporary
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
