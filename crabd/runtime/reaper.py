"""Children crabd adopts, and their reaping.

Part of the sandbox runtime. crabd is a child subreaper (`become_subreaper`,
called by every Runtime): the init of every sandbox, the tree of every CRIU
restore, the wrappers of `runc exec --detach` and runc's own init stages are
re-parented to it when their parent exits, and each must be reaped, or it
stays a zombie that runc still reports as running (and one in a sandbox's
pid namespace keeps the sandbox's init from finishing its exit). Who reaps
what, and why no rule steals the exit status of a child crabd waits on
itself, is said at each function.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import psutil

__all__ = ["become_subreaper", "read_pid", "pid_alive", "pidfile_alive", "reap", "reap_runc_orphans",
           "AdoptedReaper", "kill_tree_from_pidfile"]


def become_subreaper() -> None:
    import ctypes
    PR_SET_CHILD_SUBREAPER = 36
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def read_pid(pidfile: Path) -> int | None:
    try:
        return int(pidfile.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def pid_alive(pid: int) -> bool:
    """Is process `pid` alive (not gone, not a zombie)?"""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def reap(pid: int) -> None:
    """Reap `pid` if it is an exited child of this process. crabd is a child
    subreaper (see Runtime), so a sandbox init restored by CRIU (`runc
    restore --detach`) becomes its child; unreaped, it stays a zombie that
    runc still reports as running."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def reap_runc_orphans() -> list[int]:
    """Reap zombie children of this process that are stages of `runc init`
    (`runc:[1:CHILD]`, `runc:[2:INIT]`): runc's own children, never started
    by crabd, adopted by crabd (a child subreaper) when a `runc exec` dies
    half-way, e.g. when every process of its sandbox is killed while the exec
    is joining it. One left unreaped in a sandbox's pid namespace keeps the
    sandbox's init from ever finishing its exit (it waits in
    zap_pid_ns_processes), so its death would never be noticed. Only these
    names: crabd's own children are reaped by whoever waits for them."""
    return [pid for pid, comm, _ in _zombie_children() if comm.startswith("runc:[") and _reap_zombie(pid)]


# What CRIU runs as on these hosts: `criu`, or its loader when CRIU is run
# through a private libc (scripts/setup-host's /usr/local/bin/criu wrapper).
_CRIU_COMMS = ("criu", "ld-linux-x86-64")


class AdoptedReaper:
    """Reaps the zombie children crabd adopted as a child subreaper and that
    nobody else waits for; run periodically (crabd/daemon/deathwatch.py).

    Adopted, never started by crabd: every sandbox init (`runc create`'s
    child), the tree of every CRIU restore (`runc restore --detach`), exec
    wrappers, runc's init stages, and CRIU itself when the runc that ran it
    was killed. Unreaped, each stays a zombie until crabd exits (1,105 of
    them after ~560 sandboxes). Which zombies are reaped, and why each rule
    cannot steal the exit status of a child a `subprocess.Popen` of crabd
    waits on (Popen would then report exit status 0, see subprocess's ECHILD
    handling):
      - runc's init stages (`runc:[...]`): runc's children, never crabd's;
      - any process of a deeper pid namespace than crabd's (a sandbox's):
        crabd starts nothing there itself; `runc exec` runs inside only
        through runc, which is the Popen child;
      - CRIU (by name) once it has stayed a zombie for two rounds: crabd's
        own CRIU runs (`criu check`) are waited on the moment they exit.
    `skip`: pids someone reaps on purpose (the death watch's sandbox inits:
    reaped here first, their pid could be reused before the watch looks)."""

    def __init__(self) -> None:
        self._lingering: set[int] = set()
        self._level = _pidns_level(os.getpid())

    def reap(self, skip: set[int] | frozenset[int] = frozenset()) -> list[tuple[int, str]]:
        out: list[tuple[int, str]] = []
        lingering: set[int] = set()
        for pid, comm, level in _zombie_children():
            if pid in skip:
                continue
            if comm.startswith("runc:[") or (level is not None and self._level is not None and level > self._level):
                pass
            elif comm in _CRIU_COMMS:
                if pid not in self._lingering:
                    lingering.add(pid)
                    continue
            else:
                continue
            if _reap_zombie(pid):
                out.append((pid, comm))
        self._lingering = lingering
        return out


def _zombie_children() -> list[tuple[int, str, int | None]]:
    """(pid, comm, pid-namespace depth) of this process's zombie children."""
    kids: set[int] = set()
    try:  # every thread's children (an orphan is adopted by any thread of the reaper): cheap, no /proc scan
        for task in os.scandir("/proc/self/task"):
            with open(f"/proc/self/task/{task.name}/children") as f:
                kids.update(int(x) for x in f.read().split())
    except OSError:
        kids = {k.pid for k in psutil.Process().children()}
    out = []
    for pid in sorted(kids):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        comm, state = stat[stat.find("(") + 1:stat.rfind(")")], stat[stat.rfind(")") + 2:][:1]
        if state == "Z":
            out.append((pid, comm, _pidns_level(pid)))
    return out


def _pidns_level(pid: int) -> int | None:
    """How many pid namespaces `pid` is seen in (NSpid; a zombie keeps it)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return len(line.split()) - 1
    except OSError:
        pass
    return None


def _reap_zombie(pid: int) -> bool:
    try:
        return os.waitpid(pid, os.WNOHANG)[0] == pid
    except ChildProcessError:
        return False


def pidfile_alive(pidfile: Path) -> bool:
    """Is the process named by `pidfile` alive?"""
    pid = read_pid(pidfile)
    return pid is not None and pid_alive(pid)


def kill_tree_from_pidfile(pidfile: Path) -> None:
    """SIGKILL an exec'd process and every descendant (host side)."""
    try:
        pid = int(pidfile.read_text().strip())
    except (FileNotFoundError, ValueError):
        return
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
