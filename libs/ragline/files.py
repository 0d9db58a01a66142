"""Files that survive a power loss: data fsynced before it counts, and the directory
fsynced after a file in it is created or renamed (a rename is only durable once the
directory entry is)."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Every file under `root`, then every directory bottom up, then `root`'s parent: a tree
    another file is about to point at (a built index) is on disk first."""
    directories = []
    for folder, _, files in os.walk(root):
        directories.append(Path(folder))
        for name in files:
            fd = os.open(Path(folder) / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    for directory in reversed(directories):
        fsync_directory(directory)
    fsync_directory(root.parent)


def write_all(fd: int, data: bytes) -> None:
    """os.write until every byte is written (a write may take fewer than it is given)."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        if written <= 0:
            raise OSError(f"write returned {written} with {len(view)} bytes left")
        view = view[written:]


def atomic_write_text(path: Path, text: str) -> None:
    """Replaces `path` with `text` so that a crash leaves either the old or the new
    content, never a mix or nothing, and the new content is durable on return."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_all(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_directory(path.parent)
