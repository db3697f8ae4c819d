"""Disk space on the state file system: the one disk-full check, and the
space reserve.

Part of `crabd.daemon`. The state file system is shared by every sandbox
(there is no per-sandbox quota), so a sandbox can fill it; crabd must still
record failures, answer the API and let a destroy free space. It keeps a
32 MiB file, `space.reserve`, and frees it when space runs out:

* before every database write (`make_room`, the store's `before_write`): SQLite
  writes its WAL index through a shared mapping, and a write fault there on a
  full btrfs is a SIGBUS that kills crabd; with room it is an ordinary write;
* when a write failed for lack of space (`retry_when_full`, `release_quietly`);
* it comes back after a checkpoint commits with room to spare
  (`restore_if_room`) and after a destroy (`ensure`).
"""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
from pathlib import Path
from typing import Callable, TypeVar

log = logging.getLogger("crabd")

__all__ = ["RESERVE_BYTES", "SpaceReserve", "is_disk_full"]

T = TypeVar("T")

# Space kept back on the state file system so that destroying a sandbox
# still works after one filled it: SQLite needs room to record a delete.
RESERVE_BYTES = 32 << 20


def is_disk_full(e: BaseException | None) -> bool:
    """Is `e` (or what caused it) a full or over-quota file system? The one
    check crabd makes (the daemon, and the API's 507 `disk_full` answer)."""
    seen = 0
    while e is not None and seen < 10:
        text = str(e)
        if getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "disk is full" in text \
                or "No space left on device" in text or "Disk quota exceeded" in text:
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


class SpaceReserve:
    """The reserve file of one state directory."""

    def __init__(self, state_dir: Path, size: int = RESERVE_BYTES) -> None:
        self.state_dir = state_dir
        self.path = state_dir / "space.reserve"
        self.size = size
        # Called after the reserve is freed (the snapshotter's sync: btrfs
        # returns the blocks at the next transaction commit). Set once the
        # snapshot store is open.
        self.sync: Callable[[], None] | None = None

    def ensure(self) -> None:
        """Make the reserve if it is missing (quietly not, when there is no room)."""
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError:
            return
        try:
            if os.fstat(fd).st_size < self.size:
                os.posix_fallocate(fd, 0, self.size)
        except OSError:
            pass  # no room now: made again after the next destroy
        finally:
            os.close(fd)

    def release(self) -> bool:
        """Free the reserve; False when there was none."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            return False
        if self.sync is not None:
            self.sync()
        return True

    def release_quietly(self) -> None:
        """Free the reserve so that the sandbox and crabd have room to clean up
        (a rm inside the sandbox needs some to delete on btrfs)."""
        try:
            self.release()
        except OSError as e:
            log.warning("releasing the space reserve: %s", e)

    def make_room(self) -> None:
        """Before a database write: when the file system has less free space
        than half the reserve (a sandbox filled it), release the reserve."""
        free = self._free_bytes()
        if free is not None and free < self.size // 2 and self.path.exists():
            log.warning("state file system %s is nearly full: releasing crabd's space reserve", self.state_dir)
            self.release_quietly()

    def restore_if_room(self) -> None:
        """Space is back (a reserve released on a full disk): keep one again,
        when that does not fill the file system right away."""
        if self.path.exists():
            return
        free = self._free_bytes(strict=True)
        if free is not None and free > 4 * self.size:
            self.ensure()

    def retry_when_full(self, write: Callable[[], T]) -> T:
        """Run a database write; when it fails because the file system is
        full, free the reserve and run it once more (there is room now)."""
        try:
            return write()
        except sqlite3.OperationalError as e:
            if not is_disk_full(e) or not self.release():
                raise
            return write()

    def _free_bytes(self, strict: bool = False) -> int | None:
        try:
            st = os.statvfs(self.state_dir)
        except OSError:
            if strict:
                raise
            return None
        return st.f_bavail * st.f_frsize
