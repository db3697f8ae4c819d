"""Helpers for testing code that uses deltafs: a mounter that cleans up, and tree fingerprints.

Used by deltafs's own integration tests and benchmarks (and usable by
crabd's); no pytest dependency. `fingerprint` records everything a rollback
must reproduce, without following symlinks or opening fifos.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tempfile

from .mount import mount_all, unmount
from .tree import O_DIR, walk_fd

__all__ = ["Mounter", "fingerprint", "allocated"]


class Mounter:
    """Mounts snapshot specs on fresh directories and unmounts them all at teardown."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.targets: list[str] = []

    def mount(self, mounts) -> str:
        t = tempfile.mkdtemp(dir=self.base)
        mount_all(mounts, t)
        self.targets.append(t)
        return t

    def unmount(self, target: str) -> None:
        unmount(target)
        self.targets.remove(target)
        os.rmdir(target)

    def cleanup(self) -> None:
        for t in reversed(self.targets):
            unmount(t, detach=True)
        self.targets.clear()


def fingerprint(root: str) -> dict:
    """Everything rollback must reproduce: per path type, mode, owner, times, xattrs, link target,
    content digest, device numbers; plus hard-link groups. Never follows symlinks or opens fifos."""
    out: dict = {}
    groups: dict[int, list[bytes]] = {}
    fd = os.open(root, O_DIR)
    try:
        st = os.fstat(fd)
        out[b""] = ("dir", stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid)
        for path, pfd, name, st in walk_fd(fd):
            kind = stat.S_IFMT(st.st_mode)
            p = b"/proc/self/fd/%d/%s" % (pfd, name)
            try:
                xattrs = tuple(sorted((n, os.getxattr(p, n, follow_symlinks=False))
                                      for n in os.listxattr(p, follow_symlinks=False)))
            except OSError:
                xattrs = ()
            rec = [kind, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, xattrs]
            if stat.S_ISREG(st.st_mode):
                h = hashlib.blake2b()
                f = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=pfd)
                try:
                    # Hash data segments only, so a huge sparse file costs its data.
                    off = 0
                    while True:
                        try:
                            d = os.lseek(f, off, os.SEEK_DATA)
                        except OSError:
                            break
                        hole = os.lseek(f, d, os.SEEK_HOLE)
                        h.update(d.to_bytes(8, "little"))
                        h.update(os.pread(f, hole - d, d))
                        off = hole
                finally:
                    os.close(f)
                rec += [st.st_size, st.st_mtime_ns, h.hexdigest()]
                if st.st_nlink > 1:
                    groups.setdefault(st.st_ino, []).append(path)
            elif stat.S_ISLNK(st.st_mode):
                rec += [os.readlink(name, dir_fd=pfd), st.st_mtime_ns]
            elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
                rec += [st.st_rdev, st.st_mtime_ns]
            elif stat.S_ISDIR(st.st_mode):
                rec += [st.st_mtime_ns]
            else:
                rec += [st.st_mtime_ns]
            out[path] = tuple(rec)
    finally:
        os.close(fd)
    out["hardlink-groups"] = sorted(sorted(g) for g in groups.values() if len(g) > 1)
    return out


def allocated(root: str) -> int:
    total = 0
    fd = os.open(root, O_DIR)
    try:
        for _, _, _, st in walk_fd(fd):
            total += st.st_blocks * 512
    finally:
        os.close(fd)
    return total
