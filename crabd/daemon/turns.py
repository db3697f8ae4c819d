"""Turns: the coordinator's per-sandbox state machine.

Part of `crabd.daemon`. One turn, as data (shared/DESIGN.md): exec ->
inspector marks the turn -> `runc exec` -> inspector closes the turn ->
Effects -> classify -> Plan -> pending checkpoint row + scheduler job
(`pipeline.py`) -> reply to the agent. The next exec of that sandbox waits
for the capture if it is not done yet: that wait is the *stall*.

Concurrency: the asyncio loop owns each sandbox's `Turns` (a lock that
serialises that sandbox's execs and rollbacks, and the future of its pending
capture); everything that blocks runs in worker threads.
"""

from __future__ import annotations

import asyncio
import shlex
import sqlite3
import time
from typing import Any, Callable, Sequence

from ..errors import CrabdError, NotFound, SandboxNotRunning
from ..runtime import pid_alive
from ..store import CheckpointRow, SandboxRow
from .base import DaemonBase, Turns
from .events import EventKind
from .names import checkpoint_id
from .plans import DIED_REASON, save_everything
from .space import is_disk_full

__all__ = ["TurnLoop"]

#: Characters of a command line kept in its turn.ended event.
TURN_CMD_MAX = 2000


class TurnLoop(DaemonBase):
    async def exec(self, ref: str, cmd: Sequence[str] | str, *, timeout: float | None = 600.0,
                   env: dict[str, str] | None = None, cwd: str | None = None, stdin: str | None = None,
                   owner: str | None = None) -> dict[str, Any]:
        row = self._own(await asyncio.to_thread(self.store.get_sandbox, ref), owner)
        t = self.turns.setdefault(row.id, Turns())
        async with t.lock:
            t0 = time.monotonic()
            stall = await self._wait_capture(t)
            if t.last_end is not None:
                self.scheduler.policy.observe_gap(row.id, t0 - t.last_end)
            row = await asyncio.to_thread(self.store.get_sandbox, row.id)
            self._refuse_if_dead(row, t)
            turn = row.turn + 1
            # Budget: refused when used up, else this turn is counted now.
            await asyncio.to_thread(self.ledger.begin_turn, row.lineage, row.id)
            t_exec = time.monotonic()
            self.inspector.begin_turn(row.id)
            error: CrabdError | None = None
            res: Any = None
            try:
                res = await asyncio.to_thread(self.runtime.exec, row.id, cmd, env=env, cwd=cwd, stdin=stdin,
                                              timeout=timeout)
            except CrabdError as e:
                error = e
            # The turn ends whatever happened: a timed-out command may have
            # changed files before it was killed.
            effects = await asyncio.to_thread(self.inspector.end_turn, row.id)  # settles, scans memory file systems
            t.last_end = time.monotonic()
            died = t.init_pid is not None and not pid_alive(t.init_pid)
            ck = await asyncio.to_thread(self._open_at_plan, row.id, effects, lambda: self._open_checkpoint(
                row, turn, effects, died=died, blind=t.blind))
            wall = time.monotonic() - t_exec
            # The time line's record of the turn (the checkpoint row has no
            # command): bounded, a command line can be megabytes.
            line = cmd if isinstance(cmd, str) else shlex.join(cmd)
            exit_code = res.exit_code if res is not None else None
            duration = round(res.duration if res is not None else wall, 4)

            def bookkeeping() -> None:  # one thread hop for both writes
                self._ledger_after_turn(row, turn, ck, effects, wall)
                self.events.emit(EventKind.TURN_ENDED, row.id, turn=turn, checkpoint=ck.id, branch=row.branch,
                                 cmd=line[:TURN_CMD_MAX], cmd_truncated=len(line) > TURN_CMD_MAX,
                                 exit_code=exit_code, error=error.code if error is not None else None,
                                 duration_s=duration, stall_ms=round(stall * 1000, 3))

            await asyncio.to_thread(bookkeeping)
            t.capture = asyncio.ensure_future(self._run_capture(row.id, ck))
            self.metrics.stall.observe(stall)
            self.metrics.turns.labels(plan=ck.plan).inc()
            if error is not None:
                raise error
            self.metrics.exec_seconds.observe(res.duration)
            return {**res.to_dict(), "turn": turn, "checkpoint": ck.id, "plan": ck.plan,
                    "reasons": ck.reasons, "stall_ms": round(stall * 1000, 3),
                    "external": bool(effects.external), "branch": row.branch}

    def _refuse_if_dead(self, row: SandboxRow, t: Turns) -> None:
        """A sandbox whose init is dead and not yet recovered runs nothing:
        refused before a turn is counted (its death is handled by the watch,
        which this wakes), never a turn and a checkpoint of a dead sandbox."""
        sid = row.id
        why = t.died or ("its init exited" if t.init_pid is not None and not pid_alive(t.init_pid) else None)
        if why is None and row.state == "dead":
            why = "not recovered"
        if why is None:
            return
        self.wake_death_watch()
        fix = ("wait for its automatic recovery (crabd events --follow) and retry" if self.options.auto_rollback
               else f"crabd rollback {sid} [checkpoint]")
        raise SandboxNotRunning(f"sandbox {sid} died ({why}); no command ran", fix=fix)

    async def end_turn(self, ref: str, owner: str | None = None) -> dict[str, Any]:
        """An explicit turn boundary for agents that run commands some other way."""
        row = self._own(await asyncio.to_thread(self.store.get_sandbox, ref), owner)
        t = self.turns.setdefault(row.id, Turns())
        async with t.lock:
            stall = await self._wait_capture(t)
            row = await asyncio.to_thread(self.store.get_sandbox, row.id)
            effects = await asyncio.to_thread(self.inspector.end_turn, row.id)  # settles, scans memory file systems
            t.last_end = time.monotonic()
            ck = await asyncio.to_thread(self._open_at_plan, row.id, effects, lambda: self._open_checkpoint(
                row, row.turn + 1, effects, blind=t.blind))
            t.capture = asyncio.ensure_future(self._run_capture(row.id, ck))
            self.inspector.begin_turn(row.id)
            return {"turn": row.turn + 1, "checkpoint": ck.id, "plan": ck.plan, "reasons": ck.reasons,
                    "stall_ms": round(stall * 1000, 3)}

    async def checkpoint_now(self, ref: str, owner: str | None = None, wait: bool = True) -> dict[str, Any]:
        """A manual checkpoint: the file system is captured whatever the inspector saw."""
        row = self._own(await asyncio.to_thread(self.store.get_sandbox, ref), owner)
        t = self.turns.setdefault(row.id, Turns())
        async with t.lock:
            await self._wait_capture(t)
            row = await asyncio.to_thread(self.store.get_sandbox, row.id)
            effects = await asyncio.to_thread(self.inspector.end_turn, row.id)  # settles, scans memory file systems
            self.inspector.begin_turn(row.id)
            ck = await asyncio.to_thread(self._open_checkpoint, row, row.turn, effects, manual=True, blind=t.blind)
            t.capture = asyncio.ensure_future(self._run_capture(row.id, ck))
            if wait:
                await self._wait_capture(t)
        return self.checkpoint_info(ck.id)

    async def _wait_capture(self, t: Turns) -> float:
        if t.capture is None or t.capture.done():
            return 0.0
        t0 = time.monotonic()
        try:
            await asyncio.shield(t.capture)
        except Exception:
            pass  # a failed capture is recorded on its checkpoint; the turn goes on
        return time.monotonic() - t0

    def _open_at_plan(self, sid: str, effects: Any, open_checkpoint: Callable[[], CheckpointRow]) -> CheckpointRow:
        """Open the turn's checkpoint row (its plan is made here); in oracle
        mode, a SKIP's ground truth is recorded at this instant, the sandbox
        frozen (crabd/oracle.py `open_at_plan`). Worker thread."""
        if not self.options.oracle_dir:
            return open_checkpoint()
        from ..oracle import open_at_plan
        return open_at_plan(self, sid, effects, open_checkpoint)

    def _open_checkpoint(self, row: SandboxRow, turn: int, effects: Any, manual: bool = False,
                         died: bool = False, blind: str | None = None) -> CheckpointRow:
        try:
            return self._open_checkpoint_row(row, turn, effects, manual, died, blind)
        except sqlite3.OperationalError as e:
            if is_disk_full(e):
                # No room for the turn's checkpoint row (the API answers 507
                # disk_full): free the space reserve so that the sandbox and
                # crabd have room to clean up; made again once there is space.
                self.space.release_quietly()
            raise

    def _durable_parent(self, head: str | None) -> tuple[CheckpointRow | None, list[CheckpointRow]]:
        """The nearest checkpoint at or above `head` that a new checkpoint may
        share state with (committed, with a file-system snapshot), and the
        rows passed over on the way (failed, cancelled or discarded captures,
        or rows without files): their turns' changes were never saved."""
        passed: list[CheckpointRow] = []
        cid, seen = head, set()
        while cid and cid not in seen:
            seen.add(cid)
            try:
                c = self.store.get_checkpoint(cid)
            except NotFound:
                break
            if c.state == "committed" and c.fs_snapshot:
                return c, passed
            passed.append(c)
            cid = c.parent
        return None, passed

    def _open_checkpoint_row(self, row: SandboxRow, turn: int, effects: Any, manual: bool,
                             died: bool = False, blind: str | None = None) -> CheckpointRow:
        import ebpf

        from ..capture import apply_mode
        plan = ebpf.classify(effects)
        kind = plan.kind.value
        reasons = list(plan.reasons)
        if manual and kind == "SKIP":
            kind, reasons = "FS", ["manual checkpoint"] + reasons
        parent, passed = self._durable_parent(row.head)
        if passed:
            blind = blind or (f"checkpoint(s) {', '.join(c.id for c in passed[:3])} did not commit "
                              f"({passed[0].state}): their turns' changes were never saved")
        if blind:
            kind, reasons = save_everything(blind, reasons)
        kind, reasons = apply_mode(kind, reasons, self.options.capture)
        if died:
            reasons.append(DIED_REASON)
        seq = self.store.allocate_seq(row.id)
        ck = CheckpointRow(id=checkpoint_id(row.id, seq), sandbox_id=row.id, seq=seq,
                           parent=parent.id if parent is not None else None, branch=row.branch,
                           turn=turn, plan=kind, reasons=reasons, effects=effects.model_dump(mode="json"))
        with self.store.transaction():
            self.store.add_checkpoint(ck)
            self.store.update_sandbox(row.id, head=ck.id, turn=turn)
        return ck
