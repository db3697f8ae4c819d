"""Tamper detection on a live daemon: bytes flipped behind crabd's back in a
committed layer (a btrfs snapshot's file, an overlay layer's file), in a
process image (a deltacr chunk, a re-digested manifest) and in a metadata
row (sqlite UPDATE): rollback, fork, diff and automatic recovery to it are
refused with integrity_error naming the checkpoint, with a fix; the sandbox
is left as it was (nothing of the tampered state was restored), and other,
intact checkpoints still work."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from crabd.testing import wait_until

sys.path.insert(0, str(Path(__file__).parent))
from security_daemon import ALICE, As, security_daemon  # noqa: E402

pytestmark = pytest.mark.needs("runc", "criu", "btrfs", "overlay", "busybox")


@pytest.fixture(scope="module")
def btrfs_live(runtime, busybox_image):
    with security_daemon(runtime, config='[snapshot]\ndriver = "btrfs"\n') as (d, base):
        yield d, base


@pytest.fixture(scope="module")
def overlay_live(runtime, busybox_image):
    with security_daemon(runtime, config='[snapshot]\ndriver = "overlay"\n') as (d, base):
        yield d, base


def refused(api: As, method: str, path: str, ck: str, **kw: Any) -> dict[str, Any]:
    r = api(method, path, **kw)
    assert r.status_code == 500, (method, path, r.status_code, r.text)
    err = r.json()["error"]
    assert err["code"] == "integrity_error", err
    assert ck in err["message"] and err["fix"], err
    return err


def cat(api: As, sid: str, path: str) -> str:
    return api.ok("POST", f"/v1/sandboxes/{sid}/exec", json={"cmd": ["cat", path]})["stdout"]


def settled(api: As, cid: str) -> dict[str, Any]:
    """The checkpoint once it is no longer pending (hang guard: 120 s)."""
    def done() -> dict[str, Any] | None:
        c = api.ok("GET", f"/v1/checkpoints/{cid}")
        return c if c["state"] != "pending" else None
    return wait_until(done, f"settled checkpoint {cid}")  # type: ignore[return-value]


def committed(api: As, cid: str) -> dict[str, Any]:
    """The checkpoint once committed and sized. Sizing is idle work after the
    commit that re-signs the row (`bytes` is signed): a row tampered before it
    keeps its wrong digest for good (crabd never launders one), so a test that
    tampers and then restores a row must start from the final row."""
    c = settled(api, cid)
    assert c["state"] == "committed", (c.get("error"), c)

    def sized() -> dict[str, Any] | None:
        now = api.ok("GET", f"/v1/checkpoints/{cid}")
        return now if "size" in now["durations"] or now["seq"] == 0 else None
    return wait_until(sized, f"sized checkpoint {cid}")  # type: ignore[return-value]


def sandbox_with_checkpoint(api: As) -> tuple[str, dict[str, Any]]:
    """A sandbox whose checkpoint ck holds /root/data = "original", then changed to "current"."""
    sid = api.ok("POST", "/v1/sandboxes", json={"image": "busybox"})["id"]
    api.ok("POST", f"/v1/sandboxes/{sid}/exec", json={"cmd": "echo original > /root/data; echo z > /root/z"})
    ck = committed(api, api.ok("POST", f"/v1/sandboxes/{sid}/checkpoints")["id"])
    assert ck["seals"]["fs"], ck
    api.ok("POST", f"/v1/sandboxes/{sid}/exec", json={"cmd": "echo current > /root/data"})
    return sid, ck


def ids(api: As) -> set[str]:
    return {s["id"] for s in api.ok("GET", "/v1/sandboxes")["sandboxes"]}


def flip_byte(path: Path, offset: int = 0, keep_mtime: bool = True) -> None:
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x20]))
    if keep_mtime:  # a careful attacker restores the times too
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def sql(d: Any, query: str, *args: Any) -> None:
    db = sqlite3.connect(d.state / "crabd.db", timeout=30)
    try:
        db.execute(query, args)
        db.commit()
    finally:
        db.close()


def test_metadata_row_tamper_is_refused_everywhere(btrfs_live: Any) -> None:
    d, base = btrfs_live
    api = As(base, ALICE)
    sid, ck = sandbox_with_checkpoint(api)
    cid = ck["id"]
    before = ids(api)
    for column, value in (("turn", ck["turn"] + 7), ("fs_snapshot", f"{sid}-0"), ("plan", "SKIP"),
                          ("seals", None), ("effects", json.dumps({"external": True}))):
        sql(d, f"UPDATE checkpoints SET {column}=? WHERE id=?", value, cid)
        refused(api, "POST", f"/v1/sandboxes/{sid}/rollback", cid, json={"checkpoint": cid})
        refused(api, "POST", f"/v1/checkpoints/{cid}/fork", cid, json={"count": 1})
        refused(api, "GET", f"/v1/checkpoints/{sid}-0/diff/{cid}", cid)
        original = json.dumps(ck[column]) if column in ("seals", "effects") else ck[column]
        sql(d, f"UPDATE checkpoints SET {column}=? WHERE id=?", original, cid)
        api.ok("GET", f"/v1/checkpoints/{sid}-0/diff/{cid}")  # the restored row is accepted again
    # The sandbox was never touched by the refused rollbacks, and no fork was made.
    assert cat(api, sid, "/root/data") == "current\n"
    assert ids(api) == before
    # An intact checkpoint of the same sandbox still works.
    api.ok("POST", f"/v1/sandboxes/{sid}/rollback", json={"checkpoint": f"{sid}-0"})
    api.ok("DELETE", f"/v1/sandboxes/{sid}")


def test_btrfs_layer_tamper_is_refused(btrfs_live: Any) -> None:
    from deltafs.seal import subvol_info
    d, base = btrfs_live
    api = As(base, ALICE)
    assert api.ok("GET", "/v1/health")["fs_driver"] == "btrfs"
    sid, ck = sandbox_with_checkpoint(api)
    cid, seal = ck["id"], ck["seals"]["fs"]
    before = ids(api)
    assert seal["driver"] == "btrfs"
    root = d.state / "fs" / "pool" / "snapshots"
    if not root.is_dir():
        root = d.state / "fs" / "snapshots"
    subvols = [p for p in root.iterdir() if p.name.isdigit() and subvol_info(str(p))["uuid"] == seal["uuid"]]
    assert len(subvols) == 1, (seal, list(root.iterdir()))
    snap = subvols[0]
    assert subvol_info(str(snap))["readonly"]
    subprocess.run(["btrfs", "property", "set", "-ts", str(snap), "ro", "false"], check=True)
    flip_byte(snap / "root" / "data")
    subprocess.run(["btrfs", "property", "set", "-ts", str(snap), "ro", "true"], check=True)
    subprocess.run(["sync"], check=True)
    err = refused(api, "POST", f"/v1/sandboxes/{sid}/rollback", cid, json={"checkpoint": cid})
    assert "files" in err["message"], err
    refused(api, "POST", f"/v1/checkpoints/{cid}/fork", cid, json={"count": 1})
    refused(api, "GET", f"/v1/checkpoints/{sid}-0/diff/{cid}", cid)
    assert cat(api, sid, "/root/data") == "current\n"
    assert ids(api) == before  # no fork was made
    api.ok("POST", f"/v1/sandboxes/{sid}/rollback", json={"checkpoint": f"{sid}-0"})
    api.ok("DELETE", f"/v1/sandboxes/{sid}")


def test_automatic_recovery_refuses_a_tampered_checkpoint(btrfs_live: Any) -> None:
    d, base = btrfs_live
    api = As(base, ALICE)
    sid, ck = sandbox_with_checkpoint(api)
    cid = ck["id"]
    api.ok("POST", f"/v1/sandboxes/{sid}/checkpoints")  # the newest checkpoint: the recovery target
    latest = api.ok("GET", f"/v1/sandboxes/{sid}")["head"]
    sql(d, "UPDATE checkpoints SET turn=turn+1 WHERE id=?", latest)
    since = max([e["seq"] for e in api.ok("GET", "/v1/events", params={"follow": "false"})["events"]] or [0])
    pid = api.ok("GET", f"/v1/sandboxes/{sid}")["pid"]
    os.kill(pid, 9)  # the init dies: the daemon rolls back to the newest checkpoint -- refused
    def recovery_failed() -> list[dict[str, Any]]:
        evs = api.ok("GET", "/v1/events", params={"follow": "false", "since": since, "sandbox": sid})["events"]
        assert not [e for e in evs if e["kind"] == "sandbox.rolled_back"], evs
        return [e for e in evs if e["kind"] == "sandbox.recovery_failed"]
    failed = wait_until(recovery_failed, "sandbox.recovery_failed event", timeout=60, interval=0.2)
    error = failed[0]["data"]["error"]
    assert latest in error and "does not match its digest" in error, failed
    # An explicit rollback to the intact earlier checkpoint brings it back.
    api.ok("POST", f"/v1/sandboxes/{sid}/rollback", json={"checkpoint": cid})
    assert cat(api, sid, "/root/data") == "original\n"
    api.ok("DELETE", f"/v1/sandboxes/{sid}")


def test_overlay_layer_tamper_is_refused(overlay_live: Any) -> None:
    d, base = overlay_live
    api = As(base, ALICE)
    assert api.ok("GET", "/v1/health")["fs_driver"] == "overlay"
    sid, ck = sandbox_with_checkpoint(api)
    cid, seal = ck["id"], ck["seals"]["fs"]
    assert seal["driver"] == "overlay" and seal["stat_only"] == 0, seal
    # The layer that holds /root/data = "original": the exec turn's, below the
    # manual checkpoint's own (empty) layer -- the check covers the whole line.
    layers = [p for p in (d.state / "fs" / "l").iterdir()
              if (p / "root" / "data").is_file() and (p / "root" / "data").read_bytes() == b"original\n"]
    assert len(layers) == 1, layers
    layer = layers[0]
    flip_byte(layer / "root" / "data")  # same size, same mtime: only the content differs
    err = refused(api, "POST", f"/v1/sandboxes/{sid}/rollback", cid, json={"checkpoint": cid})
    assert "files" in err["message"], err
    refused(api, "POST", f"/v1/checkpoints/{cid}/fork", cid, json={"count": 1})
    assert cat(api, sid, "/root/data") == "current\n"
    # A later checkpoint stacks on the tampered layer: refused too (its ancestors are checked).
    later = api.ok("POST", f"/v1/sandboxes/{sid}/checkpoints")["id"]
    refused(api, "POST", f"/v1/sandboxes/{sid}/rollback", later, json={"checkpoint": later})
    flip_byte(layer / "root" / "data")  # flipped back: the very bytes committed
    api.ok("POST", f"/v1/sandboxes/{sid}/rollback", json={"checkpoint": cid})
    assert cat(api, sid, "/root/data") == "original\n"
    api.ok("DELETE", f"/v1/sandboxes/{sid}")


def test_process_image_tamper_is_refused(btrfs_live: Any) -> None:
    from deltacr.store import Manifest
    d, base = btrfs_live
    api = As(base, ALICE)
    sid = api.ok("POST", "/v1/sandboxes", json={"image": "busybox"})["id"]
    # A process started in the turn and alive at its end: the turn is FS_PROC.
    out = api.ok("POST", f"/v1/sandboxes/{sid}/exec",
                 json={"cmd": "echo v1 > /root/data; sleep 3600 </dev/null >/dev/null 2>&1 &"})
    assert out["plan"] == "FS_PROC", out
    ck = committed(api, out["checkpoint"])
    cid = ck["id"]
    assert ck["proc_image"] == cid, f"no process image (CRIU dump refused?): {ck['reasons']}"
    assert ck["seals"]["proc"], ck
    api.ok("POST", f"/v1/sandboxes/{sid}/exec", json={"cmd": "echo v2 > /root/data"})
    before = ids(api)

    # 1. A manifest rewritten with a valid (unkeyed) digest: the keyed seal catches it.
    mpath = d.state / "cr" / "manifests" / f"{cid}.json"
    original = mpath.read_bytes()
    doc = json.loads(original)
    doc["meta"] = {**doc.get("meta", {}), "evil": True}
    doc["digest"] = Manifest.digest_of({k: doc[k] for k in ("version", "checkpoint_id", "created", "meta", "files")})
    mpath.write_text(json.dumps(doc))
    err = refused(api, "POST", f"/v1/sandboxes/{sid}/rollback", cid, json={"checkpoint": cid})
    assert "process image" in err["message"], err
    refused(api, "POST", f"/v1/checkpoints/{cid}/fork", cid, json={"count": 1})
    mpath.write_bytes(original)

    # 2. A byte flipped in the largest chunk (memory pages) of the image.
    files = json.loads(original)["files"]
    key = max((c for f in files for c in f["chunks"]), key=lambda c: c[1])[0]
    chunk = d.state / "cr" / "chunks" / key[:2] / key
    flip_byte(chunk, chunk.stat().st_size // 2)
    err = refused(api, "POST", f"/v1/sandboxes/{sid}/rollback", cid, json={"checkpoint": cid})
    assert "process image" in err["message"], err
    refused(api, "POST", f"/v1/checkpoints/{cid}/fork", cid, json={"count": 1})
    # Nothing was restored: the sandbox runs on, as it was.
    assert cat(api, sid, "/root/data") == "v2\n"
    assert ids(api) == before  # no fork was made
    api.ok("DELETE", f"/v1/sandboxes/{sid}")


def test_no_false_alarm_after_overlay_compaction(runtime: Any, busybox_image: Any) -> None:
    # Layers merged by compaction (depth 2 here: every prepare compacts) are
    # not what the seals name: the check must call them unverifiable, never
    # tampered -- rollbacks and forks of intact checkpoints keep working.
    with security_daemon(runtime, config='[snapshot]\ndriver = "overlay"\n',
                         env={"CRABD_OVERLAY_MAX_DEPTH": "2"}) as (d, base):
        api = As(base, ALICE)
        sid = api.ok("POST", "/v1/sandboxes", json={"image": "busybox"})["id"]
        cks = []
        for i in range(5):
            cks.append(api.ok("POST", f"/v1/sandboxes/{sid}/exec", json={"cmd": f"echo {i} > /root/n{i}"})["checkpoint"])
        last = committed(api, cks[-1])["id"]
        for _ in range(2):
            api.ok("POST", f"/v1/sandboxes/{sid}/rollback", json={"checkpoint": last})
        assert cat(api, sid, "/root/n4") == "4\n"
        api.ok("POST", f"/v1/sandboxes/{sid}/rollback", json={"checkpoint": cks[2]})
        assert api.ok("POST", f"/v1/sandboxes/{sid}/exec", json={"cmd": "ls /root"})["stdout"].split() == \
            ["n0", "n1", "n2"]
        forked = api.ok("POST", f"/v1/checkpoints/{last}/fork", json={"count": 1})["sandboxes"]
        assert cat(api, forked[0], "/root/n4") == "4\n"
        api.ok("GET", f"/v1/checkpoints/{cks[0]}/diff/{last}")
        assert any((d.state / "fs" / "m").iterdir()), "no layer was merged: the test did not test compaction"


def test_a_new_turn_never_inherits_a_tampered_parent(btrfs_live: Any) -> None:
    # A checkpoint shares or inherits its parent's snapshot, process image and
    # seals, and its commit signs them again: a tampered parent fails it.
    d, base = btrfs_live
    api = As(base, ALICE)
    sid, _ = sandbox_with_checkpoint(api)
    head = api.ok("GET", f"/v1/sandboxes/{sid}")["head"]
    turn = committed(api, head)["turn"]
    sql(d, "UPDATE checkpoints SET turn=? WHERE id=?", turn + 5, head)
    cid = api.ok("POST", f"/v1/sandboxes/{sid}/exec", json={"cmd": ["true"]})["checkpoint"]
    c = settled(api, cid)
    assert c["state"] == "failed" and head in c["error"] and "digest" in c["error"], c
    sql(d, "UPDATE checkpoints SET turn=? WHERE id=?", turn, head)
    nxt = api.ok("POST", f"/v1/sandboxes/{sid}/exec", json={"cmd": ["true"]})["checkpoint"]
    assert committed(api, nxt)["state"] == "committed"
    api.ok("DELETE", f"/v1/sandboxes/{sid}")
