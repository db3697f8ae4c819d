"""The inspector without BPF: /proc snapshots plus the file-system layer's
change probe, producing the same `Effects` record, more coarsely.

What it sees: processes alive at each turn end (new, gone, ran), listening
inet sockets of alive processes, package managers and external tools among
the processes alive at the end, the paths the change probe reports, and
changes to the sandbox's memory file systems (/dev, /dev/shm: the tmpfs
check of ebpf._tmpfs, the same as the BPF inspector's).
What it cannot see: short-lived processes, their execs and connections
(so `external_unknown` is always set), and the kind of each file change
(everything is reported under `files["changed"]`).

The change probe is injected: `probe(sandbox_id)` returns the paths changed
in the sandbox's file system since the previous call (crabd passes the
deltafs driver's diff of the active snapshot), or None when it cannot tell,
which counts as a change.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ebpf._proc import (
    HostProcessTable,
    ProcessTable,
    ProcInfo,
    quiet_baseline,
    restarted_only,
    settled_snapshot,
    snapshot,
)
from ebpf._tmpfs import HostMemoryFs, Manifest, MemoryFs, rescan
from ebpf._turn import DEFAULT_STATELESS, TurnRecorder, external_tool, package_manager
from ebpf.effects import MAX_SAMPLES, Effects, ExecRecord, Sample
from ebpf.errors import AlreadyWatched, NotWatched

ChangeProbe = Callable[[str], "Iterable[str] | None"]

COARSE_NOTE = (
    "proc fallback (no BPF): short-lived processes, execs and connections are not seen; "
    "file changes come from the file-system layer's change probe"
)


@dataclass
class _Watched:
    sandbox_id: str
    cgroup_path: Path
    baseline: dict[int, ProcInfo]
    turn: int = 0
    started_ns: int = 0
    stateless: frozenset[str] = DEFAULT_STATELESS
    pre_pause: dict[int, ProcInfo] | None = None
    ran: set[int] = field(default_factory=set)  # ran before crabd's last pause
    outside: tuple[str, ...] = ()
    tmpfs: Manifest = field(default_factory=dict)  # the memory file systems at the last turn end


class ProcInspector:
    """Same interface as `Inspector`; `source` is "proc"."""

    source = "proc"

    def __init__(
        self,
        change_probe: ChangeProbe | None = None,
        *,
        processes: ProcessTable | None = None,
        clock: Callable[[], int] = time.monotonic_ns,
        max_samples: int = MAX_SAMPLES,
        settle: float = 0.2,
        memory_fs: MemoryFs | None = None,
    ) -> None:
        self._probe = change_probe
        # as in Inspector: with a fake process table, on only when a fake is passed
        self._memfs = memory_fs if memory_fs is not None else HostMemoryFs() if processes is None else None
        self._settle = settle
        self._procs = processes if processes is not None else HostProcessTable()
        self._clock = clock
        self._max = max_samples
        self._sandboxes: dict[str, _Watched] = {}
        self._lock = threading.Lock()

    def open(self) -> None:
        pass

    def close(self) -> None:
        self._sandboxes.clear()

    def __enter__(self) -> ProcInspector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def watch(
        self,
        sandbox_id: str,
        cgroup_path: str | os.PathLike[str],
        *,
        init_pid: int | None = None,
        outside_paths: tuple[str, ...] = (),
        stateless_comms: frozenset[str] = DEFAULT_STATELESS,
    ) -> None:
        """As `Inspector.watch`; `outside_paths` only keeps those mounts out
        of the tmpfs check (the change probe reports only the sandbox's own
        file system)."""
        with self._lock:
            if sandbox_id in self._sandboxes:
                raise AlreadyWatched(f"sandbox {sandbox_id!r} is already watched")
            path = Path(cgroup_path)
            w = _Watched(sandbox_id, path, snapshot(self._procs, path), stateless=stateless_comms,
                         outside=tuple(outside_paths))
            _, w.tmpfs = rescan(self._memfs, {}, set(w.baseline), w.outside)
            self._sandboxes[sandbox_id] = w
        if self._probe is not None:
            self._probe(sandbox_id)  # start the probe's "since" at watch time

    def unwatch(self, sandbox_id: str) -> None:
        with self._lock:
            if self._sandboxes.pop(sandbox_id, None) is None:
                raise NotWatched(f"sandbox {sandbox_id!r} is not watched")

    def _get(self, sandbox_id: str) -> _Watched:
        try:
            return self._sandboxes[sandbox_id]
        except KeyError:
            raise NotWatched(f"sandbox {sandbox_id!r} is not watched") from None

    def begin_turn(self, sandbox_id: str) -> None:
        self._get(sandbox_id).started_ns = self._clock()

    def before_pause(self, sandbox_id: str) -> None:
        """As `Inspector.before_pause`."""
        w = self._get(sandbox_id)
        w.pre_pause = snapshot(self._procs, w.cgroup_path)

    def after_pause(self, sandbox_id: str) -> None:
        """As `Inspector.after_pause`: the next turn compares with the quiet
        state after the thaw; what ran before the pause is still reported.
        Without a kernel trace of the thawed tasks' calls, a process that ran
        after the thaw counts as active unless /proc shows it only resumed
        an interrupted sleep (`restarted_only`): idle servers blocked in
        other calls are then dumped again at the next turn."""
        w = self._get(sandbox_id)
        if w.pre_pause is None:
            return
        w.baseline, ran = quiet_baseline(self._procs, w.cgroup_path, w.baseline, w.pre_pause, self._settle,
                                         worked=restarted_only(self._procs, w.pre_pause))
        w.ran |= ran
        w.pre_pause = None

    def end_turn(self, sandbox_id: str) -> Effects:
        w = self._get(sandbox_id)
        after = settled_snapshot(self._procs, w.cgroup_path, w.baseline, self._settle)
        tmpfs_changed, w.tmpfs = rescan(self._memfs, w.tmpfs, set(after), w.outside)
        cut = self._clock()
        before, w.baseline = w.baseline, after
        w.turn += 1
        rec = TurnRecorder(self._max)
        rec.active_pids, w.ran = set(w.ran), set()
        notes = [COARSE_NOTE]
        changed = self._probe(sandbox_id) if self._probe is not None else None
        if changed is None:
            rec.files["changed"] = Sample(count=1, sample=["? (no change probe: assuming the file system changed)"])
            notes.append("no change probe answer: file system assumed changed")
        else:
            for p in changed:
                rec.files.setdefault("changed", Sample()).add(p, self._max)
        # programs alive at the end are the only execs /proc can show
        new = [i for p, i in after.items() if p not in before or before[p].start != i.start]
        for i in new:
            argv = list(i.cmdline) or [i.comm]
            pm, ext = package_manager(argv[0], argv), external_tool(argv[0], argv)
            if pm:
                rec.package_managers.add(pm)
            if ext:
                rec._external(f"exec of {ext}: {' '.join(argv)[:120]}")
            rec.exec_count += 1
            if len(rec.execs) < self._max:
                rec.execs.append(
                    ExecRecord(pid=i.pid, filename=argv[0], argv=argv[:8], package_manager=pm, external_tool=ext)
                )
        listening = self._procs.listening(set(after))
        started, w.started_ns = w.started_ns, 0
        return rec.effects(
            sandbox_id=sandbox_id,
            turn=w.turn,
            source="proc",
            started_ns=started,
            ended_ns=cut,
            before=before,
            after=after,
            stateless=w.stateless,
            listening_now=listening,
            notes=notes,
            external_unknown=True,
            tmpfs_changed=tmpfs_changed,
        )
