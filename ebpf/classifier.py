"""The classifier: `Effects -> Plan`, a pure function.

A missed change is lost data, an extra checkpoint is only traffic: every rule
escalates, none de-escalates, and anything the inspector could not see
counts as the worst case. The decision table (documented in the README):

    condition                                               plan
    ------------------------------------------------------  -------
    events were dropped                                     FS_PROC
    blind spot (io_uring, ptrace/process_vm_writev pokes,
      pidfd_getfd, another process reniced or limited)      FS_PROC
    a process created in the turn is alive at its end       FS_PROC
    a process alive at the last turn end exited             FS_PROC
    a process alive at the last turn end ran in this turn   FS_PROC
    a socket started listening and its process is alive     FS_PROC
    mount / umount                                          FS_PROC
    System V IPC object or POSIX message queue used         FS_PROC
    write to /proc or /sys (kernel state)                   FS_PROC
    write to a file only a process holds (deleted but
      open, reached through /proc/PID/fd/N)                 FS_PROC
    a tmpfs changed (/dev path, or the turn-end tmpfs scan) FS_PROC
    any file-system change (write, create, delete, ...)     FS
    a package manager ran                                   FS
    none of the above                                       SKIP

Writes to /dev/null, /dev/zero, ttys and /dev/pts, and to /proc/self/*, do
not count. A tmpfs change is found by the inspectors' comparison of the
sandbox's memory file systems at each turn end (ebpf._tmpfs), whatever path,
descriptor or mapping it went through; the path rule is a second source.
External effects (`Effects.external`) do not change the plan: no
checkpoint can undo them; they are carried on the plan for the ledger.
"""

from __future__ import annotations

import enum

from pydantic import BaseModel, ConfigDict, Field

from ebpf.effects import NOT_RESTORED, Effects, text_safe


class PlanKind(str, enum.Enum):
    SKIP = "SKIP"  # nothing recovery-relevant: reuse the previous checkpoint
    FS = "FS"  # file-system snapshot only
    FS_PROC = "FS_PROC"  # file-system snapshot and process checkpoint


_RANK = {PlanKind.SKIP: 0, PlanKind.FS: 1, PlanKind.FS_PROC: 2}


class Plan(BaseModel):
    """What to checkpoint after a turn, and why."""

    model_config = ConfigDict(extra="forbid")

    kind: PlanKind
    reasons: list[str] = Field(default_factory=list)
    external: bool = False
    external_reasons: list[str] = Field(default_factory=list)
    external_unknown: bool = False


def _pids(records: list, limit: int = 3) -> str:
    shown = ", ".join(f"{r.pid} {(' '.join(r.cmdline) or r.comm)[:40]!r}" for r in records[:limit])
    more = f" and {len(records) - limit} more" if len(records) > limit else ""
    return shown + more


def classify(effects: Effects) -> Plan:
    """Map one turn's effects to a checkpoint plan with human-readable reasons."""
    kind = PlanKind.SKIP
    reasons: list[str] = []

    def need(k: PlanKind, why: str) -> None:
        nonlocal kind
        if _RANK[k] > _RANK[kind]:
            kind = k
        reasons.append(text_safe(why))  # names in it need not be UTF-8 (see ebpf.effects)

    e = effects
    proc, fs = PlanKind.FS_PROC, PlanKind.FS
    if e.dropped_events:
        need(proc, f"{e.dropped_events} events were dropped: assuming the worst")
    for b in e.blind_spots:
        need(proc, f"cannot see through {b}")
    if e.new_processes:
        need(proc, f"{len(e.new_processes)} new process(es) alive at turn end: {_pids(e.new_processes)}")
    if e.exited_processes:
        need(proc, f"{len(e.exited_processes)} process(es) of the last checkpoint exited: {_pids(e.exited_processes)}")
    if e.active_processes:
        need(proc, f"{len(e.active_processes)} older process(es) ran or were changed during the turn (signals, queued data, files they hold deleted or renamed): {_pids(e.active_processes)}")
    live = [s for s in e.listening if s.alive]
    if live:
        need(proc, "listening socket(s): " + ", ".join(f"{s.address} (pid {s.pid})" for s in live[:3]))
    if e.mounts.count:
        need(proc, f"{e.mounts.count} mount change(s): {', '.join(e.mounts.sample[:3])}")
    if e.kernel_objects.count:
        need(proc, f"{e.kernel_objects.count} IPC object(s) / message queue(s) created or used")
    for scope in ("kernel", "tmpfs", "held"):
        s = e.special_writes.get(scope)
        if s and s.count:
            need(proc, f"{s.count} write(s) to {scope} state: {', '.join(s.sample[:3])}")
    if e.file_changes:
        parts = [f"{k} {s.count}" for k, s in sorted(e.files.items()) if s.count]
        first = next((s.sample[0] for s in e.files.values() if s.sample), "")
        need(fs, f"{e.file_changes} file-system change(s) ({', '.join(parts)}), e.g. {first}")
    if e.package_managers:
        need(fs, f"package manager(s) ran: {', '.join(e.package_managers)}")
    if kind is PlanKind.FS_PROC:
        # what this turn's process image will not hold (a restore loses it): said, never silent
        reasons += [text_safe(n) for n in e.notes if n.startswith(NOT_RESTORED)]
    if kind is PlanKind.SKIP:
        reasons.append("no recovery-relevant OS effect seen")
    return Plan(
        kind=kind,
        reasons=reasons,
        external=e.external,
        external_reasons=list(e.external_reasons),
        external_unknown=e.external_unknown,
    )
