"""A machine's files for the simulation (the :class:`ziplog.io.files.Files` port), as
POSIX promises them and no more: what was written to a file reaches stable storage only
by an ``fdatasync`` of it, and a file's creation, rename or removal only by an ``fsync``
of its directory. :meth:`SimFiles.power_loss` is the machine losing power: every file
keeps what was synced and, of the rest, a seeded amount (none, all, or cut at any
byte); every directory keeps what was synced and, of the changes since, a seeded
subset applied in order (a file created since may be gone, one removed may be back).
A process that is killed loses nothing the OS was given: the files stay as they are.
"""

from __future__ import annotations

import errno
import itertools
import random
from dataclasses import dataclass, field


@dataclass
class Inode:
    data: bytearray = field(default_factory=bytearray)
    #: bytes of ``data`` on stable storage
    synced: int = 0


#: a change to a directory: ("link", name, inode) or ("unlink", name, None)
DirOp = tuple[str, str, "Inode | None"]


@dataclass
class Directory:
    #: the entries as the OS shows them now
    entries: dict[str, Inode] = field(default_factory=dict)
    #: the entries on stable storage (as of the last fsync of the directory)
    durable: dict[str, Inode] = field(default_factory=dict)
    #: changes since, in order
    pending: list[DirOp] = field(default_factory=list)


class SimFiles:
    def __init__(self) -> None:
        self.dirs: dict[str, Directory] = {}
        self._fds: dict[int, Inode] = {}
        self._next_fd = itertools.count(3)
        #: every write and allocation fails with ENOSPC (what is there stays readable)
        self.full = False
        self.refused_writes = 0
        self.syncs = 0
        self.power_losses = 0

    # -- paths --------------------------------------------------------------------------------
    @staticmethod
    def _split(path: str) -> tuple[str, str]:
        d, _, name = path.rpartition("/")
        return d, name

    def _dir(self, path: str) -> Directory:
        d = self.dirs.get(path)
        if d is None:
            raise FileNotFoundError(errno.ENOENT, "no such directory", path)
        return d

    def _inode(self, path: str) -> Inode:
        d, name = self._split(path)
        ino = self._dir(d).entries.get(name)
        if ino is None:
            raise FileNotFoundError(errno.ENOENT, "no such file", path)
        return ino

    def _link(self, path: str, ino: Inode) -> None:
        d, name = self._split(path)
        dd = self._dir(d)
        dd.entries[name] = ino
        dd.pending.append(("link", name, ino))

    def _unlink(self, path: str) -> None:
        d, name = self._split(path)
        dd = self._dir(d)
        if dd.entries.pop(name, None) is not None:
            dd.pending.append(("unlink", name, None))

    def _refuse_if_full(self) -> None:
        if self.full:
            self.refused_writes += 1
            raise OSError(errno.ENOSPC, "No space left on device (simulated)")

    # -- the port -----------------------------------------------------------------------------
    def makedirs(self, path: str) -> None:
        # Directories are made once, before anything is written, and never lost.
        self.dirs.setdefault(path, Directory())

    def listdir(self, path: str) -> list[str]:
        return list(self._dir(path).entries)

    def read(self, path: str) -> bytes:
        return bytes(self._inode(path).data)

    def read_at(self, path: str, offset: int, length: int) -> bytes:
        return bytes(self._inode(path).data[offset:offset + length])

    def size(self, path: str) -> int | None:
        try:
            return len(self._inode(path).data)
        except FileNotFoundError:
            return None

    def truncate(self, path: str, length: int) -> None:
        ino = self._inode(path)
        del ino.data[length:]
        ino.synced = min(ino.synced, length)

    def open_append(self, path: str) -> int:
        self._refuse_if_full()
        ino = Inode()
        self._link(path, ino)
        fd = next(self._next_fd)
        self._fds[fd] = ino
        return fd

    def write(self, fd: int, data: memoryview) -> int:
        self._refuse_if_full()
        self._fds[fd].data += data
        return len(data)

    def ftruncate(self, fd: int, length: int) -> None:
        ino = self._fds[fd]
        del ino.data[length:]
        ino.synced = min(ino.synced, length)

    def fdatasync(self, fd: int) -> None:
        ino = self._fds.get(fd)
        if ino is None:
            raise OSError(errno.EBADF, "Bad file descriptor (simulated)")
        self.syncs += 1
        ino.synced = len(ino.data)

    def close(self, fd: int) -> None:
        self._fds.pop(fd, None)

    def sync_path(self, path: str) -> None:
        try:
            ino = self._inode(path)
        except FileNotFoundError:
            return
        self.syncs += 1
        ino.synced = len(ino.data)

    def unlink(self, path: str) -> None:
        self._unlink(path)

    def replace(self, src: str, dst: str) -> None:
        ino = self._inode(src)
        self._unlink(src)
        self._link(dst, ino)

    def fsync_dir(self, path: str) -> None:
        dd = self._dir(path)
        self.syncs += 1
        dd.durable = dict(dd.entries)
        dd.pending = []

    def allocate(self, path: str, length: int) -> None:
        self._refuse_if_full()
        try:
            ino = self._inode(path)
        except FileNotFoundError:
            ino = Inode()
            self._link(path, ino)
        if len(ino.data) < length:
            ino.data += bytes(length - len(ino.data))
        ino.synced = len(ino.data)

    # -- faults -------------------------------------------------------------------------------
    def unsynced_bytes(self) -> int:
        """What a power loss now could take: bytes written and not synced."""
        inodes = {id(i): i for d in self.dirs.values() for i in d.entries.values()}
        return sum(len(i.data) - i.synced for i in inodes.values())

    def power_loss(self, rng: random.Random) -> None:
        """The machine loses power: open files are gone with the processes, and the disk
        keeps what the rules above say (seeded by ``rng``)."""
        self.power_losses += 1
        self._fds.clear()
        kept: dict[int, int] = {}
        for d in self.dirs.values():
            entries = dict(d.durable)
            for op, name, ino in d.pending:
                if rng.random() < 0.5:
                    continue  # this change did not reach the disk
                if op == "link":
                    assert ino is not None
                    entries[name] = ino
                else:
                    entries.pop(name, None)
            d.entries = entries
            d.durable = dict(entries)
            d.pending = []
            for ino in entries.values():
                if id(ino) in kept:
                    continue
                n = len(ino.data)
                pick = rng.random()
                keep = ino.synced if pick < 0.3 else n if pick < 0.6 else rng.randint(ino.synced, n)
                del ino.data[keep:]
                ino.synced = keep
                kept[id(ino)] = keep
