"""A sandbox that dies again while it is being recovered is recovered again.

One scenario each, through a real daemon (root, runc, CRIU): the sandbox's
processes are killed from the host, and a killer thread on the host watches
the sandbox's cgroups and SIGKILLs the restored processes the moment they
appear -- during a hot-standby promotion, or during a CRIU restore (a
rollback to an older checkpoint than the standby's). Armed for one recovery:
the second recovery must bring the sandbox back, and the events say so.
A killer that never stops must not make crabd retry forever.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

from crabd.client import Client
from crabd.runtime import detect_layout
from crabd.testing import wait_until


class CgroupKiller:
    """SIGKILL every process that appears in a sandbox's cgroups and was not
    there when armed. Stops `linger` seconds after its first kill (one
    recovery's worth), or when told to (linger=None)."""

    def __init__(self, sid: str, linger: float | None = 0.3) -> None:
        layout = detect_layout()
        rel = f"/crabd/{sid}"
        self.files = [d / "cgroup.procs" for d in (layout.freezer_dir(rel), layout.v2_dir(rel)) if d is not None]
        self.linger = linger
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
        while not self._stop.is_set():
            if first is not None and self.linger is not None and time.monotonic() - first > self.linger:
                return
            for pid in self.pids() - self.known:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
                self.killed.append(pid)
                first = first or time.monotonic()
            time.sleep(0.0005)


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
    killer = CgroupKiller(sid)
    killer.arm()
    try:
        # Not the standby's checkpoint: a CRIU restore, killed as it appears.
        try:
            c.rollback(sid, r["checkpoint"])
        except Exception:
            pass  # the restore may fail outright: then recovery takes over too
        evs = _wait_recovered(c, sid, since)
    finally:
        killer.stop()
    kinds = [k for k, _ in evs]
    print(_story(evs))  # shown with -s
    assert killer.killed, f"the killer saw no restored process: {kinds}"
    # The story: the restore was killed (CRIU failed, or its processes died
    # once restored), then a recovery brought the sandbox back.
    assert "sandbox.died" in kinds or "sandbox.restore_failed" in kinds, _story(evs)
    assert "sandbox.rolled_back" in kinds[1:], _story(evs)
    assert c.sandbox(sid)["state"] == "running"
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
