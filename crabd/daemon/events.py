"""The daemon's event bus: every kind of event it records, and the one way
to record one.

Part of `crabd.daemon`. An event is a row in the store's `events` table
(`Store.add_event`), read by `GET /v1/events` and `crabd events`; recording
one also wakes the API's long polls (`wait`). Any thread may emit; waiters
live on the event loop. The kinds' values are the wire format: clients
filter on them, so a value never changes.
"""

from __future__ import annotations

import asyncio
from enum import Enum
from typing import Any

from ..store import Store

__all__ = ["EventKind", "EventBus"]


class EventKind(str, Enum):
    # sandboxes
    SANDBOX_CREATED = "sandbox.created"
    SANDBOX_DESTROYED = "sandbox.destroyed"
    SANDBOX_ADOPTED = "sandbox.adopted"          # running at daemon start: watched again
    SANDBOX_THAWED = "sandbox.thawed"            # found frozen at daemon start
    SANDBOX_LOST = "sandbox.lost"                # its runtime state is gone
    SANDBOX_ORPHAN_REMOVED = "sandbox.orphan_removed"
    SANDBOX_DIED = "sandbox.died"
    SANDBOX_OOM_KILL = "sandbox.oom_kill"        # the kernel OOM-killed a process of it (memory.events)
    SANDBOX_ROLLED_BACK = "sandbox.rolled_back"
    SANDBOX_RESTORE_FAILED = "sandbox.restore_failed"
    SANDBOX_RECOVERY_FAILED = "sandbox.recovery_failed"
    SANDBOX_RECOVERY_FALLBACK = "sandbox.recovery_fallback"
    SANDBOX_RECOVERY_GAVE_UP = "sandbox.recovery_gave_up"
    # turns
    TURN_ENDED = "turn.ended"                    # an exec's command, exit and duration (the time line)
    # checkpoints
    CHECKPOINT_COMMITTED = "checkpoint.committed"
    CHECKPOINT_SIZED = "checkpoint.sized"
    CHECKPOINT_FAILED = "checkpoint.failed"
    CHECKPOINT_PROC_FAILED = "checkpoint.proc_failed"
    CHECKPOINT_DISCARDED = "checkpoint.discarded"
    CHECKPOINT_DELETED = "checkpoint.deleted"
    CHECKPOINTS_RETIRED = "checkpoints.retired"
    MAINTENANCE_DONE = "maintenance.done"
    # hot standbys
    STANDBY_READY = "standby.ready"
    STANDBY_SKIPPED = "standby.skipped"
    STANDBY_FAILED = "standby.failed"
    # effects ledger (crabd/effects.py): one kind per decision and per outcome
    EFFECT_INTENT = "effect.intent"              # decision execute
    EFFECT_REPLAY = "effect.replay"
    EFFECT_ASK = "effect.ask"
    EFFECT_RECONCILE = "effect.reconcile"
    EFFECT_COMMITTED = "effect.committed"
    EFFECT_FAILED = "effect.failed"
    EFFECT_UNKNOWN = "effect.unknown"
    EFFECT_RECONCILED = "effect.reconciled"
    EFFECTS_UNMANAGED = "effects.unmanaged"
    EFFECTS_NOT_UNDONE = "effects.not_undone"
    LEDGER_FAILED = "ledger.failed"


class EventBus:
    """Records events in the store and wakes whoever waits for one."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.loop: asyncio.AbstractEventLoop | None = None  # set by `bind` (daemon start)
        self._waiters: set[asyncio.Event] = set()

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def emit(self, kind: EventKind | str, sandbox_id: str | None = None, **data: Any) -> None:
        """Record an event (any thread). A kind made from a value (the
        ledger's `f"effect.{decision}"`) must be one of `EventKind`'s:
        ValueError otherwise, so that the enum stays the list of all kinds."""
        self.store.add_event(EventKind(kind).value, sandbox_id, **data)
        if self.loop is not None:
            def wake() -> None:
                for ev in list(self._waiters):
                    ev.set()
            try:
                self.loop.call_soon_threadsafe(wake)
            except RuntimeError:
                pass

    async def wait(self, timeout: float) -> None:
        """Return when the next event is recorded, or after `timeout` seconds."""
        ev = asyncio.Event()
        self._waiters.add(ev)
        try:
            await asyncio.wait_for(ev.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            self._waiters.discard(ev)
