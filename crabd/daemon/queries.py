"""Queries of checkpoints (list, describe, resolve, diff), their deletion by
hand, and the daemon's health.

Part of `crabd.daemon`: the read side the API serves, plus
`delete_checkpoint`. Nothing here runs a sandbox's processes.
"""

from __future__ import annotations

import base64
import time
from typing import Any

from ..errors import FailedPrecondition, NotFound
from ..store import SCHEMA_VERSION, CheckpointRow, SandboxRow
from .base import DaemonBase
from .events import EventKind
from .names import checkpoint_id

__all__ = ["Queries"]


class Queries(DaemonBase):
    def list_checkpoints(self, ref: str, owner: str | None = None, all_states: bool = False) -> list[dict[str, Any]]:
        from ..retention import keep_reasons
        row = self._own(self.store.get_sandbox(ref), owner)
        states = ("committed", "pending", "failed") if all_states else ("committed", "pending")
        cks = self.store.list_checkpoints(row.id, states=states)
        why = keep_reasons([(c.id, c.seq) for c in cks if c.state == "committed"], self._retention(),
                           head=row.head, protected=self._protected(row.id))
        out = []
        for c in cks:
            d = self._ck_summary(c, row)
            # Why retention keeps it; empty = the next idle maintenance retires it.
            d["kept"] = why.get(c.id, []) if c.state == "committed" else []
            out.append(d)
        return out

    def _ck_summary(self, c: CheckpointRow, row: SandboxRow | None = None) -> dict[str, Any]:
        out = {k: v for k, v in c.to_dict().items() if k not in ("effects",)}
        if row is not None:
            out["head"] = c.id == row.head
        return out

    def checkpoint_info(self, cid: str, owner: str | None = None) -> dict[str, Any]:
        c = self.store.get_checkpoint(cid)
        self._own(self.store.get_sandbox(c.sandbox_id), owner)
        return c.to_dict()

    def resolve_checkpoint(self, sid: str, ref: str | int) -> CheckpointRow:
        """A checkpoint of sandbox `sid` by id or sequence number; 409 when it
        belongs to another sandbox."""
        if isinstance(ref, int) or (isinstance(ref, str) and ref.isdigit()):
            return self.store.get_checkpoint(checkpoint_id(sid, int(ref)))
        c = self.store.get_checkpoint(str(ref))
        if c.sandbox_id != sid:
            try:
                other = self.store.get_sandbox(c.sandbox_id).owner
            except NotFound:
                other = None
            if other != self.store.get_sandbox(sid).owner:
                # Another owner's checkpoint: as unknown as it is to them (no id leaks).
                raise NotFound(f"no checkpoint {str(ref)!r}", fix="GET /v1/sandboxes/{id}/checkpoints lists them")
            raise FailedPrecondition(f"checkpoint {c.id} belongs to sandbox {c.sandbox_id}, not {sid}",
                                     fix=f"fork it instead: POST /v1/checkpoints/{c.id}/fork")
        return c

    def delete_checkpoint(self, cid: str, owner: str | None = None) -> None:
        c = self.store.get_checkpoint(cid)
        row = self._own(self.store.get_sandbox(c.sandbox_id), owner)
        if c.id == row.head:
            raise FailedPrecondition(f"checkpoint {cid} is the sandbox's current head")
        if c.seq == 0:
            raise FailedPrecondition(f"checkpoint {cid} is the sandbox's initial state")
        kids = self.store.children(cid)
        if kids:
            raise FailedPrecondition(f"checkpoint {cid} is the parent of {', '.join(kids[:5])}",
                                     fix="delete those first, or keep it")
        self.store.delete_checkpoint(cid)
        self._drop_snapshot_if_unused(c.fs_snapshot)
        self.events.emit(EventKind.CHECKPOINT_DELETED, c.sandbox_id, checkpoint=cid)

    def diff(self, a: str, b: str, owner: str | None = None, limit: int = 10_000) -> dict[str, Any]:
        """The changes from checkpoint `a` to `b`, the first `limit` of them
        (a sandbox can make a million: the reply stays bounded; `total` and
        `truncated` say how many there were)."""
        ca, cb = self.store.get_checkpoint(a), self.store.get_checkpoint(b)
        for c in (ca, cb):
            self._own(self.store.get_sandbox(c.sandbox_id), owner)
            self._require_files(c)
        for c in (ca, cb):  # a diff reads both snapshots: both must be what was committed
            self.integrity.verify(c, processes=False)
        changes = self.fs.diff(ca.fs_snapshot, cb.fs_snapshot) if ca.fs_snapshot != cb.fs_snapshot else []
        return {"from": a, "to": b, "changes": [_change_dict(ch) for ch in changes[:limit]],
                "total": len(changes), "truncated": len(changes) > limit}

    def health(self) -> dict[str, Any]:
        ready = getattr(self.inspector, "ready", None)  # a LoadingInspector's: set once it has loaded
        return {"ok": True, "sandboxes": len(self.turns), "adopting": len(self._adopting),
                "uptime_s": round(time.time() - self.started_at, 1),
                "fs_driver": self.fs.driver, "inspector": getattr(self.inspector, "source", "proc"),
                "inspector_ready": ready.is_set() if ready is not None else True,
                "inspector_load_s": getattr(self.inspector, "load_seconds", None),
                "schema_version": SCHEMA_VERSION}


def _change_dict(ch: Any) -> dict[str, Any]:
    d = dict(ch.__dict__) if hasattr(ch, "__dict__") else dict(ch._asdict())
    for k, v in list(d.items()):
        if isinstance(v, bytes):
            # Sandbox names need not be UTF-8: the text form is for reading
            # (ambiguous: b"\xff" and a literal backslash-x-f-f look alike),
            # the exact bytes ride along in base64.
            try:
                d[k] = v.decode("utf-8")
            except UnicodeDecodeError:
                d[k] = v.decode("utf-8", "backslashreplace")
                d[f"{k}_b64"] = base64.b64encode(v).decode("ascii")
    return d
