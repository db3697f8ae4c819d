"""The snapshotter interface and the lifecycle logic both drivers share.

Words (as in containerd's snapshotter):

* a **key** names an *active* snapshot (writable; mounted by the caller as a
  sandbox's root) or a *view* (read-only);
* a **name** names a *committed* snapshot (immutable; a parent for new
  actives and views).

Active snapshots never become committed and vice versa: `commit(name, key)`
creates committed `name` from the content of active `key` and removes `key`;
`checkpoint(key)` creates a committed snapshot from `key`'s content and
keeps `key` (same on-disk upper/subvolume, so the mount the sandbox runs on
stays live); `key`'s parent becomes the new committed snapshot. A committed
snapshot cannot be removed while an active, view or committed snapshot has
it as parent.

Worked example (what crabd's runtime does per sandbox)::

    s = deltafs.open("/var/lib/crabd/fs")
    s.prepare("img-import")                      # empty active
    ... unpack the image into mount_all(s.mounts("img-import"), tmpdir) ...
    s.commit("debian-12", "img-import")          # image = committed snapshot
    mounts = s.prepare("sb1", parent="debian-12")
    mount_all(mounts, rootfs)                    # runc create with rootfs
    ... turn 1 ...
    s.prepare_checkpoint("sb1")                  # during the LLM wait: writeback
    freeze; n1 = s.checkpoint("sb1"); thaw      # "sb1@7": turn 1, committed
    s.sync()                                     # durable
    ... turn 2, agent breaks things ...
    stop container; unmount(rootfs, background=True); s.remove("sb1")
    mount_all(s.prepare("sb1", parent=n1), rootfs)   # rollback: runc create again
    mount_all(s.prepare("sb1-fork", parent=n1), rootfs2)  # fork: independent

Mount specs are returned as data (`deltafs.mount.Mount`); `mount_all`
performs them. All public methods are serialised by one lock (an overlay
capture of one sandbox delays another's checkpoint: crabd's scheduler
decides the order), and one process at a time owns a state directory
(flock on ``state_dir/lock``).
"""

from __future__ import annotations

import abc
import contextlib
import ctypes
import ctypes.util
import fcntl
import os
import queue
import re
import signal
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

from .errors import FailedPrecondition, InvalidArgument, NotFound
from .metadata import Metadata, Row
from .mount import Mount
from .tree import Change, Entry, diff_entries, diff_paths, scan

__all__ = ["Snapshotter", "Info", "Usage", "Kind"]


class Kind:
    ACTIVE = "active"
    COMMITTED = "committed"
    VIEW = "view"


@dataclass(frozen=True)
class Info:
    """What `stat` and `walk` return about one snapshot."""

    name: str
    kind: str  # Kind.ACTIVE, Kind.COMMITTED or Kind.VIEW
    parent: str | None
    created: float
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Usage:
    """Bytes (allocated, not apparent) and inodes a snapshot adds over its parent."""

    size: int
    inodes: int


_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@:+=-]{0,254}$")

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.syncfs.argtypes = [ctypes.c_int]

# Failpoints let the crash-safety test kill the process at an exact step of a
# commit: DELTAFS_FAILPOINT=<name>[@<n>] makes the n-th (default first)
# `_failpoint(name)` SIGKILL the process. Unset, it costs one comparison.
_FAILPOINT, _, _n = os.environ.get("DELTAFS_FAILPOINT", "").partition("@")
_FAILPOINT_HITS = [int(_n or 1)]


def _failpoint(name: str) -> None:
    if _FAILPOINT == name:
        _FAILPOINT_HITS[0] -= 1
        if _FAILPOINT_HITS[0] <= 0:
            os.kill(os.getpid(), signal.SIGKILL)


# Chaos hook (`crabd bench chaos`, tests/integration/bench/test_chaos.py):
# CRABD_CHAOS=<phase>[,<phase>...] makes `chaos_point(phase)` announce itself
# on stderr ("crabd-chaos: <phase> <pid>") and then sleep CRABD_CHAOS_SLEEP
# seconds (default 0.3), so a test that watches stderr can SIGKILL the
# process at a random instant inside that phase. Unset, it costs one lookup.
_CHAOS = frozenset(p for p in os.environ.get("CRABD_CHAOS", "").split(",") if p)
_CHAOS_SLEEP = float(os.environ.get("CRABD_CHAOS_SLEEP", "0.3") or 0.3)


def chaos_point(phase: str) -> None:
    if phase in _CHAOS:
        import time
        os.write(2, f"crabd-chaos: {phase} {os.getpid()}\n".encode())
        time.sleep(_CHAOS_SLEEP)


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise InvalidArgument(
            f"snapshot key/name {name!r} is invalid: use 1-255 characters from [A-Za-z0-9._@:+=-], "
            "starting with a letter or digit")


class _Reaper:
    """Deletes trashed snapshot files in a background thread.

    remove() and a rollback must not wait for an rm -rf of a large upper dir
    (measured: 2.5 s for 10k files + 256 MiB on ext4), so drivers rename what
    goes into a trash name (O(1), inside the lock) and queue it here. gc()
    and close() wait for the queue; a crash leaves trash that gc() deletes.
    """

    # Deleting right away makes the next snapshot/prepare wait (measured:
    # a btrfs prepare right after destroying a subvolume with 256 MiB took
    # 79 ms instead of 2.5 ms; an overlay unmount syncs the upper fs while
    # the rm runs), so the reaper lets a rollback's prepare+mount go first.
    delay = 0.5

    def __init__(self, delete) -> None:
        self._delete = delete
        self._q: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._hurry = threading.Event()

    def put(self, item: object) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="deltafs-reaper", daemon=True)
            self._thread.start()
        self._q.put(item)

    def _run(self) -> None:
        while True:
            item = self._q.get()
            self._hurry.wait(self.delay)
            try:
                self._delete(item)
            except OSError:
                pass  # gc() retries what is left in the trash
            finally:
                self._q.task_done()

    def drain(self) -> None:
        self._hurry.set()
        try:
            self._q.join()
        finally:
            self._hurry.clear()


class Snapshotter(abc.ABC):
    """A store of active, view and committed snapshots under one state directory (see module doc)."""

    driver: str = ""

    def __init__(self, state_dir: str) -> None:
        self.state_dir = os.path.abspath(state_dir)
        os.makedirs(self.state_dir, mode=0o700, exist_ok=True)
        self._lock = threading.RLock()
        self._reaper = _Reaper(self._reap)
        self._lock_fd = os.open(os.path.join(self.state_dir, "lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise FailedPrecondition(
                f"state directory {self.state_dir} is in use by another process (flock on its 'lock' "
                "file); stop that process or use another state directory") from None
        self.meta = Metadata(os.path.join(self.state_dir, "metadata.db"))
        stored = self.meta.get_meta("driver")
        if stored is None:
            with self.meta.tx():
                self.meta.set_meta("driver", self.driver)
        elif stored != self.driver:
            raise FailedPrecondition(
                f"state directory {self.state_dir} holds {stored} snapshots; open it with driver={stored!r} "
                "or \"auto\"")

    # ---- driver hooks -------------------------------------------------------------
    @abc.abstractmethod
    def _create_active(self, row: Row, parent: Row | None) -> dict[str, Any]:
        """Make the on-disk state of a new active snapshot (temp, then rename); return its `extra`."""

    @abc.abstractmethod
    def _create_view(self, row: Row, parent: Row) -> dict[str, Any]:
        """Make whatever a view needs; return its `extra`."""

    @abc.abstractmethod
    def _mounts(self, row: Row) -> list[Mount]:
        """Mount specs of an active or view snapshot."""

    @abc.abstractmethod
    def _capture(self, active: Row, new: Row, consume: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
        """Create committed `new` from `active`'s current content (temp, then rename).

        Returns (extra for `new`, updated extra for `active`). Runs inside the
        metadata transaction; the caller has frozen the sandbox. `consume`:
        the active is removed in the same transaction (commit), so its files
        may be moved rather than copied (see _finish_commit).
        """

    def _finish_commit(self, active: Row, new: Row) -> None:
        """After commit()'s transaction: default, discard the consumed active."""
        self._discard(active)

    def _reap(self, item: object) -> None:
        """Delete one trashed item (runs in the reaper thread, without the lock)."""

    @abc.abstractmethod
    def _discard(self, row: Row) -> None:
        """Delete the on-disk state of a row already removed from the metadata; best-effort."""

    @abc.abstractmethod
    def _gc_disk(self, rows: list[Row]) -> list[str]:
        """Delete on-disk state the metadata does not know; return what was deleted."""

    @abc.abstractmethod
    @contextmanager
    def _readable(self, row: Row) -> Iterator[str]:
        """A path where the snapshot's tree can be read (mounting a temporary view if needed)."""

    def _prepare_checkpoint(self, row: Row) -> None:
        """Driver hook for `prepare_checkpoint`; default: nothing to do."""

    def _mounted_at(self, row: Row) -> list[str]:
        """Where an active snapshot is mounted in this mount namespace; default: unknown."""
        return []

    # Committed snapshots can be read without the lock (see usage()); the
    # preparation of a checkpoint is a flush that needs no lock (see
    # prepare_checkpoint()).
    _usage_unlocked = False
    _prepare_unlocked = False

    def _usage(self, row: Row, parent: Row | None) -> Usage:
        """Default: allocated bytes of entries added or modified relative to the parent."""
        new = self._tree(row)
        old = self._tree(parent) if parent else {}
        size = inodes = 0
        seen: set[int] = set()
        for c in diff_entries(old, new):
            if c.kind == "deleted":
                continue
            e = new[c.path]
            inodes += 1
            if e.ino not in seen:
                seen.add(e.ino)
                size += e.allocated
        return Usage(size=size, inodes=inodes)

    # ---- public interface ---------------------------------------------------------
    def prepare(self, key: str, parent: str | None = None, labels: dict[str, str] | None = None) -> list[Mount]:
        """Create active snapshot `key` on top of committed `parent` (empty when None); return its mounts."""
        _check_name(key)
        with self._lock:
            with self.meta.tx():
                prow = self._committed_parent(parent, key)
                row = self.meta.insert(key, Kind.ACTIVE, prow.id if prow else None, labels)
                row.extra = self._create_active(row, prow)
                self.meta.update(row.id, extra=row.extra)
                _failpoint("prepare-before-commit")
            return self._mounts(row)

    def view(self, key: str, parent: str, labels: dict[str, str] | None = None) -> list[Mount]:
        """Create read-only view `key` of committed `parent`; return its mounts."""
        _check_name(key)
        with self._lock:
            with self.meta.tx():
                prow = self._committed_parent(parent, key)
                assert prow is not None
                row = self.meta.insert(key, Kind.VIEW, prow.id, labels)
                row.extra = self._create_view(row, prow)
                self.meta.update(row.id, extra=row.extra)
            return self._mounts(row)

    def mounts(self, key: str) -> list[Mount]:
        """Mount specs of active or view `key` (the same specs prepare/view returned)."""
        with self._lock:
            row = self.meta.get(key)
            if row.kind == Kind.COMMITTED:
                raise InvalidArgument(f"{key!r} is committed and has no mounts; create a view of it with view()")
            return self._mounts(row)

    def prepare_checkpoint(self, key: str) -> None:
        """Start the expensive part of the next checkpoint of `key` while the sandbox still runs.

        btrfs: write back the dirty pages a snapshot would flush. overlay:
        pre-copy changed files, so the frozen capture only re-checks them.
        Optional: checkpoint() is correct without it, only its pause is longer.
        A driver whose preparation is a plain flush (`_prepare_unlocked`)
        runs it without the store's lock, so other sandboxes' checkpoints
        (frozen meanwhile) do not wait for it.
        """
        with self._lock:
            row = self._active(key, "prepare a checkpoint of")
            if not self._prepare_unlocked:
                self._prepare_checkpoint(row)
                return
        self._prepare_checkpoint(row)

    def checkpoint(self, key: str, name: str | None = None, labels: dict[str, str] | None = None) -> str:
        """Freeze the content of active `key` as a new committed snapshot; keep `key` live on top of it.

        The caller freezes the sandbox around this call. Returns the new name
        (default ``<key>@<id>``).
        """
        with self._lock:
            row = self._active(key, "checkpoint")
            with self._too_deep(key), self.meta.tx():
                if name is None:
                    name = f"{key}@{self._next_id()}"
                _check_name(name)
                new = self.meta.insert(name, Kind.COMMITTED, row.parent, labels)
                new.extra, active_extra = self._capture(row, new)
                self.meta.update(new.id, extra=new.extra)
                self.meta.update(row.id, parent=new.id, extra=active_extra)
                _failpoint("checkpoint-before-commit")
            _failpoint("checkpoint-after-commit")
            return name

    @contextlib.contextmanager
    def _too_deep(self, key: str) -> Iterator[None]:
        """A sandbox can nest directories thousands of levels deep; a driver
        whose capture (or manifest) is recursive stops with RecursionError,
        and the transaction inside this undoes the half-made snapshot."""
        try:
            yield
        except RecursionError:
            raise FailedPrecondition(
                f"cannot capture {key!r}: its directory tree is nested too deeply for the {self.driver} driver; "
                "use the btrfs driver ([snapshot] driver = \"btrfs\") for sandboxes that make such trees") from None

    def commit(self, name: str, key: str, labels: dict[str, str] | None = None) -> None:
        """Create committed `name` from active `key`'s content and remove `key` (unmount it first)."""
        _check_name(name)
        with self._lock:
            row = self._active(key, "commit")
            with self._too_deep(key), self.meta.tx():
                new = self.meta.insert(name, Kind.COMMITTED, row.parent, labels)
                new.extra, _ = self._capture(row, new, consume=True)
                self.meta.update(new.id, extra=new.extra)
                self.meta.delete(row.id)
                _failpoint("commit-before-commit")
            self._finish_commit(row, new)

    def compact(self, name: str | None = None) -> int:
        """Bound the layer depth of committed snapshots (all, or `name`); returns merges done.

        For crabd's scheduler to run at idle time. Drivers without layers
        (btrfs) have nothing to do.
        """
        return 0

    def depth(self, name: str) -> int:
        """How many layers a mount of snapshot `name` stacks (1 for btrfs)."""
        with self._lock:
            self.meta.get(name)
        return 1

    def stat(self, key: str) -> Info:
        with self._lock:
            return self._info(self.meta.get(key))

    def walk(self) -> Iterator[Info]:
        """Every snapshot's Info, oldest first."""
        with self._lock:
            rows = self.meta.all()
            by_id = {r.id: r.name for r in rows}
        for r in rows:
            yield Info(r.name, r.kind, by_id.get(r.parent) if r.parent else None, r.created, r.labels)

    def usage(self, name: str) -> Usage:
        """Bytes and inodes snapshot `name` adds over its parent.

        On drivers whose committed snapshots are immutable directories
        (`_usage_unlocked`), the walk of a committed snapshot runs without
        the store's lock: it takes up to a second, and a sandbox frozen for
        its checkpoint must not wait for it. A snapshot removed meanwhile
        makes the walk fail with OSError."""
        with self._lock:
            row = self.meta.get(name)
            parent = self.meta.by_id(row.parent) if row.parent else None
            if not (self._usage_unlocked and row.kind == Kind.COMMITTED):
                return self._usage(row, parent)
        return self._usage(row, parent)

    def tree(self, name: str) -> dict[bytes, Entry]:
        """The file tree of any snapshot, path -> Entry (never following symlinks)."""
        with self._lock:
            return self._tree(self.meta.get(name))

    def diff(self, a: str | None, b: str) -> list[Change]:
        """Added / modified / deleted paths from snapshot `a` (empty tree when None) to `b`."""
        with contextlib.ExitStack() as stack:
            with self._lock:
                ra = self.meta.get(a) if a else None
                rb = self.meta.get(b)
                pa = stack.enter_context(self._readable(ra)) if ra is not None else None
                pb = stack.enter_context(self._readable(rb))
            # Scanning a tree of a million files takes minutes: not under the
            # store's lock, so other sandboxes' checkpoints go on meanwhile.
            # What is scanned does not change (committed) or is pinned by the
            # view mounted above; a concurrent remove fails this scan, it
            # cannot make it lie.
            old = scan(pa) if pa is not None else {}
            new = scan(pb)
        return diff_entries(old, new)

    def diff_from(self, a: str, old: dict[bytes, Entry], b: str) -> tuple[list[Change], dict[bytes, Entry]]:
        """`diff(a, b)` with `old` = `tree(a)` (scanned before: committed
        snapshots never change), and `tree(b)`. Where the driver can name the
        paths that differ without a scan (`_changed_paths`: btrfs asks the
        kernel, `btrfs send --no-data`), only those are looked at in `b`;
        otherwise `b` is scanned in full. Both give the same result."""
        with contextlib.ExitStack() as stack:
            with self._lock:
                ra = self.meta.get(a)
                rb = self.meta.get(b)
                pb = stack.enter_context(self._readable(rb))
            # Not under the store's lock (as in diff()): a concurrent remove
            # fails the look, it cannot make it lie.
            paths = self._changed_paths(ra, rb)
            if paths is None:
                new = scan(pb)
                return diff_entries(old, new), new
            return diff_paths(old, pb, paths)

    def _changed_paths(self, a: Row, b: Row) -> set[bytes] | None:
        """Every path at which committed `b` may differ from committed `a`
        (see `tree.diff_paths`), or None when the driver cannot tell without
        a scan."""
        return None

    def remove(self, key: str, *, reparent: bool = False) -> None:
        """Remove any snapshot; refuses while another snapshot has it as parent, or while
        an active one is still mounted (its files are deleted).

        With `reparent=True` a committed snapshot that is a parent can go too
        (retention of old checkpoints): its children take its parent as
        theirs. Their content does not change: btrfs snapshots are
        independent subvolumes, and an overlay layer stays on disk for as
        long as a remaining chain stacks it (gc() deletes it after
        compaction has merged it away)."""
        with self._lock:
            row = self.meta.get(key)
            if row.kind == Kind.ACTIVE:
                where = self._mounted_at(row)
                if where:
                    raise FailedPrecondition(
                        f"cannot remove {key!r}: it is mounted at {', '.join(where)}; stop its sandbox and "
                        "unmount it first (deltafs.unmount(target, background=True))")
            kids = self.meta.children(row.id)
            if kids and not (reparent and row.kind == Kind.COMMITTED):
                users = ", ".join(f"{k.name} ({k.kind})" for k in kids[:10])
                raise FailedPrecondition(
                    f"cannot remove {key!r}: it is the parent of {users}"
                    f"{' and more' if len(kids) > 10 else ''}; remove those first")
            with self.meta.tx():
                for k in kids:
                    self.meta.update(k.id, parent=row.parent)
                self.meta.delete(row.id)
            self._discard(row)

    def gc(self) -> list[str]:
        """Delete on-disk state the metadata does not know (leftovers of crashes); return what went."""
        with self._lock:
            self._reaper.drain()
            return self._gc_disk(self.meta.all())

    def sync(self) -> None:
        """Make every snapshot and the metadata durable (syncfs of the file systems they live on).

        A checkpoint is consistent when checkpoint() returns and durable after
        sync(); callers run it after thawing the sandbox. The syncfs calls run
        without the store's lock (they can take long on a busy disk, and
        everything committed before the call is flushed either way).
        """
        with self._lock:
            paths = self._sync_paths()
        for path in paths:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                if _libc.syncfs(fd) != 0:
                    e = ctypes.get_errno()
                    raise OSError(e, f"syncfs {path}: {os.strerror(e)}")
            finally:
                os.close(fd)

    def _sync_paths(self) -> list[str]:
        return [self.state_dir]

    def close(self) -> None:
        """Release the metadata and the state-dir lock; idempotent. Mounts stay as they are."""
        with self._lock:
            if self._lock_fd < 0:
                return
            self._reaper.drain()
            self.meta.close()
            os.close(self._lock_fd)
            self._lock_fd = -1

    def __enter__(self) -> "Snapshotter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- helpers ----------------------------------------------------------------------
    def _tree(self, row: Row) -> dict[bytes, Entry]:
        with self._readable(row) as path:
            return scan(path)

    def _info(self, row: Row) -> Info:
        parent = self.meta.by_id(row.parent).name if row.parent else None
        return Info(row.name, row.kind, parent, row.created, row.labels)

    def _active(self, key: str, verb: str) -> Row:
        row = self.meta.get(key)
        if row.kind != Kind.ACTIVE:
            raise FailedPrecondition(f"cannot {verb} {key!r}: it is {row.kind}, not active")
        return row

    def _committed_parent(self, parent: str | None, key: str) -> Row | None:
        if parent is None:
            return None
        prow = self.meta.find(parent)
        if prow is None:
            raise NotFound(f"parent {parent!r} of {key!r} does not exist")
        if prow.kind != Kind.COMMITTED:
            raise InvalidArgument(f"parent {parent!r} of {key!r} is {prow.kind}; a parent must be committed "
                                  "(checkpoint or commit it first)")
        return prow

    def _next_id(self) -> int:
        r = self.meta.db.execute("SELECT seq FROM sqlite_sequence WHERE name='snapshots'").fetchone()
        return (r[0] if r else 0) + 1
