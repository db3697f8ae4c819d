"""`crabd serve --capture auto|fs-only|full` on a busybox sandbox: the plans
each mode gives the same three turns, and what each checkpoint holds."""

from __future__ import annotations

import tarfile
import time

import pytest

from crabd.capture import FS_ONLY_REASON, FULL_REASON

TURNS = [
    # writes files (and an absolute symlink out of the sandbox): FS
    "mkdir -p /root/w && echo hello > /root/w/a.txt && ln -s /etc/passwd /root/w/link && rm /etc/passwd",
    "cat /root/w/a.txt",                   # reads only: SKIP
    "sleep 1000 >/dev/null 2>&1 &",        # leaves a process running: FS_PROC
]
EXPECTED = {
    "auto": ["FS", "SKIP", "FS_PROC"],
    "fs-only": ["FS", "SKIP", "FS"],
    "full": ["FS_PROC", "FS_PROC", "FS_PROC"],
}


def settled(c, sid: str, cids: list[str], timeout: float = 120) -> list[dict]:
    """The checkpoints once committed and sized (hang guard: `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        cks = [c.checkpoint(cid) for cid in cids]
        sized = {e["data"].get("checkpoint") for e in c.events(sandbox=sid) if e["kind"] == "checkpoint.sized"}
        if all(k["state"] == "committed" and (k["plan"] == "SKIP" or k["id"] in sized) for k in cks):
            return cks
        if any(k["state"] == "failed" for k in cks):
            pytest.fail(f"a checkpoint failed: {[(k['id'], k['error']) for k in cks]}")
        assert time.monotonic() < deadline, f"checkpoints not settled in {timeout} s: {cks}"
        time.sleep(0.05)


@pytest.mark.parametrize("mode", ["auto", "fs-only", "full"])
def test_capture_mode(start_daemon, mode):
    d = start_daemon(args=["--capture", mode])
    c = d.client()
    sid = c.create_sandbox("busybox")["id"]
    cids = []
    for cmd in TURNS:
        r = c.exec(sid, cmd)
        assert r["exit_code"] == 0, r
        cids.append(r["checkpoint"])
    assert [c.checkpoint(cid)["plan"] for cid in cids] == EXPECTED[mode]
    cks = settled(c, sid, cids)
    fs, skip, proc = cks
    if mode == "auto":
        assert fs["bytes"] > 0 and fs["proc_image"] is None
        assert skip["bytes"] == 0 and skip["fs_snapshot"] == fs["fs_snapshot"]
        assert proc["proc_image"] == proc["id"] and proc["bytes"] > 0
    elif mode == "fs-only":
        assert all(k["proc_image"] is None for k in cks)
        assert fs["bytes"] > 0 and skip["bytes"] == 0
        assert FS_ONLY_REASON in proc["reasons"] and FS_ONLY_REASON not in fs["reasons"]
        assert proc["fs_snapshot"] == proc["id"]
    else:
        for k in cks:
            assert FULL_REASON in k["reasons"]
            assert k["proc_image"] == k["id"] and k["fs_snapshot"] == k["id"]
            tar = d.state / "full" / sid / f"{k['id']}.tar"
            # bytes = the tar's bytes + the CRIU image's raw bytes
            assert k["bytes"] > tar.stat().st_size > 0
            with tarfile.open(tar) as t:
                names = set(t.getnames())
                assert {"root/w/a.txt", "root/w/link", ".crabd-deleted"} <= names
                assert t.getmember("root/w/link").issym()
                assert t.getmember("root/w/link").linkname == "/etc/passwd"
                assert t.extractfile(".crabd-deleted").read() == b"etc/passwd\n"
                assert "bin/busybox" not in names  # unchanged from the image
    # rolling back to the FS turn gives its files in every mode
    c.rollback(sid, cids[0])
    assert c.exec(sid, "cat /root/w/a.txt")["stdout"] == "hello\n"
    c.delete_sandbox(sid)
    assert not (d.state / "full" / sid).exists()
