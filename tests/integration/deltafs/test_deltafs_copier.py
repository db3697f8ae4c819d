"""The copier that overlay captures and compaction use, on real file systems:
reflink where the fs has it (btrfs pool), holes kept where it does not (ext4),
fifos never opened, symlinks never followed, hard links kept.
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import tempfile

import pytest

import deltafs
from deltafs.tree import O_DIR, Copier, scan

pytestmark = pytest.mark.needs("btrfs", "overlay")


def require_root() -> None:
    if os.geteuid() != 0:
        pytest.fail("deltafs copier tests need root (mknod, chown, loop pool): run them as root")


def copy_all(src: str, dst: str) -> Copier:
    sfd, dfd = os.open(src, O_DIR), os.open(dst, O_DIR)
    c = Copier(dfd)
    try:
        for name in sorted(os.listdir(sfd)):
            b = os.fsencode(name)
            c.copy(sfd, b, os.stat(b, dir_fd=sfd, follow_symlinks=False), b)
    finally:
        os.close(sfd)
        os.close(dfd)
    return c


def data_map(path: str) -> list[tuple[int, int]]:
    out, off = [], 0
    fd = os.open(path, os.O_RDONLY)
    try:
        while True:
            try:
                d = os.lseek(fd, off, os.SEEK_DATA)
            except OSError:
                return out
            h = os.lseek(fd, d, os.SEEK_HOLE)
            out.append((d, h))
            off = h
    finally:
        os.close(fd)


def test_reflink_on_btrfs():
    require_root()
    base = tempfile.mkdtemp(dir="/var/tmp")
    s = deltafs.open(os.path.join(base, "state"), driver="btrfs", pool_size=1 << 30)
    try:
        src, dst = os.path.join(s.root, "src"), os.path.join(s.root, "dst")
        os.mkdir(src)
        os.mkdir(dst)
        with open(f"{src}/big", "wb") as f:
            f.write(os.urandom(8 << 20))
        c = copy_all(src, dst)
        assert c.reflinks == 1 and c.bytes_copied == 0
        with open(f"{src}/big", "rb") as a, open(f"{dst}/big", "rb") as b:
            assert a.read() == b.read()
    finally:
        s.unmount_pool()
        shutil.rmtree(base, ignore_errors=True)


def test_copy_keeps_holes_links_and_never_opens_fifos():
    require_root()
    base = tempfile.mkdtemp(dir="/var/tmp")  # ext4 here: no reflink, so the sparse copy path runs
    try:
        src, dst = os.path.join(base, "src"), os.path.join(base, "dst")
        os.mkdir(src)
        os.mkdir(dst)
        with open(f"{src}/sparse", "wb") as f:
            f.write(b"head")
            f.seek(1 << 30)
            f.write(b"middle")
            f.truncate(4 << 30)
        os.link(f"{src}/sparse", f"{src}/sparse-link")
        os.mkfifo(f"{src}/fifo")
        os.symlink("/etc/passwd", f"{src}/passwd")
        os.symlink("/", f"{src}/rootdir")
        os.mknod(f"{src}/zero", 0o644 | stat.S_IFCHR, os.makedev(1, 5))
        os.setxattr(f"{src}/sparse", "user.k", b"v")
        signal.alarm(20)  # opening the fifo would block forever
        try:
            c = copy_all(src, dst)
        finally:
            signal.alarm(0)
        assert data_map(f"{dst}/sparse") == data_map(f"{src}/sparse")
        assert os.stat(f"{dst}/sparse").st_blocks * 512 < 1 << 20 and c.bytes_copied < 1 << 20
        assert os.stat(f"{dst}/sparse").st_ino == os.stat(f"{dst}/sparse-link").st_ino
        a, b = scan(src), scan(dst)
        for k in a:
            if k:
                assert a[k] == b[k], k
        assert os.readlink(f"{dst}/rootdir") == "/" and stat.S_ISFIFO(os.lstat(f"{dst}/fifo").st_mode)
    finally:
        shutil.rmtree(base, ignore_errors=True)
