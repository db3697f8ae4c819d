"""A sandbox that dies again while it is being recovered is recovered again.

One scenario each, through a real daemon (root, runc, CRIU): a killer thread
on the host watches the sandbox's cgroups and SIGKILLs the restored
processes -- the moment they appear during a hot-standby promotion (an
automatic recovery), or the moment a CRIU restore of them is done (a
rollback to an older checkpoint than the standby's). Armed for one
recovery: the next recovery must bring the sandbox back, and the events
say so. A killer that never stops must not make crabd retry forever.
Before the fix, the first two left the sandbox stopped for good after
`sandbox.rolled_back`, and the third never got a `sandbox.recovery_gave_up`
(crabd had no bound on its attempts).
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import signal
import socket
import struct
import threading
import time
from pathlib import Path

from crabd.client import Client
from crabd.runtime import detect_layout
from crabd.testing import wait_until

import pytest

pytestmark = pytest.mark.needs("runc", "criu", "bpf", "busybox", "netns")


class CgroupKiller:
    """SIGKILL every process that appears in a sandbox's cgroups and was not
    there when armed. Stops `linger` seconds after its first kill (one
    recovery's worth), or when told to (linger=None).

    `restored=True`: wait until the restore of the new processes is over --
    `lo` is up in their network namespace and CRIU no longer ptraces them
    -- then kill them: they die in
    the daemon's hands, between the restore and the end of the rollback."""

    def __init__(self, sid: str, linger: float | None = 0.05, restored: bool = False) -> None:
        layout = detect_layout()
        rel = f"/crabd/{sid}"
        self.files = [d / "cgroup.procs" for d in (layout.freezer_dir(rel), layout.v2_dir(rel)) if d is not None]
        self.linger = linger
        self.restored = restored
        self._host_netns = _netns(os.getpid())
        self.killed: list[int] = []
        self.known: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def pids(self) -> set[int]:
        out: set[int] = set()
        for f in self.files:
            try:
                out.update(int(x) for x in f.read_text().split())
            except OSError:
                pass
        return out

    def arm(self) -> None:
        self.known = self.pids()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        first: float | None = None
        probe: tuple[int, socket.socket] | None = None  # (pid, a socket in its network namespace)
        while not self._stop.is_set():
            if first is not None and self.linger is not None and time.monotonic() - first > self.linger:
                return
            new = self.pids() - self.known
            if new and self.restored:
                # runc puts CRIU itself into the sandbox's cgroups for the
                # restore: only the restored tasks are in another netns.
                new = {p for p in new if _netns(p) not in (None, self._host_netns)}
                if probe is None or probe[0] not in new:
                    probe = _netns_socket(min(new)) if new else None
                # and the restore is over only once CRIU let them go
                # (lo comes up early: a createRuntime hook brings it up at
                # CRIU's setup-namespaces step, before any task is restored)
                if probe is None or not _lo_up(probe[1]) or _restoring(new):
                    time.sleep(0.0005)
                    continue
            for pid in new:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
                self.killed.append(pid)
                first = first or time.monotonic()
            time.sleep(0.0005)


def _restoring(pids: set[int]) -> bool:
    """Is CRIU still restoring `pids`? It ptraces every task it restores
    until it lets them run at the very end."""
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("TracerPid:") and line.split()[1] != "0":
                return True
    return False


def _netns(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None


def _netns_socket(pid: int) -> tuple[int, socket.socket] | None:
    """A socket in `pid`'s network namespace (made by this thread inside it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        target = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
    except OSError:
        return None
    try:
        if libc.setns(target, 0x40000000) != 0:  # CLONE_NEWNET
            return None
        try:
            return pid, socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        finally:
            libc.setns(own, 0x40000000)
    finally:
        os.close(own)
        os.close(target)


def _lo_up(s: socket.socket) -> bool:
    req = struct.pack("16sH14x", b"lo", 0)
    try:
        return bool(struct.unpack("16sH14x", fcntl.ioctl(s.fileno(), 0x8913, req))[1] & 1)  # SIOCGIFFLAGS, IFF_UP
    except OSError:
        return False


def _last_seq(c: Client) -> int:
    return c.last_event_seq()


def _wait_standby(c: Client, sid: str, cid: str) -> None:
    wait_until(lambda: any(e["kind"] == "standby.ready" and e["data"]["checkpoint"] == cid
                           for e in c.events(sandbox=sid)), f"a standby of {cid}", 60)


def _wait_recovered(c: Client, sid: str, since: int, timeout: float = 60) -> list[tuple[str, dict]]:
    """Events of `sid` after `since`, once it is running and an exec works."""
    def back() -> bool:
        if c.sandbox(sid).get("status") != "running":
            return False
        try:
            return c.exec(sid, "echo ok", timeout=10)["stdout"] == "ok\n"
        except Exception:
            return False
    try:
        wait_until(back, f"sandbox {sid} running again", timeout, interval=0.2)
    except AssertionError as e:
        raise AssertionError(f"{e}; events: {c.events(since=since, sandbox=sid)}") from None
    return [(e["kind"], e["data"]) for e in c.events(since=since, sandbox=sid)]


def _story(evs: list[tuple[str, dict]]) -> str:
    return "events:\n" + "\n".join(f"  {k} {json.dumps(d)[:300]}" for k, d in evs)


def _serving_sandbox(start_daemon) -> tuple[Client, str, dict]:
    """A daemon, and a busybox sandbox whose turn started a web server (an
    FS_PROC checkpoint: its recovery restores processes)."""
    c = start_daemon(env={"CRABD_INSPECTOR": "proc"}).client()
    sid = c.create_sandbox("busybox")["id"]
    r = c.exec(sid, "echo v1 > /tmp/index.html; (httpd -f -p 8000 -h /tmp >/dev/null 2>&1 &); sleep 0.3")
    assert r["exit_code"] == 0 and r["plan"] == "FS_PROC", r
    return c, sid, r


def _serves(c: Client, sid: str) -> bool:
    return c.exec(sid, "wget -q -O - http://127.0.0.1:8000/index.html")["stdout"] == "v1\n"


def test_death_during_a_standby_promotion_is_recovered(start_daemon):
    c, sid, r = _serving_sandbox(start_daemon)
    _wait_standby(c, sid, r["checkpoint"])
    since = _last_seq(c)
    killer = CgroupKiller(sid)
    killer.arm()
    try:
        os.kill(c.sandbox(sid)["pid"], signal.SIGKILL)  # the first death: recovery promotes the standby ...
        evs = _wait_recovered(c, sid, since)           # ... whose processes the killer kills as they appear
    finally:
        killer.stop()
    kinds = [k for k, _ in evs]
    print(_story(evs))  # shown with -s
    assert killer.killed, f"the killer saw no restored process: {kinds}"
    assert kinds.count("sandbox.died") >= 2 and kinds.count("sandbox.rolled_back") >= 2, _story(evs)
    again = [data for k, data in evs if k == "sandbox.died"][1]
    assert again["after_recovery_to"] == r["checkpoint"], _story(evs)  # the story: died again after its recovery
    assert _serves(c, sid)  # the second recovery brought the processes back
    c.delete_sandbox(sid)


def test_death_during_a_criu_restore_is_recovered(start_daemon):
    c, sid, r = _serving_sandbox(start_daemon)
    later = c.exec(sid, "echo v2 > /tmp/other.html")  # a newer checkpoint: the standby holds that one
    _wait_standby(c, sid, later["checkpoint"])
    since = _last_seq(c)
    killer = CgroupKiller(sid, restored=True)
    killer.arm()
    try:
        # Not the standby's checkpoint: a CRIU restore, whose processes are
        # killed the moment the restore is done.
        try:
            back = c.rollback(sid, r["checkpoint"])
        except Exception as e:
            raise AssertionError(f"{e}; {_story([(x['kind'], x['data']) for x in c.events(since=since)])}") from None
        assert back["restored"] == "fs+proc", back
        evs = _wait_recovered(c, sid, since)
    finally:
        killer.stop()
    kinds = [k for k, _ in evs]
    print(_story(evs))  # shown with -s
    assert killer.killed, f"the killer saw no restored process: {kinds}"
    # The story: rolled back, died at once, recovered to the same checkpoint.
    assert kinds.count("sandbox.rolled_back") >= 2 and "sandbox.died" in kinds, _story(evs)
    assert c.sandbox(sid)["state"] == "running"
    assert _serves(c, sid)
    c.delete_sandbox(sid)


def test_a_sandbox_that_keeps_dying_is_not_recovered_forever(start_daemon):
    c, sid, r = _serving_sandbox(start_daemon)
    _wait_standby(c, sid, r["checkpoint"])  # committed, and the first recovery a promotion
    since = _last_seq(c)
    killer = CgroupKiller(sid, linger=None)
    killer.arm()
    try:
        os.kill(c.sandbox(sid)["pid"], signal.SIGKILL)
        wait_until(lambda: any(e["kind"] == "sandbox.recovery_gave_up" for e in c.events(since=since, sandbox=sid)),
                   "crabd giving up on a sandbox that dies on every recovery", 120, interval=0.2)
        n = sum(e["kind"] == "sandbox.rolled_back" for e in c.events(since=since, sandbox=sid))
        time.sleep(2)  # several death-watch rounds: no more attempts
        evs = [(e["kind"], e["data"]) for e in c.events(since=since, sandbox=sid)]
    finally:
        killer.stop()
    kinds = [k for k, _ in evs]
    print(_story(evs))  # shown with -s
    assert sum(k == "sandbox.rolled_back" for k in kinds) == n, _story(evs)
    assert "sandbox.recovery_fallback" in kinds, _story(evs)  # a fresh init on the files was tried before
    assert c.sandbox(sid)["state"] == "dead"
    # A rollback asked for by hand still works, and re-arms recovery.
    c.rollback(sid)
    assert c.exec(sid, "echo ok")["stdout"] == "ok\n"
    c.delete_sandbox(sid)
