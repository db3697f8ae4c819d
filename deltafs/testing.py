"""Helpers for testing code that uses deltafs: a fake driver, a mounter, tree fingerprints.

* `FakeSnapshotter` is the real lifecycle (metadata, names, parents, errors)
  over plain directories with full copies: code that drives a Snapshotter
  (crabd's runtime) can be unit-tested with it without root or mounts. Its
  "mounts" are bind specs of directories; a test can use the `source`
  path directly instead of mounting.
* `Mounter` mounts specs on fresh directories and unmounts them all at the end.
* `fingerprint` records everything a rollback must reproduce, without
  following symlinks or opening fifos.

No pytest dependency; used by deltafs's own tests and bench/fs.py.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tempfile

from contextlib import contextmanager
from typing import Any, Iterator

from .metadata import Row
from .mount import Mount, mount_all, unmount
from .snapshotter import Kind, Snapshotter
from .tree import O_DIR, copy_tree, remove_tree, walk_fd

__all__ = ["FakeSnapshotter", "Mounter", "fingerprint", "allocated"]


class FakeSnapshotter(Snapshotter):
    """Snapshots as full directory copies under ``state_dir/d/<id>``; no root needed.

    Slow (every checkpoint copies the whole tree) and not crash-safe beyond
    what the shared code gives; for tests of callers only.
    """

    driver = "fake"

    def __init__(self, state_dir: str) -> None:
        super().__init__(state_dir)
        os.makedirs(os.path.join(self.state_dir, "d"), exist_ok=True)

    def _path(self, id: int) -> str:
        return os.path.join(self.state_dir, "d", str(id))

    def _fill(self, id: int, src: str | None) -> None:
        tmp = self._path(id) + ".tmp"
        remove_tree(tmp)
        remove_tree(self._path(id))
        os.mkdir(tmp, 0o755)
        if src is not None:
            copy_tree(src, tmp)
        os.rename(tmp, self._path(id))

    def _create_active(self, row: Row, parent: Row | None) -> dict[str, Any]:
        self._fill(row.id, self._path(parent.id) if parent else None)
        return {}

    def _create_view(self, row: Row, parent: Row) -> dict[str, Any]:
        return {}

    def _mounts(self, row: Row) -> list[Mount]:
        if row.kind == Kind.VIEW:
            assert row.parent is not None
            return [Mount("bind", self._path(row.parent), ("bind", "ro"))]
        return [Mount("bind", self._path(row.id), ("bind", "rw"))]

    def _capture(self, active: Row, new: Row, consume: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
        self._fill(new.id, self._path(active.id))
        return {}, active.extra

    def _discard(self, row: Row) -> None:
        if row.kind != Kind.VIEW:
            remove_tree(self._path(row.id))

    def _gc_disk(self, rows: list[Row]) -> list[str]:
        known = {str(r.id) for r in rows if r.kind != Kind.VIEW}
        out = []
        for name in os.listdir(os.path.join(self.state_dir, "d")):
            if name not in known:
                remove_tree(os.path.join(self.state_dir, "d", name))
                out.append(name)
        return out

    @contextmanager
    def _readable(self, row: Row) -> Iterator[str]:
        yield self._path(row.parent if row.kind == Kind.VIEW and row.parent else row.id)


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
