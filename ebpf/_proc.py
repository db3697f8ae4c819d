"""What /proc and the cgroup file system say about a sandbox's processes.

Both inspectors take a snapshot of the sandbox's processes at every turn end
and compare it with the previous one: processes that appeared (and are
alive), disappeared, or ran. `ProcessTable` is the seam; `HostProcessTable`
reads the real /proc, `ebpf.testing.FakeProcessTable` is its fake.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ebpf._events import RESTART_SYSCALL_NR
from ebpf._queues import queues

RUNNING = -1  # blocked_calls(): the thread was not in a system call


@dataclass(frozen=True)
class ProcInfo:
    pid: int
    start: int  # start time in clock ticks since boot: tells a reused pid apart
    cpu: int  # utime + stime of all threads, clock ticks
    switches: int  # voluntary + involuntary context switches of all threads
    running: bool  # some thread is in state R
    comm: str = ""
    cmdline: tuple[str, ...] = ()
    # Pending signals (each thread's SigPnd, then ShdPnd): a signal sent to a
    # process that blocks it changes its state without running it (the
    # oracle found such a turn planned SKIP).
    pending: str = ""
    # What waits in its sockets, pipes and inotify queues (ebpf._queues): a
    # message, a connection or a pipe's bytes sent to (or drained from) a
    # process that does not read changes its state without running it too.
    queued: str = ""
    # The files it holds (its fds' paths, cwd, root, executable, mapped
    # files: `held_files`): a later turn's process that deletes or renames
    # one changes this process without running it, and its process image
    # then names a path that the turn's snapshot no longer has (a restore
    # of the older image fails, and the processes were lost).
    held: str = ""

    def ran_since(self, before: ProcInfo) -> bool:
        return (self.running or self.cpu != before.cpu or self.switches != before.switches
                or self.pending != before.pending or self.queued != before.queued or self.held != before.held)


class ProcessTable(Protocol):
    def pids(self, cgroup_path: Path) -> set[int]:
        """Tgids in the cgroup and its descendants."""

    def info(self, pid: int) -> ProcInfo | None:
        """None when the process is gone."""

    def listening(self, pids: set[int]) -> dict[int, list[str]]:
        """Listening inet sockets per pid ('0.0.0.0:8000'); used by the fallback."""

    def blocked_calls(self, pid: int) -> dict[int, int]:
        """tid -> the system call number each thread is blocked in (RUNNING if none)."""


def _read(p: str) -> str | None:
    try:
        with open(p, "rb") as f:
            return f.read().decode("utf-8", "surrogateescape")
    except OSError:
        return None


def _stat_fields(text: str) -> tuple[str, list[str]]:
    # comm may hold spaces and parentheses: split at the last ')'
    lpar, rpar = text.index("("), text.rindex(")")
    return text[lpar + 1 : rpar], text[rpar + 2 :].split()


def fd_links(pid: int) -> dict[int, str]:
    """fd -> what /proc/PID/fd/FD names ('/path', 'socket:[N]', 'pipe:[N]',
    '/path (deleted)', ...); {} when the process is gone."""
    out: dict[int, str] = {}
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            out[int(fd)] = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
    return out


def held_files(pid: int, links: dict[int, str]) -> str:
    """A fingerprint of the files `pid` holds: the paths of its fds, its
    cwd, root and executable, and the files it maps, as the kernel names
    them now (a deleted one gets " (deleted)", a renamed one its new
    path). Only the set of paths counts: a write to a held file is not a
    change of this process (the snapshot has the file's content)."""
    paths = {link for link in links.values() if link.startswith("/")}
    for name in ("cwd", "root", "exe"):
        try:
            paths.add(f"{name}={os.readlink(f'/proc/{pid}/{name}')}")
        except OSError:
            continue
    for line in (_read(f"/proc/{pid}/maps") or "").splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].startswith("/"):
            paths.add(parts[5])
    if not paths:
        return ""
    return hashlib.blake2b("\0".join(sorted(paths)).encode("utf-8", "surrogateescape"), digest_size=12).hexdigest()


class HostProcessTable:
    """The real /proc and cgroup file system (host pid namespace)."""

    def pids(self, cgroup_path: Path) -> set[int]:
        out: set[int] = set()
        for d, _dirs, files in os.walk(cgroup_path):
            if "cgroup.procs" in files:
                text = _read(os.path.join(d, "cgroup.procs")) or ""
                out.update(int(x) for x in text.split())
        return out

    def info(self, pid: int) -> ProcInfo | None:
        stat = _read(f"/proc/{pid}/stat")
        if stat is None:
            return None
        comm, f = _stat_fields(stat)
        if f[0] == "Z":
            return None  # a zombie holds no state
        start = int(f[19])
        cpu = switches = 0
        running = False
        pending: list[str] = []
        shared = ""
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            return None
        for tid in tids:
            ts = _read(f"/proc/{pid}/task/{tid}/stat")
            if ts:
                _c, tf = _stat_fields(ts)
                cpu += int(tf[11]) + int(tf[12])
                running = running or tf[0] == "R"
            status = _read(f"/proc/{pid}/task/{tid}/status") or ""
            for line in status.splitlines():
                if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                    switches += int(line.split()[1])
                elif line.startswith("SigPnd:"):
                    pending.append(f"{tid}:{line.split()[1]}")
                elif line.startswith("ShdPnd:"):
                    shared = line.split()[1]
        raw = _read(f"/proc/{pid}/cmdline") or ""
        cmdline = tuple(a for a in raw.split("\0") if a) if raw else ()
        links = fd_links(pid)
        return ProcInfo(pid, start, cpu, switches, running, comm, cmdline,
                        " ".join(sorted(pending) + [f"shared:{shared}"]), queues(pid, links),
                        held_files(pid, links))

    def blocked_calls(self, pid: int) -> dict[int, int]:
        out: dict[int, int] = {}
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            return out
        for tid in tids:
            # "nr args... sp pc" while blocked in a call, "running", or "-1 sp pc"
            first = (_read(f"/proc/{pid}/task/{tid}/syscall") or "running").split(" ", 1)[0]
            try:
                out[int(tid)] = int(first)
            except ValueError:
                out[int(tid)] = RUNNING
        return out

    def listening(self, pids: set[int]) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {}
        for pid in pids:
            inodes = {link[8:-1] for link in fd_links(pid).values() if link.startswith("socket:[")}
            if not inodes:
                continue
            for name, v6 in (("tcp", False), ("tcp6", True)):
                for line in (_read(f"/proc/{pid}/net/{name}") or "").splitlines()[1:]:
                    cols = line.split()
                    if len(cols) > 9 and cols[3] == "0A" and cols[9] in inodes:
                        out.setdefault(pid, []).append(_addr(cols[1], v6))
        return out


def _addr(hexaddr: str, v6: bool) -> str:
    import ipaddress

    host, port = hexaddr.split(":")
    raw = bytes.fromhex(host)
    if v6:
        # four little-endian 32-bit words
        raw = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
        return f"[{ipaddress.IPv6Address(raw)}]:{int(port, 16)}"
    return f"{ipaddress.IPv4Address(raw[::-1])}:{int(port, 16)}"


def snapshot(table: ProcessTable, cgroup_path: Path) -> dict[int, ProcInfo]:
    """The cgroup's processes now, pid -> ProcInfo (ones that vanish while read are left out)."""
    out = {}
    for pid in table.pids(cgroup_path):
        info = table.info(pid)
        if info is not None:
            out[pid] = info
    return out


def settled_snapshot(
    table: ProcessTable,
    cgroup_path: Path,
    before: dict[int, ProcInfo],
    max_wait: float,
    step: float = 0.01,
) -> dict[int, ProcInfo]:
    """The cgroup's processes, once the ones new since `before` have settled.

    A turn's `cmd &` may still be forking and exec'ing when the turn ends;
    sampled mid-start, it would look like an older process that "ran" in the
    next turn. So while some new process is running, or its context
    switches or CPU time still move between two samples `step` apart, sample
    again, for at most `max_wait` seconds (a poller never settles: it then
    counts as running, which is conservative)."""

    def snap() -> dict[int, ProcInfo]:
        return snapshot(table, cgroup_path)

    def new(s: dict[int, ProcInfo]) -> set[int]:
        return {p for p, i in s.items() if p not in before or before[p].start != i.start}

    after = snap()
    deadline = time.monotonic() + max_wait
    while new(after) and time.monotonic() < deadline:
        time.sleep(step)
        again = snap()
        moving = new(again) - set(after)
        for p in new(again) & set(after):
            a, b = after[p], again[p]
            if b.running or b.switches != a.switches or b.cpu != a.cpu or b.start != a.start:
                moving.add(p)
        after = again
        if not moving:
            break
    return after


# worked(post) -> the pids that did more after the thaw than restart the call
# they were blocked in, or None when that cannot be told
Worked = Callable[[dict[int, ProcInfo]], "set[int] | None"]


def quiet_baseline(
    table: ProcessTable,
    cgroup_path: Path,
    baseline: dict[int, ProcInfo],
    pre_pause: dict[int, ProcInfo],
    max_wait: float,
    step: float = 0.01,
    worked: Worked | None = None,
) -> tuple[dict[int, ProcInfo], set[int]]:
    """The turn baseline after crabd paused the sandbox (freeze, CRIU dump,
    thaw), and the pids that really ran around the pause.

    A freeze wakes every task into the freezer and a CRIU dump runs parasite
    code inside each one, so after the thaw every process's context switches
    (and CPU time) have moved: compared with the old baseline, every idle
    background process would look as if it ran in the next turn, making
    every later turn FS_PROC. The checkpoint holds whatever happened before
    the pause, so the next turn is compared with the quiet state after the
    thaw instead, with exceptions that keep the plan conservative:
    - a process that ran between the baseline and the pause (`pre_pause`)
      is returned in the `ran` set, so the next turn still reports it;
    - a process that is new since the baseline stays out of the new
      baseline, so the next turn still reports it as new;
    - a process that exited keeps its old entry, so it is reported as exited;
    - after the thaw, tasks are sampled `step` apart until none moves (for
      at most `max_wait`); one still moving then is in `ran`;
    - once quiet, `worked(post)` names the processes that did more after the
      thaw than restart the call they were blocked in (a write, an open, a
      sleep that ended: any other system call): they are in `ran`. When it
      returns None, or is not given, that cannot be told, and every process
      whose counters moved since `pre_pause` is in `ran`.
    A process in `ran` keeps its old baseline entry: its work is not folded
    into the quiet state."""
    ran = {p for p, i in pre_pause.items()
           if p in baseline and baseline[p].start == i.start and i.ran_since(baseline[p])}
    post = snapshot(table, cgroup_path)
    deadline = time.monotonic() + max_wait
    while True:
        time.sleep(step)
        again = snapshot(table, cgroup_path)
        moving = {p for p, b in again.items()
                  if p in post and (b.running or b.switches != post[p].switches or b.cpu != post[p].cpu)}
        post = again
        if not moving:
            break
        if time.monotonic() >= deadline:
            ran |= moving
            break
    busy = worked(post) if worked is not None else None
    if busy is None:
        busy = {p for p, i in post.items() if p in pre_pause and pre_pause[p].start == i.start
                and i.ran_since(pre_pause[p])}
    ran |= busy
    new_base: dict[int, ProcInfo] = {}
    for p, old in baseline.items():
        cur = post.get(p)
        new_base[p] = cur if cur is not None and cur.start == old.start and p not in ran else old
    return new_base, ran


def restarted_only(table: ProcessTable, pre_pause: dict[int, ProcInfo]) -> Worked:
    """A `worked` for when no kernel trace of the thawed tasks' calls is
    available (the /proc fallback, or a thaw the BPF program did not see):
    from /proc alone, a process did nothing after the thaw only if it did not
    run at all, or if every one of its threads is now in restart_syscall (the
    interrupted sleep it was in, resumed: real work ends with a fresh call).
    Any other process counts as having worked; that is conservative, and costs
    process images of idle servers blocked in other calls."""

    def worked(post: dict[int, ProcInfo]) -> set[int]:
        out = set()
        for p, i in post.items():
            before = pre_pause.get(p)
            if before is None or before.start != i.start or not i.ran_since(before):
                continue  # new (reported as such), or did not run
            calls = table.blocked_calls(p)
            if not calls or any(nr != RESTART_SYSCALL_NR for nr in calls.values()):
                out.add(p)
        return out

    return worked
