"""The BPF inspector: per-sandbox, per-turn `Effects` from kernel events.

    insp = Inspector()                      # BccLoader by default; inject a fake in tests
    insp.watch("sb1", "/sys/fs/cgroup/unified/crabd/sb1")
    insp.begin_turn("sb1")
    ... the turn runs in the sandbox ...
    effects = insp.end_turn("sb1")          # -> Effects; ebpf.classify(effects) -> Plan
    insp.close()

A turn covers everything since the previous `end_turn` (or `watch`), so a
change made between turns is never lost; `begin_turn` only stamps the start.
Events carry CLOCK_MONOTONIC timestamps: `end_turn` takes its cut time,
drains the ring buffer, and an event stamped after the cut goes to the next
turn. A background thread drains the ring buffer every `poll_interval`
seconds so that it does not fill up (`poll_interval=None` turns it off;
then only `end_turn` drains, which is what unit tests with the fake loader
use). In the kernel, repeats of a file event by the same process within a
turn are dropped (deduplicated) and, past a per-turn budget, plain file
changes are only counted: `Effects.files[...].count` includes those counts,
the samples show what was sent.

`python -m ebpf.inspector --print-program` prints the generated BPF C.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from ebpf._events import MAX_TAGS, Event
from ebpf._proc import HostProcessTable, ProcessTable, ProcInfo, quiet_baseline, settled_snapshot, snapshot
from ebpf._tmpfs import HostMemoryFs, Manifest, MemoryFs, rescan
from ebpf._turn import DEFAULT_STATELESS, TurnRecorder
from ebpf.effects import MAX_SAMPLES, Effects
from ebpf.errors import AlreadyWatched, BPFUnavailable, InvalidArgument, NotWatched

UNIFIED_ROOT = Path("/sys/fs/cgroup/unified")


class Loader(Protocol):
    """The seam between the inspector and the kernel (BccLoader, FakeLoader)."""

    mode: str  # "bpf-cgroup" or "bpf-pids"

    def program(self) -> str: ...
    def open(self) -> None: ...
    def add_cgroup(self, cgroup_id: int, level: int, tag: int) -> None: ...
    def remove_cgroup(self, cgroup_id: int) -> None: ...
    def add_pid(self, pid: int, tag: int) -> None: ...
    def remove_tag_pids(self, tag: int) -> None: ...
    def read_events(self, timeout_ms: int = 0) -> list[Event]: ...
    def write_count(self, tag: int) -> int: ...
    def dropped_count(self, tag: int) -> int: ...
    def next_epoch(self, tag: int) -> None: ...
    def suppressed_counts(self, tag: int) -> dict[int, int]: ...
    def begin_pause(self, tag: int) -> None: ...
    def end_pause(self, tag: int) -> set[int]: ...
    def close(self) -> None: ...


def cgroup2_mounts() -> list[Path]:
    """Mount points of cgroup v2 hierarchies, from /proc/self/mountinfo."""
    out = []
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                if right.split(" ", 1)[0] == "cgroup2":
                    out.append(Path(left.split()[4]))
    except OSError:
        pass
    return out


def cgroup_identity(cgroup_path: Path, mounts: list[Path] | None = None) -> tuple[int, int]:
    """(cgroup v2 id, level) of a cgroup directory: the id is its inode
    number, the level its depth below the hierarchy's root (root = 0)."""
    p = cgroup_path.resolve()
    mounts = mounts if mounts is not None else cgroup2_mounts()
    for m in sorted(mounts, key=lambda x: -len(x.parts)):
        if p == m or m in p.parents:
            try:
                return os.stat(p).st_ino, len(p.parts) - len(m.parts)
            except OSError as e:
                raise InvalidArgument(f"cgroup {cgroup_path}: {e.strerror}") from e
    raise InvalidArgument(
        f"{cgroup_path} is not in a cgroup v2 hierarchy (mounted: {', '.join(map(str, mounts)) or 'none'})"
    )


def default_loader() -> Loader:
    """bcc, keyed on cgroup ids when a unified hierarchy is mounted, else on pids."""
    from ebpf._bcc import BccLoader

    return BccLoader(follow_pids=not cgroup2_mounts())


@dataclass
class _Watched:
    sandbox_id: str
    tag: int
    cgroup_path: Path
    cgroup_id: int | None
    recorder: TurnRecorder
    baseline: dict[int, ProcInfo]
    writes_base: int
    dropped_base: int
    suppressed_base: dict[int, int] = field(default_factory=dict)
    turn: int = 0
    started_ns: int = 0
    cut_ns: int | None = None  # set while end_turn drains
    next_recorder: TurnRecorder | None = None
    stateless: frozenset[str] = DEFAULT_STATELESS
    outside: tuple[str, ...] = ()
    lock: threading.Lock = field(default_factory=threading.Lock)
    # crabd's own pause of the sandbox (freeze / CRIU dump / thaw): the
    # processes before it
    pre_pause: dict[int, ProcInfo] | None = None
    tmpfs: Manifest = field(default_factory=dict)  # the memory file systems at the last turn end


class Inspector:
    """Watches sandboxes' cgroups with BPF and reports each turn's effects."""

    def __init__(
        self,
        loader: Loader | None = None,
        *,
        processes: ProcessTable | None = None,
        clock: Callable[[], int] = time.monotonic_ns,
        poll_interval: float | None = 0.01,
        max_samples: int = MAX_SAMPLES,
        settle: float = 0.2,
        memory_fs: MemoryFs | None = None,
    ) -> None:
        self._loader = loader if loader is not None else default_loader()
        self._procs = processes if processes is not None else HostProcessTable()
        # the tmpfs check reads the processes the table lists: with a fake
        # table (unit tests) it is on only when a matching fake is passed
        self._memfs = memory_fs if memory_fs is not None else HostMemoryFs() if processes is None else None
        self._clock = clock
        self._poll_interval = poll_interval
        self._settle = settle  # max seconds end_turn waits for new processes to settle
        self._max = max_samples
        self._sandboxes: dict[str, _Watched] = {}
        self._by_tag: dict[int, _Watched] = {}
        self._poll_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._opened = False
        self._waiting = 0
        self._count_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def source(self) -> str:
        return self._loader.mode

    def program(self) -> str:
        return self._loader.program()

    def open(self) -> None:
        """Load the BPF program (done by the first `watch`); raises BPFUnavailable."""
        if self._opened:
            return
        self._loader.open()
        self._opened = True
        self._stop.clear()
        if self._poll_interval is not None:
            self._thread = threading.Thread(target=self._poll_loop, name="ebpf-inspector", daemon=True)
            self._thread.start()

    def __enter__(self) -> Inspector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        with self._poll_lock:
            self._loader.close()
        self._opened = False

    # -- sandboxes
    def watch(
        self,
        sandbox_id: str,
        cgroup_path: str | os.PathLike[str],
        *,
        init_pid: int | None = None,
        outside_paths: tuple[str, ...] = (),
        stateless_comms: frozenset[str] = DEFAULT_STATELESS,
    ) -> None:
        """Start attributing the tasks of `cgroup_path` (and its descendants)
        to `sandbox_id`.

        `init_pid` is needed only in pid-following mode. `outside_paths` are
        path prefixes (as the sandbox sees them) that are not part of its
        file system, e.g. a host directory the runtime bind-mounts for its own
        use: writes there are reported as special_writes["outside"] and do
        not make a turn FS. `stateless_comms` names processes whose waking up
        changes no state (zombie-reaping inits)."""
        if cgroup_path is None:
            raise InvalidArgument(
                f"watch({sandbox_id!r}) needs the sandbox's cgroup directory: its cgroup v2 directory, or "
                "(pid-following mode) any cgroup whose cgroup.procs lists the sandbox's processes"
            )
        self.open()
        path = Path(cgroup_path)
        with self._state_lock:
            if sandbox_id in self._sandboxes:
                raise AlreadyWatched(f"sandbox {sandbox_id!r} is already watched")
            used = set(self._by_tag)
            tag = next((t for t in range(1, MAX_TAGS) if t not in used), None)
            if tag is None:
                raise BPFUnavailable(f"more than {MAX_TAGS - 1} sandboxes watched")
            cgid = None
            if self._loader.mode == "bpf-cgroup":
                cgid, level = cgroup_identity(path)
                if any(w.cgroup_id == cgid for w in self._sandboxes.values()):
                    raise AlreadyWatched(f"cgroup {path} is already watched")
            w = _Watched(
                sandbox_id=sandbox_id,
                tag=tag,
                cgroup_path=path,
                cgroup_id=cgid,
                recorder=TurnRecorder(self._max, tuple(outside_paths)),
                baseline={},
                stateless=frozenset(stateless_comms),
                outside=tuple(outside_paths),
                writes_base=self._loader.write_count(tag),
                dropped_base=self._loader.dropped_count(tag),
                suppressed_base=self._loader.suppressed_counts(tag),
            )
            # a tag may be reused: a new epoch keeps the kernel's per-turn
            # dedup entries of its previous sandbox from matching
            self._loader.next_epoch(tag)
            if cgid is not None:
                self._loader.add_cgroup(cgid, level, tag)
            else:
                pids = set(self._procs.pids(path)) | ({init_pid} if init_pid else set())
                if not pids:
                    raise BPFUnavailable(f"pid-following mode needs init_pid or processes in {path}")
                for pid in pids:
                    self._loader.add_pid(pid, tag)
            w.baseline = snapshot(self._procs, path)
            _, w.tmpfs = rescan(self._memfs, {}, set(w.baseline), w.outside)
            self._sandboxes[sandbox_id] = w
            self._by_tag[tag] = w

    def unwatch(self, sandbox_id: str) -> None:
        with self._state_lock:
            w = self._sandboxes.pop(sandbox_id, None)
            if w is None:
                raise NotWatched(f"sandbox {sandbox_id!r} is not watched")
            if w.cgroup_id is not None:
                self._loader.remove_cgroup(w.cgroup_id)
            else:
                self._loader.remove_tag_pids(w.tag)
            self._loader.end_pause(w.tag)  # a pause never closed (the sandbox died in it)
            # keep the tag reserved until events in flight are drained
        self._drain()
        with self._state_lock:
            self._by_tag.pop(w.tag, None)

    def _get(self, sandbox_id: str) -> _Watched:
        try:
            return self._sandboxes[sandbox_id]
        except KeyError:
            raise NotWatched(f"sandbox {sandbox_id!r} is not watched") from None

    # -- events
    def _dispatch(self, events: list[Event]) -> None:
        for ev in events:
            w = self._by_tag.get(ev.tag)
            if w is None:
                continue
            with w.lock:
                if w.cut_ns is not None and ev.ts > w.cut_ns:
                    if w.next_recorder is None:
                        w.next_recorder = TurnRecorder(self._max, w.outside)
                    w.next_recorder.add(ev)
                else:
                    w.recorder.add(ev)

    def _drain(self) -> None:
        with self._count_lock:
            self._waiting += 1
        try:
            with self._poll_lock:
                self._dispatch(self._loader.read_events(0))
        finally:
            with self._count_lock:
                self._waiting -= 1

    def _poll_loop(self) -> None:
        # The program submits without waking readers, so this is a timed
        # loop: sleep, then consume whatever is in the ring buffer.
        assert self._poll_interval is not None
        while not self._stop.wait(self._poll_interval):
            if self._waiting:
                continue  # end_turn is draining
            with self._poll_lock:
                try:
                    events = self._loader.read_events(0)
                except Exception:  # noqa: BLE001 - keep draining; end_turn reports drops
                    events = []
                self._dispatch(events)

    # -- turns
    def begin_turn(self, sandbox_id: str) -> None:
        w = self._get(sandbox_id)
        w.started_ns = self._clock()

    def before_pause(self, sandbox_id: str) -> None:
        """crabd is about to freeze (and maybe dump) the sandbox between turns:
        note its processes and arm the kernel's watch of the pause."""
        w = self._get(sandbox_id)
        self._loader.begin_pause(w.tag)
        pre = snapshot(self._procs, w.cgroup_path)
        with w.lock:
            w.pre_pause = pre

    def after_pause(self, sandbox_id: str) -> None:
        """The sandbox was thawed: the next turn compares with its quiet state
        (see `quiet_baseline`), except for what the kernel saw.

        While the pause is armed the kernel drops the events of the threads
        CRIU seized (its parasite's doing, not the sandbox's); every other
        event counts for the next turn, as before any pause. And it counts,
        per thread, the system calls that are more than the restart of the
        call the freeze interrupted: a thread that made one (it wrote, opened,
        slept again after its sleep ended: it ran user code) makes its
        process active in the next turn, whose memory may differ from the
        checkpoint's."""
        w = self._get(sandbox_id)
        with w.lock:
            pre, base = w.pre_pause, w.baseline
        if pre is None:
            return
        try:
            new_base, ran = quiet_baseline(self._procs, w.cgroup_path, base, pre, self._settle,
                                           worked=lambda post: self._loader.end_pause(w.tag))
        finally:
            self._loader.end_pause(w.tag)  # disarmed already unless quiet_baseline failed
        self._drain()
        with w.lock:
            w.baseline, w.pre_pause = new_base, None
            w.recorder.active_pids |= ran

    def end_turn(self, sandbox_id: str) -> Effects:
        w = self._get(sandbox_id)
        # processes first (waiting for new ones to settle), then the cut: what
        # a process does while starting up belongs to the turn that started it
        after = settled_snapshot(self._procs, w.cgroup_path, w.baseline, self._settle)
        tmpfs_changed, w.tmpfs = rescan(self._memfs, w.tmpfs, set(after), w.outside)
        cut = self._clock()
        with w.lock:
            w.cut_ns = cut
        # repeats are deduplicated in the kernel per turn: a new turn starts now
        self._loader.next_epoch(w.tag)
        self._drain()
        writes = self._loader.write_count(w.tag)
        dropped = self._loader.dropped_count(w.tag)
        suppressed = self._loader.suppressed_counts(w.tag)
        with w.lock:
            rec, w.recorder = w.recorder, (w.next_recorder or TurnRecorder(self._max, w.outside))
            rec.carry_over(w.recorder)  # an exec whose argv came before the cut
            w.next_recorder = None
            w.cut_ns = None
            before, w.baseline = w.baseline, after
            w.turn += 1
            turn, started = w.turn, w.started_ns
            w.started_ns = 0
            wb, db = w.writes_base, w.dropped_base
            w.writes_base, w.dropped_base = writes, dropped
            sb_base, w.suppressed_base = w.suppressed_base, suppressed
        if self._loader.mode == "bpf-pids":
            # new processes reached through fork are followed by the program;
            # make sure every current member is (runc exec'd ones are not forks)
            for pid in after:
                self._loader.add_pid(pid, w.tag)
        return rec.effects(
            sandbox_id=sandbox_id,
            turn=turn,
            source=self._loader.mode,  # type: ignore[arg-type]
            started_ns=started,
            ended_ns=cut,
            before=before,
            after=after,
            write_syscalls=writes - wb,
            dropped=dropped - db,
            stateless=w.stateless,
            suppressed={k: v - sb_base.get(k, 0) for k, v in suppressed.items() if v - sb_base.get(k, 0) > 0},
            tmpfs_changed=tmpfs_changed,
        )
