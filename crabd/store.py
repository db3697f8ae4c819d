"""crabd's metadata store: SQLite in WAL mode under the state directory.

What it holds: sandboxes, checkpoints (per-sandbox monotonic sequence,
parent, branch, turn, Effects, Plan, file-system snapshot, process image,
bytes, durations, digest, schema version, state), and events. Blobs (layers,
CRIU images) live on disk; the store holds their names.

Checkpoint rows are written `pending` when a turn's capture is scheduled and
become `committed` only after the blobs are durable, inside one transaction;
after a crash, `pending` rows are what restart recovery finishes or discards.
Nothing is ever listed as committed that was not.

Each committed checkpoint carries a digest: blake3, keyed with a host secret
(`<state>/secret`, mode 0600, created at first start), over the row's
identifying fields, so a tampered row is detected before it is used.
Covered: id, sandbox_id, seq, parent, branch, turn, plan, effects,
fs_snapshot, proc_image, bytes, schema_version, created_at and the seals
of its layer and process image. Not covered (informational): reasons,
durations, error; `state` is covered in effect (only a committed row with
a valid digest is ever used, and only a commit writes a digest).

Schema changes are numbered migrations applied in order at open, recorded in
`PRAGMA user_version`; a database newer than this code is refused.

Size (~600 lines): one schema and every query of it. A checkpoint's commit
writes its row, its seals and its digest in one transaction, and retention,
branches and events read across the same tables: split by table, the
transaction boundaries would be spread over modules. The digest rules stay
beside the columns they cover.
"""

from __future__ import annotations

import json
import os
import secrets
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import blake3

from .errors import FailedPrecondition, IntegrityError, NotFound

__all__ = ["Store", "SandboxRow", "CheckpointRow", "Event", "SCHEMA_VERSION", "IntegrityError", "EVENTS_MAX_PAGE"]

MIGRATIONS: list[str] = [
    # 1: initial schema
    """
    CREATE TABLE sandboxes (
        id          TEXT PRIMARY KEY,
        name        TEXT NOT NULL UNIQUE,
        image       TEXT NOT NULL,
        owner       TEXT NOT NULL DEFAULT '',
        created_at  REAL NOT NULL,
        state       TEXT NOT NULL,            -- running | stopped | dead | recovering
        fs_key      TEXT NOT NULL,            -- deltafs active snapshot of its root
        head        TEXT,                     -- checkpoint the current state descends from
        branch      INTEGER NOT NULL DEFAULT 0,
        turn        INTEGER NOT NULL DEFAULT 0,
        next_seq    INTEGER NOT NULL DEFAULT 1,
        limits      TEXT NOT NULL DEFAULT '{}',
        lineage     TEXT NOT NULL,            -- root sandbox of its fork tree
        forked_from TEXT
    );
    CREATE TABLE checkpoints (
        id             TEXT PRIMARY KEY,      -- "<sandbox>-<seq>"
        sandbox_id     TEXT NOT NULL REFERENCES sandboxes(id) ON DELETE CASCADE,
        seq            INTEGER NOT NULL,
        parent         TEXT,
        branch         INTEGER NOT NULL,
        turn           INTEGER NOT NULL,
        plan           TEXT NOT NULL,         -- SKIP | FS | FS_PROC
        reasons        TEXT NOT NULL DEFAULT '[]',
        effects        TEXT NOT NULL DEFAULT '{}',
        fs_snapshot    TEXT,                  -- deltafs committed name (shared with parent on SKIP)
        proc_image     TEXT,                  -- deltacr image id, or NULL
        bytes          INTEGER NOT NULL DEFAULT 0,
        durations      TEXT NOT NULL DEFAULT '{}',
        digest         TEXT,
        schema_version INTEGER NOT NULL,
        created_at     REAL NOT NULL,
        state          TEXT NOT NULL,         -- pending | committed | failed
        error          TEXT,
        UNIQUE (sandbox_id, seq)
    );
    CREATE INDEX checkpoints_by_sandbox ON checkpoints (sandbox_id, seq);
    CREATE TABLE events (
        seq         INTEGER PRIMARY KEY AUTOINCREMENT,
        ts          REAL NOT NULL,
        sandbox_id  TEXT,
        kind        TEXT NOT NULL,
        data        TEXT NOT NULL DEFAULT '{}'
    );
    """,
    # 2: effects ledger and budgets (per sandbox lineage; see crabd/effects.py)
    """
    CREATE TABLE effects (
        id            TEXT PRIMARY KEY,
        lineage       TEXT NOT NULL,
        sandbox_id    TEXT,                   -- no FK: the ledger outlives deleted sandboxes
        branch        INTEGER NOT NULL DEFAULT 0,
        turn          INTEGER NOT NULL DEFAULT 0,
        checkpoint    TEXT,                   -- latest checkpoint when the intent was made
        op            TEXT NOT NULL,
        key           TEXT,                   -- idempotency key (may be NULL)
        fingerprint   TEXT NOT NULL,          -- canonical argument fingerprint
        postcondition TEXT,
        kind          TEXT NOT NULL DEFAULT 'managed',   -- managed | unmanaged
        state         TEXT NOT NULL,          -- intent | committed | failed | unknown
        receipt       TEXT,                   -- JSON
        result_digest TEXT,
        error         TEXT,
        replays       INTEGER NOT NULL DEFAULT 0,
        created_at    REAL NOT NULL,
        updated_at    REAL NOT NULL,
        digest        TEXT
    );
    CREATE INDEX effects_by_key ON effects (lineage, op, key);
    CREATE INDEX effects_by_fingerprint ON effects (lineage, op, fingerprint);
    CREATE INDEX effects_by_sandbox ON effects (sandbox_id, created_at);
    CREATE TABLE effect_policies (
        lineage     TEXT NOT NULL,
        op          TEXT NOT NULL,
        policy      TEXT NOT NULL,            -- replay | allow | ask
        PRIMARY KEY (lineage, op)
    );
    CREATE TABLE budgets (
        lineage       TEXT PRIMARY KEY,
        max_turns     INTEGER,                -- NULL: no limit
        max_wall_s    REAL,
        max_cost      REAL,
        max_retries   INTEGER,
        used_turns    INTEGER NOT NULL DEFAULT 0,
        used_wall_s   REAL NOT NULL DEFAULT 0,
        used_cost     REAL NOT NULL DEFAULT 0,
        used_retries  INTEGER NOT NULL DEFAULT 0,
        updated_at    REAL NOT NULL,
        digest        TEXT
    );
    """,
    # 3: seals of a checkpoint's committed layer and process image (JSON; see
    # crabd.daemon.integrity.Integrity.seal_row), recorded at commit and covered by the digest
    """
    ALTER TABLE checkpoints ADD COLUMN seals TEXT;
    """,
]
SCHEMA_VERSION = len(MIGRATIONS)


@dataclass
class SandboxRow:
    id: str
    name: str
    image: str
    fs_key: str
    lineage: str
    owner: str = ""
    created_at: float = field(default_factory=time.time)
    state: str = "running"
    head: str | None = None
    branch: int = 0
    turn: int = 0
    next_seq: int = 1
    limits: dict[str, Any] = field(default_factory=dict)
    forked_from: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class CheckpointRow:
    id: str
    sandbox_id: str
    seq: int
    parent: str | None
    branch: int
    turn: int
    plan: str
    reasons: list[str] = field(default_factory=list)
    effects: dict[str, Any] = field(default_factory=dict)
    fs_snapshot: str | None = None
    proc_image: str | None = None
    bytes: int = 0
    durations: dict[str, float] = field(default_factory=dict)
    digest: str | None = None
    schema_version: int = SCHEMA_VERSION
    created_at: float = field(default_factory=time.time)
    state: str = "pending"
    error: str | None = None
    seals: dict[str, Any] | None = None  # {"fs": deltafs seal, "proc": manifest digest}, set at commit

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


# One page of events holds at most this many: the API's cap, echoed in its reply.
EVENTS_MAX_PAGE = 1000


@dataclass
class Event:
    seq: int
    ts: float
    sandbox_id: str | None
    kind: str
    data: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


_SB_JSON = {"limits"}
_CK_JSON = {"reasons", "effects", "durations", "seals"}


_FS_IOC_GETFLAGS, _FS_IOC_SETFLAGS, _FS_NOCOW_FL = 0x80086601, 0x40086602, 0x00800000


def _nocow_wal_index(db: Path) -> None:
    """Make the database's WAL index (`<db>-shm`, which SQLite maps into
    memory) a NOCOW file before SQLite opens it. On btrfs every write to a
    copy-on-write page needs a new block: with the file system full (a
    sandbox filled the state dir) that write fault is a SIGBUS that kills
    the daemon. NOCOW pages are overwritten in place: SQLite allocates them
    when it grows the index (a write() that can fail cleanly), and a fault
    needs no new data block -- still some metadata, so the daemon also keeps
    headroom (crabd.daemon.space.SpaceReserve.make_room). The flag only takes on an empty file: a -shm left
    by a crash is removed first when no process uses it (SQLite rebuilds it
    from the WAL). No-op on file systems without the flag."""
    import array
    import fcntl
    shm = f"{db}-shm"
    # In use by a connection of this process: hands off (even opening and
    # closing it would drop that connection's POSIX locks on it).
    with open("/proc/self/maps") as maps:
        if any(line.rstrip("\n").endswith(" " + os.path.realpath(shm)) for line in maps):
            return
    try:
        fd = os.open(shm, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError:
        return
    try:
        if os.fstat(fd).st_size:
            try:  # in use by a connection elsewhere: it holds read locks on it; leave it
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return
            os.unlink(shm)
            os.close(fd)
            fd = -1
            fd = os.open(shm, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        flags = array.array("i", [0])
        fcntl.ioctl(fd, _FS_IOC_GETFLAGS, flags, True)
        if not flags[0] & _FS_NOCOW_FL:
            flags[0] |= _FS_NOCOW_FL
            fcntl.ioctl(fd, _FS_IOC_SETFLAGS, flags, True)
    except OSError:
        pass  # not btrfs (ext4, tmpfs): no copy-on-write pages to fault on
    finally:
        if fd >= 0:
            os.close(fd)


class Store:
    """Thread-safe access to crabd.db (one connection, serialised)."""

    def __init__(self, state_dir: Path | str) -> None:
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.state_dir / "crabd.db"
        self._key = _host_secret(self.state_dir / "secret")
        # Called with a committed checkpoint row, returns its seals (the daemon
        # sets it: the store does not know layers or images).
        self.sealer: Any = None
        # Called before each write, and before the reads of a row (the daemon
        # sets it): frees the state dir's space reserve when the file system
        # is (nearly) full, so that SQLite's write to its WAL index never
        # faults (see _nocow_wal_index). A read writes there too: a read
        # transaction takes a read mark in the WAL index.
        self.before_write: Any = None
        self._lock = threading.RLock()
        _nocow_wal_index(self.path)
        try:
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30)
            self._db.row_factory = sqlite3.Row
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute("PRAGMA foreign_keys=ON")
            self._migrate()
        except sqlite3.DatabaseError as e:
            raise FailedPrecondition(f"cannot open crabd's database {self.path}: {e}",
                                     fix=f"restore {self.path} from a backup or move it away") from e

    # --- schema -----------------------------------------------------------------
    def _migrate(self) -> None:
        with self._lock:
            have = self._db.execute("PRAGMA user_version").fetchone()[0]
            if have > SCHEMA_VERSION:
                raise FailedPrecondition(
                    f"{self.path} has schema version {have}, newer than this crabd ({SCHEMA_VERSION})",
                    fix="run the crabd version that wrote it, or a newer one")
            for v in range(have, SCHEMA_VERSION):
                # One script per migration, its own transaction: executescript
                # would commit any transaction opened around it.
                self._db.executescript(f"BEGIN IMMEDIATE;\n{MIGRATIONS[v]}\nPRAGMA user_version={v + 1};\nCOMMIT;")

    def _tx(self) -> Any:
        store = self

        class _Tx:
            def __enter__(self_inner) -> None:
                if store.before_write is not None:
                    store.before_write()
                store._lock.acquire()
                store._db.execute("BEGIN IMMEDIATE")

            def __exit__(self_inner, et: Any, ev: Any, tb: Any) -> None:
                try:
                    store._db.execute("COMMIT" if et is None else "ROLLBACK")
                except sqlite3.Error:
                    # A COMMIT that failed (SQLITE_FULL: the disk is full) may
                    # leave the transaction open: every later write would
                    # then pile onto it and fail the same way.
                    if store._db.in_transaction:
                        try:
                            store._db.execute("ROLLBACK")
                        except sqlite3.Error:
                            pass
                    raise
                finally:
                    store._lock.release()

        return _Tx()

    def transaction(self) -> Any:
        """A write transaction for several calls that must land together."""
        return self._tx()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # --- sandboxes ---------------------------------------------------------------
    def add_sandbox(self, row: SandboxRow) -> None:
        d = _encode(row.to_dict(), _SB_JSON)
        cols = ",".join(d)
        with self._lock:
            try:
                self._db.execute(f"INSERT INTO sandboxes ({cols}) VALUES ({','.join('?' * len(d))})", list(d.values()))
            except sqlite3.IntegrityError as e:
                from .errors import AlreadyExists
                raise AlreadyExists(f"a sandbox named {row.name!r} already exists") from e

    def get_sandbox(self, ref: str) -> SandboxRow:
        if self.before_write is not None:
            self.before_write()
        with self._lock:
            r = self._db.execute("SELECT * FROM sandboxes WHERE id=? OR name=?", (ref, ref)).fetchone()
        if r is None:
            raise NotFound(f"no sandbox {ref!r}", fix="GET /v1/sandboxes (crabd sandbox ls) lists them")
        return SandboxRow(**_decode(dict(r), _SB_JSON))

    def list_sandboxes(self, owner: str | None = None) -> list[SandboxRow]:
        q, args = "SELECT * FROM sandboxes", []
        if owner is not None:
            q, args = q + " WHERE owner=?", [owner]
        with self._lock:
            rows = self._db.execute(q + " ORDER BY created_at", args).fetchall()
        return [SandboxRow(**_decode(dict(r), _SB_JSON)) for r in rows]

    def update_sandbox(self, sid: str, **fields: Any) -> None:
        d = _encode(fields, _SB_JSON)
        sets = ",".join(f"{k}=?" for k in d)
        with self._lock:
            n = self._db.execute(f"UPDATE sandboxes SET {sets} WHERE id=?", [*d.values(), sid]).rowcount
        if n == 0:
            raise NotFound(f"no sandbox {sid!r}")

    def delete_sandbox(self, sid: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM sandboxes WHERE id=?", (sid,))

    def allocate_seq(self, sid: str) -> int:
        """The sandbox's next checkpoint sequence number (monotonic, never reused)."""
        with self._tx():
            r = self._db.execute("SELECT next_seq FROM sandboxes WHERE id=?", (sid,)).fetchone()
            if r is None:
                raise NotFound(f"no sandbox {sid!r}")
            self._db.execute("UPDATE sandboxes SET next_seq=? WHERE id=?", (r[0] + 1, sid))
            return int(r[0])

    # --- checkpoints -----------------------------------------------------------------
    def add_checkpoint(self, row: CheckpointRow) -> None:
        if row.state == "committed":
            if self.sealer is not None and row.seals is None:
                row.seals = self.sealer(row)
            row.digest = self.digest(row)
        d = _encode(row.to_dict(), _CK_JSON)
        with self._lock:
            self._db.execute(f"INSERT INTO checkpoints ({','.join(d)}) VALUES ({','.join('?' * len(d))})",
                             list(d.values()))

    def commit_checkpoint(self, cid: str, **fields: Any) -> CheckpointRow:
        """Mark a pending checkpoint committed (with its final fields, seals and digest)."""
        if self.sealer is not None and "seals" not in fields:
            # Seal outside the write transaction: hashing a layer takes a while.
            probe = self.get_checkpoint(cid)
            for k, v in fields.items():
                setattr(probe, k, v)
            fields = {**fields, "seals": self.sealer(probe)}
        with self._tx():
            row = self._get_checkpoint_unlocked(cid)
            for k, v in fields.items():
                setattr(row, k, v)
            row.state = "committed"
            row.error = None
            row.digest = self.digest(row)
            d = _encode({k: getattr(row, k) for k in (*fields, "state", "error", "digest")}, _CK_JSON)
            self._db.execute(f"UPDATE checkpoints SET {','.join(f'{k}=?' for k in d)} WHERE id=?",
                             [*d.values(), cid])
        return row

    def set_checkpoint_bytes(self, cid: str, nbytes: int, durations: dict[str, float] | None = None) -> CheckpointRow:
        """Fill in the size of a committed checkpoint, measured after its commit
        (idle work), and re-sign it: `bytes` is part of the digest."""
        with self._tx():
            row = self._get_checkpoint_unlocked(cid)
            intact = row.state == "committed" and self._intact(row)
            row.bytes = nbytes
            if durations:
                row.durations = {**row.durations, **durations}
            if intact:
                row.digest = self.digest(row)  # (a tampered row keeps its wrong digest: never launder it)
            d = _encode({"bytes": row.bytes, "durations": row.durations, "digest": row.digest}, _CK_JSON)
            self._db.execute("UPDATE checkpoints SET bytes=?, durations=?, digest=? WHERE id=?", [*d.values(), cid])
        return row

    def fail_checkpoint(self, cid: str, error: str) -> None:
        with self._lock:
            self._db.execute("UPDATE checkpoints SET state='failed', error=? WHERE id=?", (error, cid))

    def get_checkpoint(self, cid: str, *, verify: bool = False) -> CheckpointRow:
        if self.before_write is not None:
            self.before_write()
        with self._lock:
            row = self._get_checkpoint_unlocked(cid)
        if verify:
            self.verify(row)
        return row

    def _get_checkpoint_unlocked(self, cid: str) -> CheckpointRow:
        r = self._db.execute("SELECT * FROM checkpoints WHERE id=?", (cid,)).fetchone()
        if r is None:
            raise NotFound(f"no checkpoint {cid!r}", fix="GET /v1/sandboxes/{id}/checkpoints lists them")
        return CheckpointRow(**_decode(dict(r), _CK_JSON))

    def list_checkpoints(self, sid: str, *, states: tuple[str, ...] = ("committed",)) -> list[CheckpointRow]:
        marks = ",".join("?" * len(states))
        with self._lock:
            rows = self._db.execute(f"SELECT * FROM checkpoints WHERE sandbox_id=? AND state IN ({marks}) ORDER BY seq",
                                    (sid, *states)).fetchall()
        return [CheckpointRow(**_decode(dict(r), _CK_JSON)) for r in rows]

    def pending_checkpoints(self) -> list[CheckpointRow]:
        with self._lock:
            rows = self._db.execute("SELECT * FROM checkpoints WHERE state='pending' ORDER BY created_at").fetchall()
        return [CheckpointRow(**_decode(dict(r), _CK_JSON)) for r in rows]

    def delete_checkpoint(self, cid: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM checkpoints WHERE id=?", (cid,))

    def drop_checkpoint(self, cid: str) -> CheckpointRow:
        """Retention: delete a checkpoint row; its children take its parent as
        theirs, so every line stays walkable back to the initial state."""
        with self._tx():
            row = self._get_checkpoint_unlocked(cid)
            for r in self._db.execute("SELECT id FROM checkpoints WHERE parent=?", (cid,)).fetchall():
                child = self._get_checkpoint_unlocked(r[0])
                intact = child.state == "committed" and self._intact(child)
                child.parent = row.parent
                # The parent is part of the digest: re-sign what crabd itself
                # changed -- only if the row was intact (never launder a tamper).
                digest = self.digest(child) if intact else child.digest
                self._db.execute("UPDATE checkpoints SET parent=?, digest=? WHERE id=?", (row.parent, digest, child.id))
            self._db.execute("UPDATE sandboxes SET head=? WHERE head=?", (row.parent, cid))
            self._db.execute("DELETE FROM checkpoints WHERE id=?", (cid,))
        return row

    def fork_bases(self) -> set[str]:
        """Checkpoints other sandboxes were forked from."""
        with self._lock:
            return {r[0] for r in self._db.execute("SELECT forked_from FROM sandboxes WHERE forked_from IS NOT NULL")}

    def children(self, cid: str) -> list[str]:
        with self._lock:
            return [r[0] for r in self._db.execute("SELECT id FROM checkpoints WHERE parent=?", (cid,))]

    def fs_snapshot_refs(self, name: str) -> int:
        """How many checkpoints (any state but failed) refer to a deltafs snapshot."""
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM checkpoints WHERE fs_snapshot=? AND state!='failed'",
                                        (name,)).fetchone()[0])

    def proc_image_refs(self, image: str) -> int:
        """How many checkpoints refer to a deltacr process image."""
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM checkpoints WHERE proc_image=? AND state!='failed'",
                                        (image,)).fetchone()[0])

    # --- integrity -----------------------------------------------------------------
    def digest(self, row: CheckpointRow) -> str:
        fields = {k: getattr(row, k) for k in ("id", "sandbox_id", "seq", "parent", "branch", "turn", "plan",
                                               "fs_snapshot", "proc_image", "bytes", "schema_version", "created_at")}
        fields["effects"] = row.effects
        if row.seals is not None:  # (rows from before migration 3 have none: their digest stays valid)
            fields["seals"] = row.seals
        canon = json.dumps(fields, sort_keys=True, separators=(",", ":"), default=str).encode()
        return blake3.blake3(canon, key=self._key).hexdigest()

    def sign(self, fields: dict[str, Any]) -> str:
        """The keyed digest of any other signed row (effects, budgets: crabd/effects.py)."""
        canon = json.dumps(fields, sort_keys=True, separators=(",", ":"), default=str).encode()
        return blake3.blake3(canon, key=self._key).hexdigest()

    def _intact(self, row: CheckpointRow) -> bool:
        return bool(row.digest) and secrets.compare_digest(row.digest or "", self.digest(row))

    def verify(self, row: CheckpointRow) -> None:
        if row.state != "committed":
            raise FailedPrecondition(f"checkpoint {row.id} is {row.state}, not committed")
        if not row.digest or not secrets.compare_digest(row.digest, self.digest(row)):
            raise IntegrityError(f"checkpoint {row.id}'s metadata does not match its digest: refusing to use it",
                                 fix="it was modified outside crabd; roll back to another checkpoint")

    # --- events ----------------------------------------------------------------------
    def add_event(self, kind: str, sandbox_id: str | None = None, **data: Any) -> Event:
        ts = time.time()
        if self.before_write is not None:
            self.before_write()
        with self._lock:
            cur = self._db.execute("INSERT INTO events (ts, sandbox_id, kind, data) VALUES (?,?,?,?)",
                                   (ts, sandbox_id, kind, json.dumps(data, default=str)))
            seq = int(cur.lastrowid or 0)
        return Event(seq, ts, sandbox_id, kind, data)

    def events_since(self, seq: int = 0, sandbox_id: str | None = None, limit: int = EVENTS_MAX_PAGE) -> list[Event]:
        """Events after `seq`, oldest first (at most `limit`)."""
        return self.events_page(since=seq, sandbox_id=sandbox_id, limit=limit)[0]

    def checkpoint_totals(self, since: float) -> tuple[dict[str, dict[str, Any]], dict[str, float]]:
        """Per sandbox: committed checkpoints, their bytes and the newest
        checkpoint's plan; and host-wide, the checkpoints committed since
        `since` (a time) and their bytes. One pass over the table, for the
        operator view's host summary (not one query per sandbox)."""
        # `plan` is a bare column beside the one MAX(): SQLite takes it from
        # the row with the greatest seq (documented for min/max aggregates).
        with self._lock:
            rows = self._db.execute(
                "SELECT sandbox_id, MAX(seq) AS last, plan, SUM(state='committed') AS n, "
                "SUM(CASE WHEN state='committed' THEN bytes ELSE 0 END) AS bytes, "
                "SUM(state='committed' AND created_at >= ?) AS rn, "
                "SUM(CASE WHEN state='committed' AND created_at >= ? THEN bytes ELSE 0 END) AS rb "
                "FROM checkpoints WHERE state IN ('committed','pending') GROUP BY sandbox_id",
                (since, since)).fetchall()
        out = {r["sandbox_id"]: {"checkpoints": r["n"], "bytes": r["bytes"] or 0, "last_plan": r["plan"]} for r in rows}
        return out, {"checkpoints": sum(r["rn"] for r in rows), "bytes": sum(r["rb"] or 0 for r in rows)}

    def events_page(self, *, since: int = 0, before: int | None = None, sandbox_id: str | None = None,
                    owner: str | None = None, limit: int = EVENTS_MAX_PAGE,
                    newest_first: bool = False) -> tuple[list[Event], bool]:
        """One page of the events with `since` < seq < `before`: the oldest
        `limit` of them, or with `newest_first` the newest `limit`, newest
        first. `owner`: only events of that owner's (existing) sandboxes.
        Returns (events, more): `more` says the range holds events beyond the
        page (newer ones, or older ones with `newest_first`)."""
        q = "SELECT * FROM events WHERE seq>?"
        args: list[Any] = [since]
        if before is not None:
            q += " AND seq<?"
            args.append(before)
        if sandbox_id:
            q += " AND sandbox_id=?"
            args.append(sandbox_id)
        if owner is not None:
            q += " AND sandbox_id IN (SELECT id FROM sandboxes WHERE owner=?)"
            args.append(owner)
        q += " ORDER BY seq DESC" if newest_first else " ORDER BY seq"
        with self._lock:
            rows = self._db.execute(q + " LIMIT ?", (*args, limit + 1)).fetchall()
        evs = [Event(r["seq"], r["ts"], r["sandbox_id"], r["kind"], json.loads(r["data"])) for r in rows[:limit]]
        return evs, len(rows) > limit

    def last_event_seq(self, sandbox_id: str | None = None, owner: str | None = None) -> int:
        """The newest event's seq (of that sandbox / owner; 0: none yet): where a tail starts."""
        evs, _ = self.events_page(sandbox_id=sandbox_id, owner=owner, limit=1, newest_first=True)
        return evs[0].seq if evs else 0

    def iter_all_checkpoints(self) -> Iterator[CheckpointRow]:
        with self._lock:
            rows = self._db.execute("SELECT * FROM checkpoints ORDER BY sandbox_id, seq").fetchall()
        for r in rows:
            yield CheckpointRow(**_decode(dict(r), _CK_JSON))


def _encode(d: dict[str, Any], json_cols: set[str]) -> dict[str, Any]:
    return {k: (json.dumps(v, default=str) if k in json_cols else v) for k, v in d.items()}


def _decode(d: dict[str, Any], json_cols: set[str]) -> dict[str, Any]:
    return {k: (json.loads(v) if k in json_cols and isinstance(v, str) else v) for k, v in d.items()}


def _host_secret(path: Path) -> bytes:
    """32 random bytes, created once with mode 0600, the key of metadata digests."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        data = path.read_bytes()
        if len(data) != 32:
            raise FailedPrecondition(f"host secret {path} is damaged ({len(data)} bytes)",
                                     fix=f"remove {path} (existing checkpoints will then fail verification)")
        return data
    key = secrets.token_bytes(32)
    try:
        os.write(fd, key)
        os.fsync(fd)
    finally:
        os.close(fd)
    return key
