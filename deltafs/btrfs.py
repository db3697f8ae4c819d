"""The btrfs driver: one subvolume per active snapshot, a read-only snapshot per commit.

Commit and checkpoint are one BTRFS_IOC_SNAP_CREATE_V2 ioctl: O(1) whatever
the tree size, block-level copy-on-write afterwards. Rollback and fork are a
writable snapshot of a committed one. No process is spawned on these paths;
`mkfs.btrfs` and `mount -o loop` run only when the pool is created or
re-mounted (open() after a reboot).

Layout (R = the state dir when it is on btrfs, else ``state_dir/pool``, the
mount point of the loop-backed pool file ``state_dir/pool.img``)::

    R/snapshots/<id>       subvolume of snapshot row <id> (committed ones read-only)
    R/snapshots/tmp.<id>   being created; renamed to <id> inside the metadata tx

An active snapshot is mounted by the caller as a bind mount of its
subvolume: a checkpoint leaves that subvolume (and so the mount) in place,
and a rollback swaps what is bind-mounted on the sandbox's root path.

btrfs flushes a subvolume's dirty pages when snapshotting it (measured here:
~2 ms after a tiny change, ~108 ms with 64 MiB freshly written), so
`prepare_checkpoint` runs syncfs(2) on the pool during the LLM wait and the
frozen snapshot only flushes what was written since.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import os
import shutil
import struct
import subprocess
from contextlib import contextmanager
from typing import Any, Iterator

from .errors import FailedPrecondition
from .metadata import Row
from .mount import Mount, is_mountpoint, mountinfo, unmount
from .snapshotter import Kind, Snapshotter, _failpoint
from .sendstream import touched_paths
from .tree import O_DIR

__all__ = ["BtrfsSnapshotter", "is_btrfs", "vol_args_v2", "BTRFS_IOC_SNAP_CREATE_V2",
           "BTRFS_IOC_SUBVOL_CREATE_V2", "BTRFS_IOC_SNAP_DESTROY_V2", "DEFAULT_POOL_SIZE"]

# linux/btrfs.h (values checked against the C header on this host).
BTRFS_SUPER_MAGIC = 0x9123683E
_VOL_ARGS_V2_SIZE = 4096  # s64 fd, u64 transid, u64 flags, u64 unused[4], char name[4040]
_NAME_OFFSET = 56
BTRFS_SUBVOL_NAME_MAX = 4039
BTRFS_SUBVOL_RDONLY = 1 << 1


def _iow(typ: int, nr: int, size: int) -> int:
    return (1 << 30) | (size << 16) | (typ << 8) | nr


BTRFS_IOC_SNAP_CREATE_V2 = _iow(0x94, 23, _VOL_ARGS_V2_SIZE)  # 0x50009417
BTRFS_IOC_SUBVOL_CREATE_V2 = _iow(0x94, 24, _VOL_ARGS_V2_SIZE)  # 0x50009418
BTRFS_IOC_SNAP_DESTROY_V2 = _iow(0x94, 63, _VOL_ARGS_V2_SIZE)  # 0x5000943f

DEFAULT_POOL_SIZE = 20 << 30
SEND_TIMEOUT_S = 600

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.statfs.argtypes = [ctypes.c_char_p, ctypes.c_void_p]
_libc.syncfs.argtypes = [ctypes.c_int]


def vol_args_v2(name: str, fd: int = 0, flags: int = 0) -> bytearray:
    """struct btrfs_ioctl_vol_args_v2 as a mutable 4096-byte buffer (fcntl.ioctl copies it in and out). Pure."""
    raw = name.encode()
    if not raw or len(raw) > BTRFS_SUBVOL_NAME_MAX or b"/" in raw or b"\0" in raw:
        raise ValueError(f"invalid subvolume name {name!r}")
    buf = bytearray(_VOL_ARGS_V2_SIZE)
    struct.pack_into("=qQQ", buf, 0, fd, 0, flags)
    buf[_NAME_OFFSET:_NAME_OFFSET + len(raw)] = raw
    return buf


def fs_type(path: str) -> int:
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on x86-64; f_type comes first
    if _libc.statfs(path.encode(), buf) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"statfs {path}: {os.strerror(e)}")
    return struct.unpack_from("=q", buf.raw, 0)[0] & 0xFFFFFFFF


def is_btrfs(path: str) -> bool:
    return fs_type(path) == BTRFS_SUPER_MAGIC


def subvol_create(dir_fd: int, name: str) -> None:
    fcntl.ioctl(dir_fd, BTRFS_IOC_SUBVOL_CREATE_V2, vol_args_v2(name))


def snap_create(dir_fd: int, src_fd: int, name: str, readonly: bool) -> None:
    fcntl.ioctl(dir_fd, BTRFS_IOC_SNAP_CREATE_V2,
                vol_args_v2(name, fd=src_fd, flags=BTRFS_SUBVOL_RDONLY if readonly else 0))


def snap_destroy(dir_fd: int, name: str) -> None:
    """Delete subvolume `name` in `dir_fd` (read-only ones too: we are root)."""
    fcntl.ioctl(dir_fd, BTRFS_IOC_SNAP_DESTROY_V2, vol_args_v2(name))


def _run(argv: list[str], timeout: float = 120) -> None:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise FailedPrecondition(f"{argv[0]} is not installed: apt-get install btrfs-progs util-linux, "
                                 "or open the state directory with driver='overlay'") from None
    except subprocess.TimeoutExpired:
        raise FailedPrecondition(f"{' '.join(argv)} did not finish in {timeout:.0f} s") from None
    if p.returncode != 0:
        raise FailedPrecondition(f"{' '.join(argv)} failed ({p.returncode}): {p.stderr.strip()}")


def btrfs_available() -> bool:
    """The kernel can mount btrfs and mkfs.btrfs exists (needed only for a pool file)."""
    if shutil.which("mkfs.btrfs") is None:
        return False
    with open("/proc/filesystems") as f:
        if any(line.split()[-1] == "btrfs" for line in f if line.strip()):
            return True
    return os.path.exists(f"/lib/modules/{os.uname().release}/kernel/fs/btrfs")


class BtrfsSnapshotter(Snapshotter):
    driver = "btrfs"
    _usage_unlocked = True  # a committed snapshot is a read-only subvolume
    _prepare_unlocked = True  # preparing = syncfs of the pool

    def __init__(self, state_dir: str, pool_size: int = DEFAULT_POOL_SIZE) -> None:
        self._snap_fd = -1
        super().__init__(state_dir)
        try:
            self.root = self._ensure_pool(pool_size)
            self.snapdir = os.path.join(self.root, "snapshots")
            os.makedirs(self.snapdir, mode=0o700, exist_ok=True)
            self._snap_fd = os.open(self.snapdir, O_DIR)
        except BaseException:
            super().close()
            raise

    # ---- pool ---------------------------------------------------------------------------
    @property
    def pool_image(self) -> str:
        return os.path.join(self.state_dir, "pool.img")

    @property
    def pool_mountpoint(self) -> str:
        return os.path.join(self.state_dir, "pool")

    def _ensure_pool(self, size: int) -> str:
        if is_btrfs(self.state_dir):
            return self.state_dir
        img, mnt = self.pool_image, self.pool_mountpoint
        if is_mountpoint(mnt) and is_btrfs(mnt):
            return mnt
        if not os.path.exists(img):
            # mkfs into a temporary name: a crash mid-mkfs must not leave a
            # half-made pool that a later open() would try to mount.
            tmp = img + ".tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                os.ftruncate(fd, size)  # sparse: costs nothing until written
            finally:
                os.close(fd)
            _run(["mkfs.btrfs", "-q", "-f", "-L", "deltafs", tmp])
            os.rename(tmp, img)
        os.makedirs(mnt, mode=0o700, exist_ok=True)
        # noatime: reads in the sandbox must not dirty metadata that every
        # snapshot then has to write out.
        _run(["mount", "-t", "btrfs", "-o", "loop,noatime", img, mnt])
        if not is_btrfs(mnt):
            raise FailedPrecondition(f"mounted {img} on {mnt} but it is not btrfs there")
        return mnt

    def unmount_pool(self) -> None:
        """Unmount the loop-backed pool (tests, uninstall); open() mounts it again."""
        self.close()
        if os.path.realpath(self.root) == os.path.realpath(self.pool_mountpoint):
            unmount(self.pool_mountpoint)

    def close(self) -> None:
        with self._lock:
            self._reaper.drain()  # it destroys subvolumes through _snap_fd
            if self._snap_fd >= 0:
                os.close(self._snap_fd)
                self._snap_fd = -1
        super().close()

    # ---- hooks --------------------------------------------------------------------------
    def _path(self, id: int) -> str:
        return os.path.join(self.snapdir, str(id))

    def _clear(self, name: str) -> None:
        """Remove a leftover subvolume/dir with this name (from a crash), so the name can be reused."""
        try:
            snap_destroy(self._snap_fd, name)
        except OSError as e:
            if e.errno == errno.ENOENT:
                return
            if e.errno in (errno.EINVAL, errno.ENOTTY, errno.EPERM):  # a plain directory, not a subvolume
                from .tree import remove_tree
                remove_tree(os.path.join(self.snapdir, name))
                return
            raise

    def _make(self, id: int, src: str | None, readonly: bool) -> None:
        tmp = f"tmp.{id}"
        self._clear(tmp)
        self._clear(str(id))
        if src is None:
            subvol_create(self._snap_fd, tmp)
        else:
            sfd = os.open(src, O_DIR)
            try:
                snap_create(self._snap_fd, sfd, tmp, readonly)
            finally:
                os.close(sfd)
        _failpoint("btrfs-after-snapshot")
        os.rename(tmp, str(id), src_dir_fd=self._snap_fd, dst_dir_fd=self._snap_fd)
        _failpoint("btrfs-after-rename")

    def _create_active(self, row: Row, parent: Row | None) -> dict[str, Any]:
        self._make(row.id, self._path(parent.id) if parent else None, readonly=False)
        return {}

    def _create_view(self, row: Row, parent: Row) -> dict[str, Any]:
        return {}  # a view is a read-only bind mount of the committed (read-only) subvolume

    def _mounts(self, row: Row) -> list[Mount]:
        if row.kind == Kind.VIEW:
            assert row.parent is not None
            return [Mount(type="bind", source=self._path(row.parent), options=("bind", "ro"))]
        return [Mount(type="bind", source=self._path(row.id), options=("bind", "rw"))]

    def _capture(self, active: Row, new: Row, consume: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
        self._make(new.id, self._path(active.id), readonly=True)
        return {}, active.extra

    def _prepare_checkpoint(self, row: Row) -> None:
        fd = os.open(self._path(row.id), O_DIR)
        try:
            # syncfs writes back the whole pool (all sandboxes on it): what the
            # next snapshot would otherwise flush while the sandbox is frozen.
            if _libc.syncfs(fd) != 0:
                e = ctypes.get_errno()
                raise OSError(e, f"syncfs {self._path(row.id)}: {os.strerror(e)}")
        finally:
            os.close(fd)

    def _mounted_at(self, row: Row) -> list[str]:
        # A bind mount of the subvolume shows up with the pool's device and the
        # subvolume's path inside the file system as its mountinfo root. (stat's
        # st_dev cannot be used: btrfs gives each subvolume its own.)
        table = mountinfo()
        path = os.path.realpath(self._path(row.id))
        home = max((m for m in table if path == m.target or path.startswith(m.target.rstrip("/") + "/")),
                   key=lambda m: len(m.target))
        inside = os.path.normpath(os.path.join(home.root, os.path.relpath(path, home.target)))
        return [m.target for m in table if m.dev == home.dev and m.root == inside and m is not home]

    def _changed_paths(self, a: Row, b: Row) -> set[bytes] | None:
        """What `btrfs send --no-data -p A B` names (sendstream.touched_paths):
        the kernel walks only the tree blocks the two read-only snapshots do
        not share. None (a full scan) when send refuses: a snapshot not
        read-only, or one that is not committed."""
        if a.kind != Kind.COMMITTED or b.kind != Kind.COMMITTED:
            return None
        argv = ["btrfs", "send", "-q", "--no-data", "-p", self._path(a.id), self._path(b.id)]
        try:
            r = subprocess.run(argv, capture_output=True, timeout=SEND_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired):
            return None
        if r.returncode != 0:
            return None
        try:
            return touched_paths(r.stdout)
        except ValueError:
            return None

    def _sync_paths(self) -> list[str]:
        return [self.state_dir, self.root] if self.root != self.state_dir else [self.state_dir]

    def _discard(self, row: Row) -> None:
        if row.kind == Kind.VIEW:
            return
        # Rename out of the way (O(1)); destroying a subvolume with much data
        # can wait for a transaction commit, so the reaper thread does it.
        trash = f"trash.{row.id}"
        try:
            os.rename(str(row.id), trash, src_dir_fd=self._snap_fd, dst_dir_fd=self._snap_fd)
        except OSError:
            return  # gc() retries
        self._reaper.put(trash)

    def _reap(self, item: object) -> None:
        snap_destroy(self._snap_fd, str(item))

    def _gc_disk(self, rows: list[Row]) -> list[str]:
        known = {str(r.id) for r in rows if r.kind != Kind.VIEW}
        removed = []
        for name in sorted(os.listdir(self._snap_fd)):
            if name in known:
                continue
            try:
                self._clear(name)
                removed.append(os.path.join(self.snapdir, name))
            except OSError:
                pass  # still busy: a later gc() gets it
        return removed

    @contextmanager
    def _readable(self, row: Row) -> Iterator[str]:
        if row.kind == Kind.VIEW:
            assert row.parent is not None
            yield self._path(row.parent)
        else:
            yield self._path(row.id)
