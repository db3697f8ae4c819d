"""What crabd reads of processes from /proc, and nothing else.

Part of `crabd.runtime`: the readers the CRIU glue (`criu.py`) and the
standby lifecycle (`standby.py`) decide with: a task's state, parent and
name, a cgroup's tasks and their resident memory, their time namespaces,
and whether a network namespace holds a TCP connection. Parsers of the text
are pure (`parse_stat`, `tcp_table_connected`) and tested without root.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TaskStat", "parse_stat", "task_stat", "cgroup_procs", "rss_bytes", "time_namespaces",
           "tcp_connected", "tcp_table_connected", "ns_pid"]


@dataclass(frozen=True)
class TaskStat:
    comm: str
    state: str   # R, S, D, T (stopped), Z (zombie), X, ...
    ppid: int


def parse_stat(data: bytes) -> TaskStat:
    """The fields of a /proc/PID/stat line crabd uses. Pure. The name sits
    between the first `(` and the last `)` (it may hold either)."""
    rest = data[data.rindex(b")") + 2:].split()
    return TaskStat(data[data.index(b"(") + 1:data.rindex(b")")].decode(errors="replace"), rest[0].decode(),
                    int(rest[1]))


def task_stat(pid: int) -> TaskStat:
    """/proc/PID/stat of a task; OSError (FileNotFoundError, ProcessLookupError) when it is gone."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        return parse_stat(f.read())


def cgroup_procs(procs_file: Path) -> list[int]:
    """The pids a cgroup.procs file lists (none when it cannot be read)."""
    try:
        return [int(x) for x in procs_file.read_text().split()]
    except OSError:
        return []


def rss_bytes(procs_file: Path) -> int:
    """Resident memory of the tasks in a cgroup: about what a dump writes."""
    total = 0
    try:
        pids = procs_file.read_text().split()
    except OSError:
        return 1 << 30
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                total += next((int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmRSS:")), 0)
        except OSError:
            pass
    return total


def time_namespaces(pids: list[int]) -> dict[int, list[int]]:
    """The tasks by time namespace (inode of /proc/PID/ns/time); tasks gone,
    or a kernel without time namespaces, are left out."""
    seen: dict[int, list[int]] = {}
    for pid in pids:
        try:
            seen.setdefault(os.stat(f"/proc/{pid}/ns/time").st_ino, []).append(pid)
        except OSError:
            continue
    return seen


def tcp_connected(pid: int | None) -> bool:
    """Has the network namespace of `pid` a TCP socket that a process holds
    (inode not 0: TIME_WAIT and orphaned sockets are not dumped) and that is
    neither listening nor closed (/proc/PID/net/tcp{,6}, columns `st`, `inode`)?"""
    for name in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{name}") as f:
                if tcp_table_connected(f.read()):
                    return True
        except OSError:
            return True  # cannot tell: lock, the safe side
    return False


def tcp_table_connected(table: str) -> bool:
    """The test of tcp_connected on the text of one /proc/net/tcp table. Pure."""
    rows = (ln.split() for ln in table.splitlines()[1:])
    return any(len(r) > 9 and r[3] not in ("0A", "07") and r[9] != "0" for r in rows)


def ns_pid(pid: int) -> int | None:
    """`pid`'s number in its own (innermost) pid namespace, None if gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError, IndexError):
        pass
    return None
