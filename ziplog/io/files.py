"""The file system a replica's segment log (:mod:`ziplog.io.segments`) runs on: the few
calls it makes, so that the simulation can run the same segment log on files that lose
what was not synced when their machine loses power (``tests/sim/files.py``).

:class:`OsFiles` is the operating system's. Paths are strings; a descriptor is what
:meth:`Files.open_append` returned. The durability rules the segment log relies on are
POSIX's: bytes written reach stable storage only by an ``fdatasync`` of their file, and
a file's creation, rename or removal only by an ``fsync`` of its directory."""

from __future__ import annotations

import os
from typing import Protocol


class Files(Protocol):
    def makedirs(self, path: str) -> None:
        """Create the directory (and its parents) if it is missing."""

    def listdir(self, path: str) -> list[str]:
        """The names in a directory."""

    def read(self, path: str) -> bytes:
        """A whole file (FileNotFoundError when there is none)."""

    def read_at(self, path: str, offset: int, length: int) -> bytes:
        """Up to ``length`` bytes of a file from ``offset`` (fewer at its end)."""

    def size(self, path: str) -> int | None:
        """A file's size, None when there is none."""

    def truncate(self, path: str, length: int) -> None:
        """Cut a file to ``length`` bytes."""

    def open_append(self, path: str) -> int:
        """A new, empty file opened for appending (an existing one is emptied)."""

    def write(self, fd: int, data: memoryview) -> int:
        """Write some of ``data`` at the end of the file; the count written."""

    def ftruncate(self, fd: int, length: int) -> None:
        """Cut an open file to ``length`` bytes."""

    def fdatasync(self, fd: int) -> None:
        """What was written to the file is on stable storage (its size too)."""

    def close(self, fd: int) -> None: ...

    def sync_path(self, path: str) -> None:
        """What was written to a file not open here is on stable storage (nothing if
        there is no such file)."""

    def unlink(self, path: str) -> None:
        """Remove a file; nothing if it is already gone."""

    def replace(self, src: str, dst: str) -> None:
        """Rename ``src`` to ``dst``, replacing it."""

    def fsync_dir(self, path: str) -> None:
        """The directory's entries (files created, renamed, removed) are on stable storage."""

    def allocate(self, path: str, length: int) -> None:
        """A file of at least ``length`` bytes of real blocks, synced (OSError when the
        disk has no room)."""


class OsFiles:
    """The operating system's files."""

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def listdir(self, path: str) -> list[str]:
        return os.listdir(path)

    def read(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def read_at(self, path: str, offset: int, length: int) -> bytes:
        fd = os.open(path, os.O_RDONLY)
        try:
            return os.pread(fd, length, offset)
        finally:
            os.close(fd)

    def size(self, path: str) -> int | None:
        try:
            return os.stat(path).st_size
        except FileNotFoundError:
            return None

    def truncate(self, path: str, length: int) -> None:
        os.truncate(path, length)

    def open_append(self, path: str) -> int:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)

    def write(self, fd: int, data: memoryview) -> int:
        return os.write(fd, data)

    def ftruncate(self, fd: int, length: int) -> None:
        os.ftruncate(fd, length)

    def fdatasync(self, fd: int) -> None:
        os.fdatasync(fd)

    def close(self, fd: int) -> None:
        os.close(fd)

    def sync_path(self, path: str) -> None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)

    def unlink(self, path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def replace(self, src: str, dst: str) -> None:
        os.replace(src, dst)

    def fsync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def allocate(self, path: str, length: int) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.posix_fallocate(fd, 0, length)  # real blocks: a sparse file would reserve nothing
            os.fdatasync(fd)
        finally:
            os.close(fd)


OS_FILES = OsFiles()
