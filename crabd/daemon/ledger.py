"""The daemon's side of the effects ledger and budgets (`crabd/effects.py`).

Part of `crabd.daemon`: after each turn, what the inspector saw leave the
sandbox is recorded as unmanaged effects and the turn's wall time counted;
at a rollback, the ledger says which effects it does not undo; the API's
effect intents and outcomes go through here to be recorded as events.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

from ..store import CheckpointRow, SandboxRow
from .base import DaemonBase
from .events import EventKind

log = logging.getLogger("crabd")

__all__ = ["LedgerGlue"]


class LedgerGlue(DaemonBase):
    def _ledger_after_turn(self, row: SandboxRow, turn: int, ck: CheckpointRow, effects: Any, wall_s: float) -> None:
        """Count the turn's wall time; record what the inspector saw leave
        the sandbox as unmanaged effects of the turn (made from its parent)."""
        try:
            self.ledger.add_wall(row.lineage, wall_s)
            # Without BPF every turn is external_unknown (short-lived
            # connections are invisible to /proc): an `unseen` row per turn
            # would say nothing new, so only BPF's lost events write one.
            unseen = bool(effects.external_unknown) and getattr(effects, "source", "proc") != "proc"
            if effects.external or unseen:
                ids = self.ledger.record_unmanaged(row, turn=turn, checkpoint=ck.parent,
                                                   reasons=list(effects.external_reasons), unknown=unseen)
                self.events.emit(EventKind.EFFECTS_UNMANAGED, row.id, turn=turn, checkpoint=ck.id, effects=ids,
                                 reasons=list(effects.external_reasons))
        except Exception as e:  # the turn happened (its capture is next): bookkeeping must not fail it
            log.warning("ledger bookkeeping of %s turn %d failed: %s", row.id, turn, e)
            self.events.emit(EventKind.LEDGER_FAILED, row.id, turn=turn, error=str(e))

    def _ledger_report(self, sid: str, row: SandboxRow, path: Sequence[tuple[str, int]]) -> dict[str, Any]:
        """Rollback of `sid` from its head: the ledger's effects it does not
        undo. `path`: the stretch it abandons (crabd.effects.abandoned_line's
        `path`: from the head back to the target, or to where the head's line
        meets the target's when the target is on another branch)."""
        if not self.ledger.has_effects(sid):  # the common case
            return {"committed_after": [], "unknown": []}
        return self.ledger.rollback_report(sid, row.lineage, path)

    def effect_intent(self, ref: str, op: str, *, key: str | None, args: Any, postcondition: str | None = None,
                      volatile: Sequence[str] = (), force: bool = False, owner: str | None = None) -> dict[str, Any]:
        row = self._own(self.store.get_sandbox(ref), owner)
        out = self.ledger.intent(row, op, key=key, args=args, postcondition=postcondition, volatile=volatile,
                                 force=force)
        if out["decision"] == "execute":
            self.events.emit(EventKind.EFFECT_INTENT, row.id, effect=out["effect"]["id"], op=op, key=key,
                             retry=out["retry"])
        else:
            self.events.emit(f"effect.{out['decision']}", row.id, effect=out["matched"], op=op, key=key,
                             matched_by=out["matched_by"])
        return out

    def effect_finish(self, eid: str, state: str, *, receipt: Any = None, result_digest: str | None = None,
                      error: str | None = None, reconciled: bool = False) -> dict[str, Any]:
        e = self.ledger.finish(eid, state, receipt=receipt, result_digest=result_digest, error=error,
                               reconciled=reconciled)
        self.events.emit(f"effect.{'reconciled' if reconciled else state}", e["sandbox_id"], effect=eid,
                         op=e["op"], key=e["key"], state=e["state"])
        return e
