"""Snapshot metadata in SQLite (WAL) under the state directory.

The database is the truth about which snapshots exist; directories on disk
are named by the integer row id and are created under a temporary name, then
renamed into place *inside* the transaction that inserts the row (the row
commits after the rename). A crash therefore leaves at most a directory the
database does not know, which `Snapshotter.gc()` deletes. Removal is the
reverse: the row goes first, files are deleted best-effort afterwards.

Keys (active and view snapshots) and names (committed ones) share one
namespace, as in containerd.
"""

from __future__ import annotations

import json
import sqlite3
import time
from types import EllipsisType
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

from .errors import AlreadyExists, FailedPrecondition, NotFound

__all__ = ["Metadata", "Row", "SCHEMA_VERSION"]

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS snapshots (
    id      INTEGER PRIMARY KEY AUTOINCREMENT,
    name    TEXT NOT NULL UNIQUE,
    kind    TEXT NOT NULL CHECK (kind IN ('active', 'committed', 'view')),
    parent  INTEGER REFERENCES snapshots(id),
    created REAL NOT NULL,
    labels  TEXT NOT NULL DEFAULT '{}',
    extra   TEXT NOT NULL DEFAULT '{}'   -- driver data (overlay: layer chain, mounted lowers)
);
CREATE INDEX IF NOT EXISTS snapshots_parent ON snapshots(parent);
-- Merged (compacted) overlay layers; ids name their directories.
CREATE TABLE IF NOT EXISTS merges (id INTEGER PRIMARY KEY AUTOINCREMENT, created REAL NOT NULL);
"""


@dataclass
class Row:
    id: int
    name: str
    kind: str
    parent: int | None
    created: float
    labels: dict[str, str] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


class Metadata:
    """Thin typed access to the snapshots table. Not thread-safe: the Snapshotter serialises calls."""

    def __init__(self, path: str) -> None:
        try:
            self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=10)
            # Exclusive before WAL: the WAL index then lives in this process's
            # heap, not in a shared mmap of a -shm file. A write fault on that
            # mmap (a copy-on-write state dir that a sandbox filled) is a
            # SIGBUS that kills the process; a heap index cannot fault, and a
            # full disk is then an ordinary SQLITE_FULL error. One process
            # owns a snapshot store anyway (see the snapshotter's lock).
            self.db.execute("PRAGMA locking_mode=EXCLUSIVE")
            self.db.execute("PRAGMA journal_mode=WAL")
            # NORMAL in WAL mode: a power loss may drop the last transactions
            # but never corrupts; the disk side (gc) copes with either. FULL
            # would put an fsync of the WAL inside every checkpoint's pause.
            self.db.execute("PRAGMA synchronous=NORMAL")
            self.db.execute("PRAGMA foreign_keys=ON")
            self.db.executescript(_SCHEMA)
        except sqlite3.Error as e:
            raise FailedPrecondition(f"cannot open snapshot metadata {path}: {e}; check the state "
                                     "directory is writable and the file is not corrupt") from e
        v = self.get_meta("schema_version")
        if v is None:
            self.set_meta("schema_version", str(SCHEMA_VERSION))
        elif int(v) != SCHEMA_VERSION:
            raise FailedPrecondition(f"{path} has schema version {v}, this deltafs reads {SCHEMA_VERSION}")

    def close(self) -> None:
        self.db.close()

    @contextmanager
    def tx(self) -> Iterator[None]:
        """One write transaction; rolled back on any exception."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    def get_meta(self, k: str) -> str | None:
        r = self.db.execute("SELECT v FROM meta WHERE k=?", (k,)).fetchone()
        return r[0] if r else None

    def set_meta(self, k: str, v: str) -> None:
        self.db.execute("INSERT OR REPLACE INTO meta(k, v) VALUES (?, ?)", (k, v))

    @staticmethod
    def _row(r: tuple) -> Row:
        return Row(id=r[0], name=r[1], kind=r[2], parent=r[3], created=r[4],
                   labels=json.loads(r[5]), extra=json.loads(r[6]))

    _COLS = "id, name, kind, parent, created, labels, extra"

    def find(self, name: str) -> Row | None:
        r = self.db.execute(f"SELECT {self._COLS} FROM snapshots WHERE name=?", (name,)).fetchone()
        return self._row(r) if r else None

    def get(self, name: str) -> Row:
        row = self.find(name)
        if row is None:
            raise NotFound(f"snapshot {name!r} does not exist")
        return row

    def by_id(self, id: int) -> Row:
        r = self.db.execute(f"SELECT {self._COLS} FROM snapshots WHERE id=?", (id,)).fetchone()
        if r is None:
            raise NotFound(f"snapshot id {id} does not exist")
        return self._row(r)

    def all(self) -> list[Row]:
        return [self._row(r) for r in self.db.execute(f"SELECT {self._COLS} FROM snapshots ORDER BY id")]

    def children(self, id: int) -> list[Row]:
        return [self._row(r) for r in
                self.db.execute(f"SELECT {self._COLS} FROM snapshots WHERE parent=? ORDER BY id", (id,))]

    def insert(self, name: str, kind: str, parent: int | None, labels: dict[str, str] | None = None,
               extra: dict[str, Any] | None = None) -> Row:
        try:
            cur = self.db.execute(
                "INSERT INTO snapshots(name, kind, parent, created, labels, extra) VALUES (?,?,?,?,?,?)",
                (name, kind, parent, time.time(), json.dumps(labels or {}), json.dumps(extra or {})))
        except sqlite3.IntegrityError as e:
            raise AlreadyExists(f"snapshot {name!r} already exists") from e
        return self.by_id(int(cur.lastrowid or 0))

    def update(self, id: int, *, parent: int | None | EllipsisType = ..., extra: dict[str, Any] | None = None) -> None:
        if parent is not ...:
            self.db.execute("UPDATE snapshots SET parent=? WHERE id=?", (parent, id))
        if extra is not None:
            self.db.execute("UPDATE snapshots SET extra=? WHERE id=?", (json.dumps(extra), id))

    def delete(self, id: int) -> None:
        self.db.execute("DELETE FROM snapshots WHERE id=?", (id,))

    def new_merge_id(self) -> int:
        cur = self.db.execute("INSERT INTO merges(created) VALUES (?)", (time.time(),))
        return int(cur.lastrowid or 0)

    def merge_ids(self) -> list[int]:
        return [r[0] for r in self.db.execute("SELECT id FROM merges")]

    def delete_merge(self, id: int) -> None:
        self.db.execute("DELETE FROM merges WHERE id=?", (id,))
