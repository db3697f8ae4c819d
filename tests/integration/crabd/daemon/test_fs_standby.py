"""FS-only standbys (issue 16 item 2): the recovery target of a sandbox
without processes to keep is a fresh crabd-init, started on its own fork of
the checkpoint's files and stopped; a recovery is then a promotion. What
must hold: the promoted sandbox has exactly the checkpoint's files (not the
files changed after it), a standby of another checkpoint is never promoted,
and a daemon killed with standbys around leaves nothing behind once it is
back."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from crabd.testing import wait_until

pytestmark = pytest.mark.needs("runc", "criu", "bpf", "busybox")

# every file's path, type, mode, size and content digest, /proc /sys /dev left out
TREE = ("find / -xdev \\( -path /proc -o -path /sys -o -path /dev \\) -prune -o -print | sort | "
        "while read -r f; do if [ -f \"$f\" ] && [ ! -L \"$f\" ]; then "
        "echo \"$f $(stat -c '%F %a %s' \"$f\") $(md5sum < \"$f\")\"; "
        "else echo \"$f $(stat -c '%F %a' \"$f\")\"; fi; done")


def _tree(c, sid: str) -> str:
    r = c.exec(sid, TREE)
    assert r["exit_code"] == 0, r
    return r["stdout"]


def _last_seq(c, sid=None) -> int:
    return max((e["seq"] for e in c.events(sandbox=sid)), default=0) if sid else c.last_event_seq()


def _standby_ready(c, sid: str, cid: str) -> dict:
    def ready():
        return next((e for e in c.events(sandbox=sid) if e["kind"] == "standby.ready"
                     and e["data"]["checkpoint"] == cid), None)
    return wait_until(ready, f"standby of {cid}", 120, interval=0.05)  # type: ignore[return-value]


def _rolled_back(c, sid: str, since: int) -> dict:
    return wait_until(lambda: next((e for e in c.events(since=since, sandbox=sid)
                                    if e["kind"] == "sandbox.rolled_back"), None),
                      "automatic recovery", 120, interval=0.02)  # type: ignore[return-value]


def _rootfs(d, sid: str) -> Path:
    return d.state / "sandboxes" / sid / "bundle" / "rootfs"


def test_recovery_promotes_the_fs_standby_with_exactly_the_checkpoint_files(start_daemon):
    d = start_daemon(env={"CRABD_DEATH_POLL_S": "600"})
    c = d.client()
    sid = c.create_sandbox("busybox")["id"]
    r = c.exec(sid, "mkdir -p /root/w && echo one > /root/w/a && echo keep > /root/w/b && "
                    "ln -s a /root/w/l && chmod 600 /root/w/b && rm -f /etc/motd")
    assert r["plan"] == "FS", r
    ev = _standby_ready(c, sid, r["checkpoint"])
    assert ev["data"]["processes"] is False and 0 < ev["data"]["memory_bytes"] <= 8 * 2**20, ev
    want = _tree(c, sid)   # a SKIP turn: the files the checkpoint holds (its checkpoint shares them)
    head = c.sandbox(sid)["head"]
    # Changes after the checkpoint that no turn saw (the host writes the
    # sandbox's root directly): a recovery must drop them all.
    root = _rootfs(d, sid)
    (root / "root/w/a").write_text("changed\n")
    (root / "root/w/new").write_text("new\n")
    (root / "root/w/b").unlink()
    since = _last_seq(c, sid)
    os.kill(c.sandbox(sid)["pid"], signal.SIGKILL)
    ev = _rolled_back(c, sid, since)
    assert ev["data"]["restored"] == "fs (standby)" and ev["data"]["checkpoint"] == head, ev
    assert _tree(c, sid) == want
    # the promoted init is the sandbox's: turns, captures and a second recovery go on as before
    r2 = c.exec(sid, "echo two > /root/w/a")
    assert r2["exit_code"] == 0 and r2["plan"] == "FS", r2
    _standby_ready(c, sid, r2["checkpoint"])
    since = _last_seq(c, sid)
    os.kill(c.sandbox(sid)["pid"], signal.SIGKILL)
    ev = _rolled_back(c, sid, since)
    assert ev["data"]["restored"] == "fs (standby)", ev
    assert c.exec(sid, "cat /root/w/a")["stdout"] == "two\n"
    c.delete_sandbox(sid)
    assert not (d.state / "standbys" / sid).exists()


def test_a_standby_of_another_checkpoint_is_never_promoted(start_daemon):
    c = start_daemon().client()
    sid = c.create_sandbox("busybox")["id"]
    first = c.exec(sid, "echo 1 > /n")["checkpoint"]
    _standby_ready(c, sid, first)
    want_first = _tree(c, sid)
    # A rollback right after the next turn races the standby's refresh:
    # whichever wins, the files are the newest checkpoint's, and a standby
    # is promoted only if it holds that checkpoint.
    for i in range(2, 5):
        ck = c.exec(sid, f"echo {i} > /n")["checkpoint"]
        back = c.rollback(sid)
        assert back["checkpoint"] == ck, back
        if "standby" in back["restored"]:
            assert any(e["kind"] == "standby.ready" and e["data"]["checkpoint"] == ck
                       for e in c.events(sandbox=sid)), back
        assert c.exec(sid, "cat /n")["stdout"] == f"{i}\n"
    # The standby holds the newest checkpoint: a rollback to the first one is cold.
    last = c.exec(sid, "echo 9 > /n")["checkpoint"]
    _standby_ready(c, sid, last)
    back = c.rollback(sid, first)
    assert back["restored"] == "fs", back
    assert _tree(c, sid) == want_first


def test_a_restart_with_standbys_around_leaks_nothing(start_daemon):
    d = start_daemon(env={"CRABD_DEATH_POLL_S": "600"})
    c = d.client()
    fs = c.create_sandbox("busybox")["id"]
    proc = c.create_sandbox("busybox")["id"]
    ck = c.exec(fs, "echo f > /f")["checkpoint"]
    _standby_ready(c, fs, ck)
    # one promotion first: the fs sandbox's root is a former standby's snapshot then
    since = _last_seq(c, fs)
    os.kill(c.sandbox(fs)["pid"], signal.SIGKILL)
    assert _rolled_back(c, fs, since)["data"]["restored"] == "fs (standby)"
    assert c.sandbox(fs)["fs_key"].startswith("standby-")
    wait_until(lambda: [e for e in c.events(since=since, sandbox=fs) if e["kind"] == "standby.ready"],
               "the standby made again after the promotion", 120, interval=0.05)
    r = c.exec(proc, "sleep 100000 >/dev/null 2>&1 &")
    assert r["plan"] == "FS_PROC", r
    _standby_ready(c, proc, r["checkpoint"])
    tokens = [p.name for sid in (fs, proc) for p in (d.state / "standbys" / sid).iterdir()]
    assert len(tokens) == 2, tokens
    d.proc.kill()   # the hardest restart: no shutdown ran
    d.proc.wait(30)
    c.close()
    d.start()
    c = d.client()
    wait_until(lambda: all(c.sandbox(s)["state"] == "running" for s in (fs, proc)), "re-adoption", 60)
    fs_root = c.sandbox(fs)["fs_key"]
    left = [p for p in (d.state / "standbys").rglob("*")] if (d.state / "standbys").exists() else []
    assert not left, left
    mounts = Path("/proc/self/mountinfo").read_text()
    assert str(d.state / "standbys") + "/" not in mounts
    for sid in (fs, proc):
        for hier in ("freezer", "memory", "unified"):
            base = Path("/sys/fs/cgroup") / hier / "crabd"
            if base.is_dir():
                assert not [p.name for p in base.iterdir() if p.name.startswith(sid + ".")], (hier, sid)
    # nor a standby's snapshot (checked with the daemon stopped: deltafs is its own)
    c.close()
    d.stop()
    import deltafs
    snaps = deltafs.open(str(d.state / "fs"))
    try:
        roots = {i.name for i in snaps.walk() if i.name.startswith("standby-")}
        assert roots == {fs_root}, roots   # the promoted root stays, no standby's does
    finally:
        snaps.close()
    d.start()
    c = d.client()
    assert c.exec(fs, "cat /f")["stdout"] == "f\n"   # the promoted root kept its files
    # and the sandboxes still recover (through new standbys, once a capture
    # made them: the first turn after a restart is saved whole, FS_PROC)
    r = c.exec(fs, "echo g > /f")
    _standby_ready(c, fs, r["checkpoint"])
    since = _last_seq(c, fs)
    os.kill(c.sandbox(fs)["pid"], signal.SIGKILL)
    assert "standby" in _rolled_back(c, fs, since)["data"]["restored"]
    assert c.exec(fs, "cat /f")["stdout"] == "g\n"
