"""Disk full during a checkpoint: crabd's state directory on a small (384 MiB)
loop-mounted btrfs, filled from inside a sandbox.

Expected: the checkpoint of the turn that filled it (and a manual one
asked for while it is full) fails cleanly, with code disk_full and the fix
in its error, or the API answers 507 disk_full; the previous checkpoint
stays intact; the sandbox keeps running; crabd stays up and answers (it
releases its 32 MiB space reserve before a database write on a nearly full
state dir: a write fault on SQLite's mapped WAL index there is a SIGBUS);
once the space is freed (roll back to before the fill, delete the
checkpoints that hold the big file), checkpoints work again.
"""

from __future__ import annotations

import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from crabd.errors import CrabdError
from crabd.testing import settled_checkpoint

pytestmark = pytest.mark.needs("runc", "criu", "bpf", "busybox", "btrfs")

SIZE = 384 << 20


@pytest.fixture
def small_fs():
    base = Path(tempfile.mkdtemp(prefix="crabd-diskfull-", dir="/var/tmp"))
    img, mnt = base / "fs.img", base / "mnt"
    mnt.mkdir()
    with open(img, "wb") as f:
        f.truncate(SIZE)
    subprocess.run(["mkfs.btrfs", "-q", "-M", str(img)], check=True, capture_output=True)
    subprocess.run(["mount", "-o", "loop", str(img), str(mnt)], check=True, capture_output=True)
    try:
        yield mnt
    finally:
        from crabd.testing import cleanup_state_dir
        cleanup_state_dir(mnt / "state")  # (start_daemon's teardown ran first)
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
        img.unlink(missing_ok=True)
        subprocess.run(["rm", "-rf", str(base)], capture_output=True)


def _settled(c, cid: str, timeout: float = 120) -> dict:
    return settled_checkpoint(c, cid, timeout)


def _full_failure(ck: dict) -> bool:
    return ck["state"] == "failed" and "disk_full" in (ck.get("error") or "") and "fix:" in ck["error"]


def test_checkpoint_on_a_full_state_dir(small_fs, start_daemon):
    d = start_daemon(state=small_fs / "state", env={"CRABD_INSPECTOR": "proc"})
    c = d.client()
    sid = c.create_sandbox("busybox")["id"]
    good = _settled(c, c.exec(sid, "echo one > /root/f")["checkpoint"])
    assert good["state"] == "committed", good

    # Fill the state file system from inside the sandbox.
    outcomes = []
    try:
        r = c.exec(sid, "dd if=/dev/zero of=/root/big bs=1M count=1000 2>&1; "
                        "i=0; while echo x > /root/m$i 2>/dev/null; do i=$((i+1)); done; echo filled", timeout=300)
        assert "No space left" in r["stdout"], r
        outcomes.append(_settled(c, r["checkpoint"]))
    except CrabdError as e:  # no room even for the turn's checkpoint row
        assert d.proc.poll() is None, f"crabd died (exit {d.proc.poll()}): {d.log.read_text()[-3000:]}"
        assert e.code == "disk_full" and e.fix, (e.code, e)
        outcomes.append({"state": "refused", "error": str(e)})
    print("while full:", [(o["state"], (o.get("error") or "")[:160]) for o in outcomes])
    # A manual checkpoint while it is full.
    try:
        outcomes.append(_settled(c, c.create_checkpoint(sid)["id"]))
    except CrabdError as e:
        assert e.code == "disk_full" and e.fix, (e.code, e)
        outcomes.append({"state": "refused", "error": str(e)})
    print("while full:", [(o["state"], (o.get("error") or "")[:160]) for o in outcomes])
    # Each is committed (a btrfs snapshot needs little room: it holds the
    # big file), failed with disk_full and the fix, or refused with 507.
    for o in outcomes:
        assert o["state"] in ("committed", "refused") or _full_failure(o), o

    # crabd is up, the sandbox runs, the previous checkpoint is intact.
    assert c.health()["ok"]
    assert d.proc.poll() is None, d.log.read_text()[-3000:]
    assert c.sandbox(sid)["status"] == "running"
    assert c.checkpoint(good["id"])["state"] == "committed"

    # Free the space: roll back to before the fill (the sandbox's root with
    # the big file goes) and delete the checkpoints that hold it. Then
    # checkpoints work again.
    c.rollback(sid, good["id"])
    assert c.exec(sid, "cat /root/f")["stdout"].strip() == "one"
    later = [ck for ck in c.checkpoints(sid, all=True)  # the abandoned line after `good`
             if ck["seq"] > good["seq"] and ck["branch"] == good["branch"] and ck["state"] == "committed"]
    for ck in sorted(later, key=lambda k: -k["seq"]):
        c.delete_checkpoint(ck["id"])
    after = None
    end = time.monotonic() + 120
    while time.monotonic() < end:  # btrfs returns freed blocks at its next commit
        try:
            r = c.exec(sid, "echo three > /root/f && cat /root/f", timeout=60)
        except CrabdError as e:
            assert e.code == "disk_full", (e.code, e)
            time.sleep(1)
            continue
        after = _settled(c, r["checkpoint"])
        if after["state"] == "committed":
            break
        time.sleep(1)
    assert after is not None and after["state"] == "committed", after
    # ... and the one before the fill still rolls back to its files.
    c.rollback(sid, good["id"])
    assert c.exec(sid, "cat /root/f")["stdout"].strip() == "one"
    assert c.exec(sid, "ls /root")["stdout"].split() == ["f"]
    assert d.proc.poll() is None
