"""The death watch: sandboxes whose init died (OOM kill, crash) are noticed
and, per policy, rolled back to their last complete checkpoint.

Part of `crabd.daemon`. `watch_deaths` runs as a task beside the API
(`crabd/serve.py`); it also reaps what crabd, a child subreaper, adopted. The
choice of what to try next after a death is pure (`crabd/recovery.py`):
bounded, never a loop of restores of a target that keeps dying.

A death is noticed when it happens: the watch holds a pidfd of each
sandbox's init in the event loop (pidfd_open(2): readable once the process
has exited), and a slow poll (`interval`) stays as the safety net (a pid
not yet known, a pidfd that could not be opened). The same rounds read each
sandbox's memory.events and report OOM kills of its processes
(`sandbox.oom_kill`); an OOM kill of the init is a death like any other.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

from ..errors import NotFound
from ..runtime import pid_alive, reap
from ..store import CheckpointRow
from .base import DaemonBase, Turns
from .events import EventKind

log = logging.getLogger("crabd")

__all__ = ["DeathWatch"]

# A dead init whose sandbox is busy (a turn or capture holds its lock) is
# looked at again this soon, instead of at the safety-net poll.
RETRY_BUSY_S = 0.05


class DeathWatch(DaemonBase):
    _death_wake: asyncio.Event | None = None
    _pidfds: dict[str, tuple[int, int | None]]  # sandbox -> (init pid, its pidfd while armed)

    async def watch_deaths(self, interval: float = 1.0) -> None:
        """Notice sandboxes whose init died (OOM kill, crash) and, per policy,
        roll them back to their last committed checkpoint; reap what crabd
        (a child subreaper) adopted meanwhile. Woken by an init's pidfd;
        `interval` is the safety net's period."""
        self._death_wake = asyncio.Event()
        self._pidfds = {}
        try:
            while True:
                self._arm_pidfds()
                try:
                    await asyncio.wait_for(self._death_wake.wait(), timeout=interval)
                except asyncio.TimeoutError:
                    pass
                self._death_wake.clear()
                await self._death_round()
        finally:
            self._disarm_pidfds()

    def wake_death_watch(self) -> None:
        """Ask the watch for a round now (e.g. a new init to arm a pidfd for).
        Callable from any thread."""
        loop, wake = getattr(self, "_loop", None), self._death_wake
        if loop is not None and wake is not None:
            loop.call_soon_threadsafe(wake.set)

    def _arm_pidfds(self) -> None:
        """One pidfd per live init, in the event loop: its exit wakes the watch."""
        loop = asyncio.get_running_loop()
        want = {sid: t.init_pid for sid, t in self.turns.items() if t.init_pid}
        for sid in [s for s, (pid, _fd) in self._pidfds.items() if want.get(s) != pid]:
            self._disarm(sid)
        for sid, pid in want.items():
            if sid in self._pidfds:
                continue  # armed, or fired already for this pid (the round handles it)
            try:
                fd = os.pidfd_open(pid)
            except OSError:  # gone already, or no pidfds here: the poll sees it
                self._pidfds[sid] = (pid, None)
                continue
            self._pidfds[sid] = (pid, fd)
            loop.add_reader(fd, self._init_exited, sid)

    def _init_exited(self, sid: str) -> None:
        pid, fd = self._pidfds.get(sid, (0, None))
        if fd is not None:
            asyncio.get_running_loop().remove_reader(fd)
            os.close(fd)
            self._pidfds[sid] = (pid, None)  # kept: not re-armed for the same pid
        if self._death_wake is not None:
            self._death_wake.set()

    def _disarm(self, sid: str) -> None:
        _pid, fd = self._pidfds.pop(sid, (0, None))
        if fd is not None:
            asyncio.get_running_loop().remove_reader(fd)
            os.close(fd)

    def _disarm_pidfds(self) -> None:
        for sid in list(self._pidfds):
            self._disarm(sid)

    async def _death_round(self) -> None:
        self._reap_adopted()
        retry = False
        for sid, t in list(self.turns.items()):
            self._check_oom(sid, t)
            if t.gave_up:
                continue
            if t.recovering or t.lock.locked():
                # busy (a turn, a capture, a recovery): a death its pidfd
                # reported is handled on a round soon after, not at the poll
                retry = retry or t.died is not None or (t.init_pid is not None and not pid_alive(t.init_pid))
                continue
            why = t.died
            if why is None:
                if t.init_pid is None or pid_alive(t.init_pid):
                    continue
                reap(t.init_pid)
                if self._no_tasks(sid):
                    why = "init exited (stopped: no process left in its cgroup)"
                else:  # another init may run (e.g. started meanwhile): runc knows
                    try:
                        sb = await asyncio.to_thread(self.runtime.get, sid)
                    except NotFound:
                        continue
                    if sb.status == "running":
                        t.init_pid = sb.pid
                        continue
                    why = f"init exited ({sb.status})"
            t.died = None
            await self._sandbox_died(sid, t, why)
        if retry and self._death_wake is not None:
            asyncio.get_running_loop().call_later(RETRY_BUSY_S, self._death_wake.set)

    def _check_oom(self, sid: str, t: Turns) -> None:
        """Report OOM kills in the sandbox's cgroup since the last round."""
        if t.oom_file is None:
            return
        try:
            with open(t.oom_file) as f:
                n = next((int(line.split()[1]) for line in f if line.startswith("oom_kill ")), 0)
        except (OSError, ValueError):
            return
        if t.oom_kills is not None and n > t.oom_kills:
            self.events.emit(EventKind.SANDBOX_OOM_KILL, sid, kills=n - t.oom_kills, total=n,
                             fix="raise the sandbox's memory limit, or make the agent's commands use less")
        t.oom_kills = n

    def _reap_adopted(self) -> None:
        """Reap the zombies crabd adopted (sandbox inits, CRIU's restored
        trees, runc stages) -- all but the inits the watch itself reaps."""
        try:
            reaped = self._reaper.reap(skip={t.init_pid for t in self.turns.values() if t.init_pid})
        except OSError as e:
            log.warning("reaping adopted processes: %s", e)
            return
        if reaped:
            log.info("reaped %d adopted process(es): %s", len(reaped), reaped)

    async def _sandbox_died(self, sid: str, t: Turns, why: str) -> None:
        data: dict[str, Any] = {"reason": why}
        if t.recoveries:  # dying again soon after a recovery: say after which
            last = t.recoveries[-1]
            data.update(after_recovery_to=last.checkpoint,
                        after_recovery_s=round(time.monotonic() - last.at, 3))
        t.init_pid = None  # reaped, and nothing to watch until a rollback starts it again
        self.store.update_sandbox(sid, state="dead")
        self.events.emit(EventKind.SANDBOX_DIED, sid, **data)
        if self.options.auto_rollback:
            await self._auto_recover(sid)

    async def _after_rollback(self, t: Turns, sid: str) -> None:
        """Record the rolled-back sandbox's init for the death watch. A
        sandbox already not running (its restored processes were killed as
        they appeared) is marked dead for the watch, not left unwatched."""
        t.died = None
        # `_watch` recorded the new init: alive, it needs no `runc state`
        # spawn here (a few ms of every rollback's reply, profiled).
        if t.init_pid is None or not pid_alive(t.init_pid):
            sb = await asyncio.to_thread(self.runtime.get, sid)
            t.init_pid = sb.pid
            if sb.status != "running" or (sb.pid is not None and not pid_alive(sb.pid)):
                t.died = f"its restored processes died during the rollback (runc: {sb.status})"
        self.wake_death_watch()  # arm a pidfd for the new init now
        if not t.recovering:  # a rollback asked for by hand starts automatic recovery over
            t.recoveries.clear()
            t.gave_up = False

    async def _auto_recover(self, sid: str) -> None:
        """Roll a dead sandbox back, trying the options of crabd.recovery's
        plan in turn: bounded, never a loop of restores of a target that
        keeps dying."""
        from ..recovery import Attempt, RecoveryPlan
        t = self.turns.get(sid)
        if t is None:
            return  # destroyed meanwhile
        t.recovering = True
        try:
            # A capture still running (the init died right after a turn's
            # reply) may commit that turn's checkpoint: it is the recovery
            # target then. Choosing before it ends went back one turn too far.
            await self._wait_capture(t)
            try:
                target, older = await asyncio.to_thread(self._recovery_targets, sid)
            except NotFound:
                return  # destroyed, or nothing committed to go back to
            plan, now = RecoveryPlan(), time.monotonic()
            t.recoveries = plan.recent(t.recoveries, now)
            opt = plan.next(t.recoveries, target=target.id, older=older, now=now,
                            target_has_processes=bool(target.proc_image))
            if opt is None:
                t.gave_up = True
                self.events.emit(EventKind.SANDBOX_RECOVERY_GAVE_UP, sid, attempts=[
                    {"checkpoint": a.checkpoint, "processes": a.processes} for a in t.recoveries],
                    fix=f"crabd rollback {sid} [checkpoint] once the cause is found (the sandbox stays dead)")
                return
            if opt.fallback:
                self.events.emit(EventKind.SANDBOX_RECOVERY_FALLBACK, sid, checkpoint=opt.checkpoint,
                                 processes=opt.processes, instead_of=target.id,
                                 reason=f"recoveries to {target.id} kept dying")
            t.recoveries.append(Attempt(time.monotonic(), opt.checkpoint, opt.processes))
            try:
                await self.rollback(sid, opt.checkpoint, reason="automatic recovery after the sandbox died",
                                    processes=opt.processes, only_if_dead=True)
            except NotFound:
                pass  # destroyed while it waited: nothing to recover
            except Exception as e:
                log.exception("automatic rollback of %s failed", sid)
                self.events.emit(EventKind.SANDBOX_RECOVERY_FAILED, sid, checkpoint=opt.checkpoint, error=str(e))
                if sid in self.turns:
                    pid = await asyncio.to_thread(self._live_init, sid)
                    if pid is None:  # still dead: the next option, on the watch's next round
                        t.died = f"its automatic recovery failed: {e}"
                    else:
                        t.init_pid = pid
        finally:
            t.recovering = False

    def _recovery_targets(self, sid: str) -> tuple[CheckpointRow, str | None]:
        """The recovery target, and the complete checkpoint before it if that
        one has processes to restore (a fallback of crabd.recovery's plan)."""
        row = self.store.get_sandbox(sid)
        target = self._latest_committed(row)
        older: str | None = None
        if target.parent:
            from dataclasses import replace
            try:
                prev = self._latest_committed(replace(row, head=target.parent))
                older = prev.id if prev.proc_image else None
            except NotFound:
                pass
        return target, older

    def _no_tasks(self, sid: str) -> bool:
        """Whether the sandbox's cgroup holds no task at all: then it is dead
        without asking runc (a `runc state` spawn: a few ms of every
        recovery, twice). Unknown (no cgroup) is not "no task"."""
        procs = self.runtime.layout.freezer_dir(f"/crabd/{sid}") / "cgroup.procs"  # Sandbox.cgroup_rel
        try:
            return not procs.read_text().split()
        except OSError:
            return False

    def _live_init(self, sid: str) -> int | None:
        """The sandbox's init pid if it runs (worker thread: asks runc
        unless its cgroup is empty)."""
        if self._no_tasks(sid):
            return None
        try:
            sb = self.runtime.get(sid)
        except NotFound:
            return None
        return sb.pid if sb.status == "running" and sb.pid and pid_alive(sb.pid) else None
