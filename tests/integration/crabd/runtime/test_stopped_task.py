"""A sandbox with a SIGSTOPped process is checkpointed with its processes,
and a rollback gives the process back still stopped (zdtm stopped*,
vdso02; issue 15).

On this cgroup v1 hybrid host, CRIU seizing a stopped task inside a frozen
v1 freezer cgroup hangs in the kernel (PTRACE_SEIZE waits for a task the v1
freezer holds in TASK_FROZEN); crabd used to refuse such a dump and keep the
files only. The v2 freezer of the unified hierarchy, where runc puts the
sandbox too, does not hold a stopped task that way: crabd now freezes there
and has CRIU freeze there. Before the fix: the checkpoint had no process
image ("has stopped tasks: ... host limit").
"""

from __future__ import annotations

from crabd.testing import settled_checkpoint, wait_until

import pytest

pytestmark = pytest.mark.needs("runc", "criu", "bpf", "busybox")

STATE = "sed 's/.*) //' /proc/$(cat /root/stopped.pid)/stat | cut -d' ' -f1"


def test_a_stopped_process_is_checkpointed_and_comes_back_stopped(full_capture):
    c, sid = full_capture
    r = c.exec(sid, "setsid sleep 3600 </dev/null >/dev/null 2>&1 & echo $! > /root/stopped.pid; "
                    "kill -STOP $(cat /root/stopped.pid)")
    assert r["exit_code"] == 0, r
    assert c.exec(sid, STATE)["stdout"].strip() == "T"
    stopped = settled_checkpoint(c, c.exec(sid, "echo stopped > /root/f")["checkpoint"])
    assert stopped["state"] == "committed", stopped
    assert stopped["proc_image"], f"no process image of a sandbox with a stopped task: {stopped['reasons']}"
    # the sandbox is not left frozen, and the stopped task is still stopped
    assert c.exec(sid, STATE)["stdout"].strip() == "T"

    running = c.exec(sid, "kill -CONT $(cat /root/stopped.pid); echo running > /root/f")
    assert c.exec(sid, STATE)["stdout"].strip() in ("S", "R")
    settled_checkpoint(c, running["checkpoint"])

    rb = c.rollback(sid, stopped["id"])
    assert rb["restored"].startswith("fs+proc"), rb
    assert c.exec(sid, "cat /root/f")["stdout"].strip() == "stopped"
    assert c.exec(sid, STATE)["stdout"].strip() == "T", "the process came back running, not stopped"
    # and it still runs when continued
    assert c.exec(sid, "kill -CONT $(cat /root/stopped.pid) && sleep 0.2 && " + STATE)["stdout"].strip() in ("S", "R")


def test_a_hot_standby_keeps_a_stopped_process_stopped(full_capture):
    """A standby is restored with every task stopped and promoted by a
    SIGCONT to each: not to a task that was stopped when dumped."""
    c, sid = full_capture
    c.exec(sid, "setsid sleep 3600 </dev/null >/dev/null 2>&1 & echo $! > /root/stopped.pid; "
                "kill -STOP $(cat /root/stopped.pid)")
    ev0 = max((e["seq"] for e in c.events(latest=1)), default=0)
    stopped = settled_checkpoint(c, c.exec(sid, "echo stopped > /root/f")["checkpoint"])
    assert stopped["proc_image"], stopped["reasons"]
    wait_until(lambda: any(e["kind"] == "standby.ready" and e["data"].get("checkpoint") == stopped["id"]
                           for e in c.events(since=ev0, sandbox=sid)), "a hot standby of the checkpoint", 120)
    rb = c.rollback(sid, stopped["id"])
    assert rb["restored"] == "fs+proc (hot standby)", rb
    assert c.exec(sid, STATE)["stdout"].strip() == "T", "the promotion continued a task that was stopped"
