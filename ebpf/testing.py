"""Fakes of the inspector's seams, so unit tests drive the real aggregation
code without root: `FakeLoader` (the BPF side) and `FakeProcessTable`
(/proc and cgroup.procs).

    procs = FakeProcessTable()
    loader = FakeLoader()
    insp = Inspector(loader, processes=procs, clock=FakeClock(), poll_interval=None)
    insp.watch("sb", "/sys/fs/cgroup/unified/sb")        # no stat: FakeLoader is pid-mode free
    loader.emit(Event(EventKind.OPEN_WRITE, tag=loader.tag_of("sb"), pid=10, path="/app/x", arg=0o1101))
    insp.end_turn("sb").files["write"].count == 1
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from pathlib import Path

from ebpf._events import Event, program_text
from ebpf._proc import ProcInfo


class FakeClock:
    """A monotonic clock that advances 1 µs per reading."""

    def __init__(self, start: int = 1_000_000) -> None:
        self._it = itertools.count(start, 1000)

    def __call__(self) -> int:
        return next(self._it)


class FakeLoader:
    """Records what the inspector asks of the kernel; events are pushed with `emit`.

    Cgroup mode by default, but `watch` needs a real directory's inode for
    cgroup ids; pass `mode="bpf-pids"` to avoid touching any file system."""

    def __init__(self, mode: str = "bpf-pids") -> None:
        self.mode = mode
        self.opened = False
        self.closed = False
        self.cgroups: dict[int, tuple[int, int]] = {}  # id -> (level, tag)
        self.pids: dict[int, int] = {}
        self.queue: list[Event] = []
        self.writes: dict[int, int] = {}
        self.dropped: dict[int, int] = {}
        self.fail_open: Exception | None = None

    def program(self) -> str:
        return program_text(self.mode == "bpf-pids")

    def open(self) -> None:
        if self.fail_open:
            raise self.fail_open
        self.opened = True

    def add_cgroup(self, cgroup_id: int, level: int, tag: int) -> None:
        self.cgroups[cgroup_id] = (level, tag)

    def remove_cgroup(self, cgroup_id: int) -> None:
        self.cgroups.pop(cgroup_id, None)

    def add_pid(self, pid: int, tag: int) -> None:
        self.pids[pid] = tag

    def remove_tag_pids(self, tag: int) -> None:
        self.pids = {p: t for p, t in self.pids.items() if t != tag}

    def tag_of(self, pid_or_cgroup: int) -> int:
        if pid_or_cgroup in self.pids:
            return self.pids[pid_or_cgroup]
        return self.cgroups[pid_or_cgroup][1]

    def emit(self, *events: Event, ts: int | None = None) -> None:
        for ev in events:
            self.queue.append(replace(ev, ts=ts) if ts is not None else ev)

    def count_writes(self, tag: int, n: int = 1) -> None:
        self.writes[tag] = self.writes.get(tag, 0) + n

    def drop(self, tag: int, n: int = 1) -> None:
        self.dropped[tag] = self.dropped.get(tag, 0) + n

    def read_events(self, timeout_ms: int = 0) -> list[Event]:
        out, self.queue = self.queue, []
        return out

    def write_count(self, tag: int) -> int:
        return self.writes.get(tag, 0)

    def dropped_count(self, tag: int) -> int:
        return self.dropped.get(tag, 0)

    def close(self) -> None:
        self.closed = True


@dataclass
class FakeProcessTable:
    """Processes per cgroup path, edited by the test."""

    members: dict[Path, set[int]] = field(default_factory=dict)
    procs: dict[int, ProcInfo] = field(default_factory=dict)
    sockets: dict[int, list[str]] = field(default_factory=dict)

    def start(self, cgroup: str | Path, pid: int, cmdline: tuple[str, ...] = ("sh",), start: int = 1) -> ProcInfo:
        info = ProcInfo(pid, start, 0, 0, False, cmdline[0].rsplit("/", 1)[-1][:15], cmdline)
        self.members.setdefault(Path(cgroup), set()).add(pid)
        self.procs[pid] = info
        return info

    def stop(self, pid: int) -> None:
        self.procs.pop(pid, None)
        for s in self.members.values():
            s.discard(pid)

    def run(self, pid: int, switches: int = 1) -> None:
        """The process was scheduled (its context-switch count moves)."""
        self.procs[pid] = replace(self.procs[pid], switches=self.procs[pid].switches + switches)

    def pids(self, cgroup_path: Path) -> set[int]:
        return set(self.members.get(Path(cgroup_path), set()))

    def info(self, pid: int) -> ProcInfo | None:
        return self.procs.get(pid)

    def listening(self, pids: set[int]) -> dict[int, list[str]]:
        return {p: a for p, a in self.sockets.items() if p in pids}
