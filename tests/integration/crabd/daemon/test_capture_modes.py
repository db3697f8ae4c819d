"""Capture modes on a busybox sandbox: the plans auto / fs-only / full give
the same three turns, and what each checkpoint holds (snapshot, process
image, bytes). `full` is crabd's FS_PROC capture at every turn, through the
same de-duplicating image store and counted the same way: a turn that
changed nothing costs a fraction of its raw image, and no tar is written.

One in-process Daemon (real runc, CRIU, snapshots and BPF inspector; the BPF
program compiles once, ~18 s on a loaded host) runs one sandbox per mode: the
mode is read when a turn's checkpoint is opened. `crabd serve --capture` is
checked to reach the settings (a bad value is refused before anything starts).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from crabd.capture import FS_ONLY_REASON, FULL_REASON
from crabd.daemon import Daemon, DaemonOptions
from crabd.testing import cleanup_state_dir

pytestmark = pytest.mark.needs("runc", "criu", "bpf", "busybox")

TURNS = [
    # writes files (an absolute symlink out of the sandbox, a deletion of an image file): FS
    "mkdir -p /root/w && echo hello > /root/w/a.txt && ln -s /etc/passwd /root/w/link && rm /etc/passwd",
    "cat /root/w/a.txt",                   # reads only: SKIP
    "sleep 1000 >/dev/null 2>&1 &",        # leaves a process running: FS_PROC
]
EXPECTED = {
    "auto": ["FS", "SKIP", "FS_PROC"],
    "fs-only": ["FS", "SKIP", "FS"],
    "full": ["FS_PROC", "FS_PROC", "FS_PROC"],
}


async def settled(d: Daemon, cids: list[str], timeout: float = 120) -> list:
    """The checkpoints once committed and sized (hang guard: `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        cks = [d.store.get_checkpoint(cid) for cid in cids]
        sized = {e.data.get("checkpoint") for e in d.store.events_since(0, cks[0].sandbox_id)
                 if e.kind == "checkpoint.sized"}
        if any(k.state == "failed" for k in cks):
            pytest.fail(f"a checkpoint failed: {[(k.id, k.error) for k in cks]}")
        if all(k.state == "committed" and k.id in sized for k in cks):
            return cks
        if time.monotonic() > deadline:
            raise AssertionError(f"hang guard: checkpoints not committed and sized after {timeout} s: {cks}")
        await asyncio.sleep(0.05)


async def one_mode(d: Daemon, mode: str) -> None:
    d.options.capture = mode
    sid = (await asyncio.to_thread(d.create_sandbox, "busybox")).id
    try:
        cids = []
        for cmd in TURNS:
            r = await d.exec(sid, cmd)
            assert r["exit_code"] == 0, (mode, r)
            cids.append(r["checkpoint"])
        got = [d.store.get_checkpoint(c) for c in cids]
        assert [k.plan for k in got] == EXPECTED[mode], (mode, [(k.plan, k.reasons) for k in got])
        cks = await settled(d, cids)
        for k in cks:
            d.store.verify(k)  # the late-filled bytes are signed too
        fs, skip, proc = cks
        if mode == "auto":
            assert fs.bytes > 0 and fs.proc_image is None
            assert skip.bytes == 0 and skip.fs_snapshot == fs.fs_snapshot
            assert proc.proc_image == proc.id and proc.bytes > 0
        elif mode == "fs-only":
            assert all(k.proc_image is None for k in cks)
            assert fs.bytes > 0 and skip.bytes == 0
            assert FS_ONLY_REASON in proc.reasons and FS_ONLY_REASON not in fs.reasons
            assert proc.fs_snapshot == proc.id
        else:
            for k in cks:
                assert FULL_REASON in k.reasons
                assert k.proc_image == k.id and k.fs_snapshot == k.id
                # bytes = the snapshot's bytes over its parent + the image store's new bytes
                assert k.bytes > 0 and "size" in k.durations
            # the `cat` turn changed no file and no process: its dump is
            # mostly chunks the first turn's dump already stored
            raw = d.images.manifest(skip.id).raw_bytes
            assert skip.bytes < raw / 2, (skip.bytes, raw)
            assert not (d.state_dir / "full" / sid).exists()  # no tar copy any more
        # rolling back to the first turn gives its files in every mode
        await d.rollback(sid, cids[0])
        assert (await d.exec(sid, "cat /root/w/a.txt"))["stdout"] == "hello\n"
    finally:
        await d.destroy(sid)
    assert not (d.state_dir / "full" / sid).exists()


def test_capture_modes(runtime, busybox_image):
    from crabd.runtime import Runtime
    state = Path(tempfile.mkdtemp(prefix="crabd-capture-", dir="/var/tmp"))
    try:
        Runtime(state).images.import_path(runtime.images.get(busybox_image).path, "busybox")

        async def main() -> None:
            d = Daemon(state, options=DaemonOptions())
            await d.start()
            try:
                for mode in ("auto", "fs-only", "full"):
                    await one_mode(d, mode)
            finally:
                await d.close()

        asyncio.run(main())
    finally:
        cleanup_state_dir(state)


def test_serve_refuses_an_unknown_capture_mode(tmp_path):
    r = subprocess.run([sys.executable, "-m", "crabd.cli", "serve", "--capture", "everything",
                        "--state-dir", str(tmp_path / "s"), "--socket", str(tmp_path / "s.sock")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "capture" in r.stderr + r.stdout and "fs-only" in r.stderr + r.stdout
    assert not (tmp_path / "s.sock").exists()
