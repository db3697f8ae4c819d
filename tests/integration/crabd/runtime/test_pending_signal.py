"""A signal sent to a process that blocks it changes that process's state
without running it (found by the ground-truth oracle, issue 14): the turn
that sends it must save the processes, and a rollback to it must give the
process back with the signal still pending."""

from __future__ import annotations

from crabd.testing import settled_checkpoints

import pytest

pytestmark = pytest.mark.needs("runc", "criu", "bpf", "busybox", "debian-py")

BLOCKER = ("import os, signal, time\n"
           "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})\n"
           "if os.fork(): os._exit(0)\n"
           "open('/tmp/blocker.pid', 'w').write(str(os.getpid()))\n"
           "time.sleep(3600)\n")
PENDING = "grep -E '^(SigPnd|ShdPnd)' /proc/$(cat /tmp/blocker.pid)/status"
SIGUSR2_BIT = 1 << (12 - 1)


def _pending(out: str) -> int:
    bits = 0
    for line in out.splitlines():
        bits |= int(line.split()[1], 16)
    return bits


def _settled(c, sid):
    return settled_checkpoints(c, sid, 240)


def test_a_pending_signal_is_saved(start_daemon):
    c = start_daemon(images=("busybox", "debian-py")).client()
    sid = c.create_sandbox("debian-py")["id"]
    r = c.exec(sid, ["python3", "-c", BLOCKER])
    assert r["exit_code"] == 0, r
    _settled(c, sid)
    c.exec(sid, "true")  # a quiet turn: the blocker is in the baseline
    _settled(c, sid)
    sent = c.exec(sid, "kill -USR2 $(cat /tmp/blocker.pid)")
    assert sent["exit_code"] == 0, sent
    assert _pending(c.exec(sid, PENDING)["stdout"]) & SIGUSR2_BIT  # live: pending
    assert sent["plan"] == "FS_PROC", sent  # before the fix: SKIP, "no recovery-relevant OS effect seen"
    _settled(c, sid)
    rb = c.rollback(sid, sent["checkpoint"])
    assert rb["restored"].startswith("fs+proc"), rb
    assert _pending(c.exec(sid, PENDING)["stdout"]) & SIGUSR2_BIT, "the restored process lost its pending signal"
