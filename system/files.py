"""Durable files: what a checkpoint needs to survive a crash of the machine, not just the
process."""
from __future__ import annotations

import os


def fsync_path(path: str) -> None:
    """Flush a file's data, or a directory's entries, to disk (a rename is only durable once
    its parent directory is fsynced; a checkpoint only once every file in it is)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
