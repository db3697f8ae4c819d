"""Which automatic recovery to try next for a sandbox that died: pure policy.

The daemon's death watch (crabd/daemon/deathwatch.py `watch_deaths`) rolls a dead
sandbox back to its recovery target. A target can keep dying: its restored
processes crash at once, or something on the host kills them as they appear
(the OOM killer on a sandbox whose checkpoint is already near its limit). So
each attempt is remembered for `window_s` seconds, and the plan moves on once
an option has had `tries` attempts in that window:

    1. the target (newest complete checkpoint), files and processes;
    2. the complete checkpoint before it, files and processes;
    3. the target's files with a fresh init (no process image);
    4. nothing: crabd gives up and leaves the sandbox dead (an event says
       so; a rollback asked for by hand starts over).

    plan = RecoveryPlan()
    plan.next([Attempt(0.0, "sb-x-7", True)] * 2, target="sb-x-7", older="sb-x-5", now=1.0)
    # -> Option("sb-x-5", processes=True, fallback=True)
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Attempt", "Option", "RecoveryPlan"]


@dataclass(frozen=True)
class Attempt:
    at: float          # time.monotonic() when it started
    checkpoint: str
    processes: bool    # restore the process image (False: a fresh init on the files)


@dataclass(frozen=True)
class Option:
    checkpoint: str
    processes: bool
    fallback: bool     # not the plain first choice: worth an event


@dataclass(frozen=True)
class RecoveryPlan:
    tries: int = 2            # attempts per option before the next one
    window_s: float = 60.0    # an attempt older than this (the sandbox ran that long) is forgotten

    def recent(self, attempts: list[Attempt], now: float) -> list[Attempt]:
        return [a for a in attempts if now - a.at < self.window_s]

    def options(self, target: str, older: str | None, target_has_processes: bool = True) -> list[Option]:
        out = [Option(target, True, False)] if target_has_processes else []
        if older is not None and older != target:
            out.append(Option(older, True, True))
        out.append(Option(target, False, bool(out)))
        return out

    def next(self, attempts: list[Attempt], *, target: str, older: str | None, now: float,
             target_has_processes: bool = True) -> Option | None:
        """The option to try now, or None once every option had its tries."""
        recent = self.recent(attempts, now)
        for opt in self.options(target, older, target_has_processes):
            n = sum(1 for a in recent if a.checkpoint == opt.checkpoint and a.processes == opt.processes)
            if n < self.tries:
                return opt
        return None
