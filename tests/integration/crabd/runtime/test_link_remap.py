"""A process holding a file whose name was unlinked while another hard link
keeps it (zdtm unlink_fstat03: open a, link a b, unlink a) is checkpointed
with its processes, and a rollback gives it the same file back (issue 15).

Before the fix the dump failed ("Can't create link remap ... Use
link-remap option"): a files-only checkpoint. CRIU's --link-remap alone
would not do: its link is made after crabd's FS commit and removed after
the dump (runtime/linkremap.py).

A dump that fails after the FS commit (CRIU refuses, or crabd does) must not
leave those links in the files-only checkpoint it keeps: before the fix the
commit kept `/root/.crabd-link-remap.<inode>`, and a rollback to it brought the
name back into the sandbox. Nor may crabd killed mid-dump leave them in the
live sandbox once it restarts (before the fix they stayed there for good).
"""

from __future__ import annotations

import json
import shutil

from crabd.testing import settled_checkpoint, settled_checkpoints, wait_until

import pytest

pytestmark = pytest.mark.needs("runc", "criu", "bpf", "busybox")

HOLD = ("setsid sh -c 'exec 3>/root/a; ln /root/a /root/b; rm /root/a; echo one >&3; exec sleep 3600' "
        "</dev/null >/dev/null 2>&1 & echo $! > /root/holder.pid")
FD = "readlink /proc/$(cat /root/holder.pid)/fd/3"
SAME = "[ $(stat -L -c %i /proc/$(cat /root/holder.pid)/fd/3) = $(stat -c %i /root/b) ] && echo same"
LEFT = "ls -a /root | grep -E 'link.remap' || true"


def test_an_open_unlinked_but_linked_file_round_trips(full_capture):
    c, sid = full_capture
    assert c.exec(sid, HOLD)["exit_code"] == 0
    assert c.exec(sid, "sleep 0.3; " + FD)["stdout"].strip() == "/root/a (deleted)"
    ck = settled_checkpoint(c, c.exec(sid, "echo two >> /root/b")["checkpoint"])
    assert ck["state"] == "committed", ck
    assert ck["proc_image"], f"no process image: {ck['reasons']}"
    assert c.exec(sid, LEFT)["stdout"].strip() == "", "a link made for the dump was left in the sandbox"

    settled_checkpoint(c, c.exec(sid, "kill -9 $(cat /root/holder.pid); echo three >> /root/b")["checkpoint"])
    rb = c.rollback(sid, ck["id"])
    assert rb["restored"].startswith("fs+proc"), rb
    assert c.exec(sid, FD)["stdout"].strip() == "/root/a (deleted)"
    assert c.exec(sid, SAME)["stdout"].strip() == "same", "the restored descriptor is not the file /root/b names"
    assert c.exec(sid, "cat /root/b")["stdout"].split() == ["one", "two"]
    assert c.exec(sid, LEFT)["stdout"].strip() == "", "a link made for the restore was left in the sandbox"


# CRIU that refuses every dump (runc's `checkpoint`) and runs the rest.
FAILING_DUMP = """#!/bin/sh
case "$(tr '\\0' ' ' < /proc/$PPID/cmdline 2>/dev/null)" in
  *" checkpoint "*) echo "Error (test wrapper): injected dump failure" >&2; exit 1 ;;
esac
exec {real} "$@"
"""


def test_a_failed_dump_leaves_no_link_in_its_files_only_checkpoint(start_daemon, tmp_path):
    real = shutil.which("criu")
    assert real, "criu missing: run scripts/setup-host"
    wrapper = tmp_path / "criu-wrapper"
    wrapper.write_text(FAILING_DUMP.replace("{real}", real))
    wrapper.chmod(0o755)
    cfg = tmp_path / "config.toml"
    cfg.write_text('capture = "full"\n')
    c = start_daemon(args=["--config", str(cfg)], env={"CRABD_INSPECTOR": "proc", "CRABD_CRIU": str(wrapper)}).client()
    sid = c.create_sandbox("busybox")["id"]
    before = settled_checkpoint(c, c.exec(sid, "true")["checkpoint"])
    assert c.exec(sid, HOLD)["exit_code"] == 0
    assert c.exec(sid, "sleep 0.3; " + FD)["stdout"].strip() == "/root/a (deleted)"
    ck = settled_checkpoint(c, c.exec(sid, "echo two >> /root/b")["checkpoint"])
    assert ck["state"] == "committed" and not ck["proc_image"], ck
    assert any("process image not captured" in r for r in ck["reasons"]), ck["reasons"]
    assert c.exec(sid, LEFT)["stdout"].strip() == "", "a link made for the dump was left in the sandbox"

    changes = json.dumps(c.diff(before["id"], ck["id"])["changes"])
    assert '"root/b"' in changes, changes  # the diff sees this turn's write
    assert "link-remap" not in changes, f"the files-only checkpoint kept crabd's link: {changes}"
    c.rollback(sid, ck["id"])
    assert c.exec(sid, LEFT)["stdout"].strip() == "", "a rollback to the files-only checkpoint brought the link back"
    assert c.exec(sid, "cat /root/b")["stdout"].split() == ["one", "two"]


def test_a_restart_after_a_crash_mid_dump_removes_the_links(start_daemon, tmp_path):
    cfg = tmp_path / "config.toml"
    cfg.write_text('capture = "full"\n')
    d = start_daemon(args=["--config", str(cfg)], env={"CRABD_INSPECTOR": "proc"})
    c = d.client()
    sid = c.create_sandbox("busybox")["id"]
    assert c.exec(sid, HOLD)["exit_code"] == 0
    assert c.exec(sid, "sleep 0.3; " + FD)["stdout"].strip() == "/root/a (deleted)"
    settled_checkpoints(c, sid)
    # Restarted with CRABD_CHAOS=criu_dump: a capture announces itself in the
    # log and sleeps there, frozen, its files committed with crabd's links,
    # the dump next; crabd is killed there.
    d.stop()
    c.close()
    d.env = {"CRABD_INSPECTOR": "proc", "CRABD_CHAOS": "criu_dump", "CRABD_CHAOS_SLEEP": "60"}
    d.start()
    c = d.client()
    seen = d.log.read_text(errors="replace").count("crabd-chaos: criu_dump")
    c.exec(sid, "true")
    wait_until(lambda: d.log.read_text(errors="replace").count("crabd-chaos: criu_dump") > seen,
               "a capture at the kill point", 120)
    root = d.state / "sandboxes" / sid / "bundle" / "rootfs" / "root"
    assert list(root.glob(".crabd-link-remap.*")), f"no link in {root}: the kill missed the window"
    d.kill9()
    c.close()
    d.env = {"CRABD_INSPECTOR": "proc"}
    d.start()
    c = d.client()
    assert c.exec(sid, LEFT)["stdout"].strip() == "", "a link of the killed dump is still in the sandbox"
    assert c.exec(sid, FD)["stdout"].strip() == "/root/a (deleted)"  # the sandbox kept running
