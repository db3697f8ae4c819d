"""deltafs: copy-on-write file-system snapshots for sandboxes.

A library usable without the crabd daemon (it never imports `crabd`).
`open(state_dir)` returns a `Snapshotter` (see deltafs.snapshotter for the
lifecycle and a worked example); its operations return mount specs as data
(`Mount`), and `mount_all` performs them. Drivers: `btrfs` (subvolumes and
read-only snapshots; a loop-backed pool when the state dir is not on btrfs)
and `overlay` (overlayfs layers; any file system).
"""

from __future__ import annotations

import builtins
import os

from .errors import AlreadyExists, DeltafsError, FailedPrecondition, InvalidArgument, NotFound
from .mount import Mount, MountError, is_mountpoint, mount_all, unmount
from .snapshotter import Info, Kind, Snapshotter, Usage
from .tree import Change, Entry

__all__ = [
    "open", "Snapshotter", "Info", "Usage", "Kind", "Change", "Entry",
    "Mount", "MountError", "is_mountpoint", "mount_all", "unmount",
    "DeltafsError", "NotFound", "AlreadyExists", "FailedPrecondition", "InvalidArgument",
    "DRIVERS", "available_drivers",
]

DRIVERS = ("btrfs", "overlay")
_builtin_open = builtins.open  # `open` below is deltafs.open


def _stored_driver(state_dir: str) -> str | None:
    import sqlite3

    db = os.path.join(state_dir, "metadata.db")
    if not os.path.exists(db):
        return None
    con = sqlite3.connect(db)
    try:
        r = con.execute("SELECT v FROM meta WHERE k='driver'").fetchone()
        return r[0] if r else None
    except sqlite3.Error:
        return None
    finally:
        con.close()


def available_drivers() -> dict[str, str | None]:
    """Driver name -> None when this host can run it, else what is missing and how to fix it.

    For `crabd doctor`; cheap (reads /proc/filesystems and PATH, mounts nothing).
    """
    import shutil

    from .btrfs import btrfs_available

    out: dict[str, str | None] = {}
    if os.geteuid() != 0:
        out["btrfs"] = out["overlay"] = "needs root (mount(2), btrfs ioctls)"
        return out
    if btrfs_available():
        out["btrfs"] = None
    elif shutil.which("mkfs.btrfs") is None:
        out["btrfs"] = "mkfs.btrfs missing: apt-get install btrfs-progs (needed for the loop-backed pool)"
    else:
        out["btrfs"] = "the kernel has no btrfs: modprobe btrfs"
    with _builtin_open("/proc/filesystems") as f:
        has_overlay = any(line.split()[-1] == "overlay" for line in f if line.strip())
    has_module = os.path.exists(f"/lib/modules/{os.uname().release}/kernel/fs/overlayfs")
    out["overlay"] = None if has_overlay or has_module else "the kernel has no overlayfs: modprobe overlay"
    return out


def open(state_dir: str, driver: str = "auto", *, pool_size: int | None = None, **options: object) -> Snapshotter:
    """Open (creating if needed) the snapshot store in `state_dir`.

    driver: "btrfs", "overlay" or "auto" (the driver the directory was created
    with; for a new one btrfs when the kernel and btrfs-progs allow, else
    overlay). btrfs options: pool_size (bytes, sparse; default 20 GiB; ignored
by overlay).
    overlay options: max_depth (default 16).
    """
    if driver == "auto":
        from .btrfs import btrfs_available

        driver = _stored_driver(state_dir) or ("btrfs" if btrfs_available() else "overlay")
    if driver == "btrfs":
        from .btrfs import BtrfsSnapshotter

        if pool_size is not None:  # (a pool that exists keeps its size)
            options["pool_size"] = pool_size
        return BtrfsSnapshotter(state_dir, **options)  # type: ignore[arg-type]
    if driver == "overlay":
        from .overlay import OverlaySnapshotter

        return OverlaySnapshotter(state_dir, **options)  # type: ignore[arg-type]
    raise InvalidArgument(f"unknown deltafs driver {driver!r}; use one of {', '.join(DRIVERS)} or 'auto'")
