"""A machine's disk that loses power for real: a LazyFS mount (a FUSE file system that
keeps what is written in a cache of its own until the file is fsynced, and drops every
unsynced byte on ``lazyfs::clear-cache``, as a power cut drops the page cache), for
tests on real processes. LazyFS is built from its public source
(https://github.com/dsrhaslab/lazyfs); ``ZIPLOG_LAZYFS`` names the binary. Directory
operations (create, rename, unlink) reach the disk below at once: only file data is lost,
which is what the segment log's rules are about."""

from __future__ import annotations

import os
import select
import subprocess
import time
from pathlib import Path

#: the LazyFS binary, if this machine has one
BINARY = os.environ.get("ZIPLOG_LAZYFS", "")

_CONFIG = """[faults]
fifo_path="{fifo}"
fifo_path_completed="{done}"
[cache]
apply_eviction=false
[cache.simple]
custom_size="256mb"
blocks_per_page=1
[filesystem]
log_all_operations=false
logfile=""
"""


def available() -> str | None:
    """None when LazyFS can run here, else why not."""
    if not BINARY:
        return "ZIPLOG_LAZYFS does not name a LazyFS binary (built from github.com/dsrhaslab/lazyfs)"
    if not os.access(BINARY, os.X_OK):
        return f"ZIPLOG_LAZYFS={BINARY} is not an executable"
    if not os.path.exists("/dev/fuse"):
        return "this machine has no /dev/fuse"
    return None


class LazyDisk:
    """``mount`` backed by ``under``: what a process writes under ``mount`` survives
    :meth:`power_loss` only if it was fsynced."""

    def __init__(self, mount: Path, under: Path, work: Path, timeout: float = 30.0) -> None:
        self.mount = mount
        self.timeout = timeout
        for d in (mount, under, work):
            d.mkdir(parents=True, exist_ok=True)
        self.fifo = work / "faults.fifo"
        self.done = work / "faults-done.fifo"
        for p in (self.fifo, self.done):
            if not p.exists():
                os.mkfifo(p)
        config = work / "lazyfs.toml"
        config.write_text(_CONFIG.format(fifo=self.fifo, done=self.done))
        self._done_fd: int | None = None
        self.log = open(work / "lazyfs.log", "wb")
        # The config by a name relative to the working directory: LazyFS takes a path
        # holding "-o" (as /tmp/pytest-of-root/... does) for the next option.
        self.proc = subprocess.Popen([BINARY, str(mount), "--config-path", config.name, "-o", "allow_other",
                                      "-o", "modules=subdir", "-o", f"subdir={under}", "-f"],
                                     cwd=work, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not os.path.ismount(mount):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"LazyFS did not mount {mount}: see {work / 'lazyfs.log'}")
            time.sleep(0.02)
        # Kept open for reading from the start: LazyFS writes each command's completion here.
        self._done_fd = os.open(self.done, os.O_RDONLY | os.O_NONBLOCK)

    def _size(self) -> int:
        return sum(p.stat().st_size for p in self.mount.rglob("*") if p.is_file())

    def power_loss(self) -> int:
        """Drop every byte written under the mount since its file's last fsync (the
        processes writing there must be dead: a power cut takes them too). Returns how
        many bytes the files lost."""
        before = self._size()
        with open(self.fifo, "w") as fh:
            fh.write("lazyfs::clear-cache\n")
        got = b""
        deadline = time.monotonic() + self.timeout
        assert self._done_fd is not None, "the disk is closed"
        while b"finished::clear-cache" not in got:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"LazyFS did not confirm clearing its cache: {got!r}")
            ready, _, _ = select.select([self._done_fd], [], [], left)
            if ready:
                chunk = os.read(self._done_fd, 4096)
                if chunk:
                    got += chunk
                else:  # no writer yet: wait for one without spinning
                    time.sleep(0.01)
        return before - self._size()

    def close(self) -> None:
        if self._done_fd is not None:
            os.close(self._done_fd)
            self._done_fd = None
        if os.path.ismount(self.mount):
            subprocess.run(["umount", str(self.mount)], check=False)
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
