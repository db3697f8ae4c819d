#!/usr/bin/env python3
"""deltacr benchmark: process dump, cold restore, hot-standby promotion, image bytes.

    python -m bench.cr [--quick] [--json] [--state-dir DIR]

(wired to `crabd bench cr`). Needs root, runc and CRIU. Two sandboxes:

* small: busybox image, a shell counting in a loop plus an idle HTTP server
  (busybox httpd on 127.0.0.1:8080);
* heap200: Debian image, a Python process holding 200 MiB of random bytes
  and flipping one byte of it every 50 ms.

For each: 10 checkpoints (5 with --quick) 0.3 s apart, each a small change
since the last (the processes keep running), into a fresh image store:
dump_ms = p50 of the sandbox's pause (freeze -> runc checkpoint -> thaw);
store_ms = p50 of compress + de-duplicate after the thaw; raw_bytes = p50
size of one CRIU image; stored_bytes = the store's chunk bytes after all
checkpoints. Then restore_ms = p50 of a cold rollback to the last
checkpoint (verify + reassemble the image, stop, runc restore, loopback up)
over 5 (3) runs, and promote_ms = p50 of promoting a hot standby (prepared
from the same checkpoint on a root of its own) over 5 (3) runs: until the
checkpoint's processes run again (promote_swap_ms: and sit in the
sandbox's cgroups). small_fs (extra): the small sandbox on a deltafs root,
pause of freeze -> deltafs checkpoint -> dump -> thaw.

Images come from the test state dir (default $CRABD_TEST_STATE_DIR or
/var/lib/crabd-test): busybox is made from /bin/busybox if missing; the
Debian image must exist (run the integration tests once, or
`crabd image build-debian debian-py`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench._stats import percentile as pct  # (bench/_stats.py: nearest rank, p in 0..100)
from crabd.runtime import Runtime
from crabd.runtime.process import (
    CheckpointableRunner,
    _scratch,
    checkpoint_processes,
    discard_standby,
    list_standbys,
    prepare_standby,
    promote_standby,
    restore_processes,
)
from crabd.testing import ensure_busybox_image
from deltacr import ImageStore
from deltafs import Mount

HEAP = r'''
import os, time
heap = bytearray(os.urandom(200 << 20))
i = 0
while True:
    heap[(i * 4096 * 997) % len(heap)] ^= 0xFF
    i += 1
    time.sleep(0.05)
'''


def start_small(rt: Runtime, sid: str) -> None:
    r = rt.exec(sid, ["/bin/sh", "-c",
                      "(i=0; while :; do i=$((i+1)); sleep 0.2; done) </dev/null >/dev/null 2>&1 & "
                      "mkdir -p /www && echo hi > /www/index.html && "
                      "httpd -h /www -p 127.0.0.1:8080 </dev/null >/dev/null 2>&1"])
    assert r.exit_code == 0, r.stderr


def start_heap(rt: Runtime, sid: str) -> None:
    rt.exec(sid, ["/bin/sh", "-c", "cat > /heap.py"], stdin=HEAP)
    r = rt.exec(sid, ["/bin/sh", "-c", "python3 /heap.py </dev/null >/dev/null 2>&1 &"])
    assert r.exit_code == 0, r.stderr
    # Wait until the heap is filled (RSS >= 200 MiB).
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        r = rt.exec(sid, ["/bin/sh", "-c", "for p in /proc/[0-9]*; do grep -s VmRSS $p/status; done"])
        if any(int(ln.split()[1]) > 200 * 1024 for ln in r.stdout.splitlines() if ln.strip()):
            return
        time.sleep(0.2)
    raise RuntimeError("the 200 MiB heap process did not fill its heap within 60 s")


def fork_root(rt: Runtime, sid: str, image: str, base: Path) -> list[Mount]:
    """A copy-on-write fork of the sandbox's current root (what deltafs gives
    crabd): the image below, a copy of the sandbox's upper layer on top."""
    d = Path(tempfile.mkdtemp(prefix="standby-root-", dir=base))
    (d / "upper").mkdir()
    (d / "work").mkdir()
    opts = dict(o.split("=", 1) for o in rt.get(sid).root[0].options if "=" in o)
    subprocess.run(["cp", "-a", f"{opts['upperdir']}/.", str(d / "upper")], check=True, timeout=120)
    return [Mount("overlay", "overlay", (f"lowerdir={rt.images.get(image).path}", f"upperdir={d / 'upper'}",
                                         f"workdir={d / 'work'}", "index=off"))]


def scenario(rt: Runtime, name: str, image: str, start, n_ck: int, n_rs: int, base: Path) -> dict:  # type: ignore[no-untyped-def]
    sb = rt.create(image)
    store = ImageStore(base / f"store-{name}")
    out: dict = {}
    try:
        start(rt, sb.id)
        time.sleep(0.3)
        infos = []
        for i in range(n_ck):
            infos.append(checkpoint_processes(rt, sb.id, store, f"{name}-{i}"))
            time.sleep(0.3)
        last = infos[-1].checkpoint_id
        stats = store.stats()
        restores = []
        for _ in range(n_rs):
            t = time.monotonic()
            restore_processes(rt, sb.id, store, last)
            restores.append((time.monotonic() - t) * 1e3)
        t = time.monotonic()
        stage = _scratch(store, "bench-", store.manifest(last).raw_bytes)  # where restores stage it
        store.get(last, stage)
        stage_ms = (time.monotonic() - t) * 1e3
        shutil.rmtree(stage)
        promotes, swaps, prepares = [], [], []
        for _ in range(n_rs):
            st = prepare_standby(rt, sb.id, store, last, root=fork_root(rt, sb.id, image, base))
            prepares.append(st.prepare_ms)
            promote_standby(rt, st)
            promotes.append(st.promote_ms or 0.0)
            swaps.append(st.swap_ms or 0.0)
        after = rt.exec(sb.id, ["/bin/true"])
        assert after.exit_code == 0, "sandbox not usable after promotion"
        out = {
            "dump_ms": round(pct([x.pause_ms for x in infos], 50), 1),
            "restore_ms": round(pct(restores, 50), 1),
            "promote_ms": round(pct(promotes, 50), 2),
            "promote_swap_ms": round(pct(swaps, 50), 2),
            "raw_bytes": int(pct([x.raw_bytes for x in infos], 50)),
            "stored_bytes": stats.stored_bytes,
            # context
            "checkpoints": n_ck,
            "raw_bytes_total": sum(x.raw_bytes for x in infos),
            "runc_checkpoint_ms": round(pct([x.dump_ms for x in infos], 50), 1),
            "store_ms": round(pct([x.store_ms for x in infos], 50), 1),
            "restore_stage_ms": round(stage_ms, 1),
            "standby_prepare_ms": round(pct(prepares, 50), 1),
            "dump_ms_all": [round(x.pause_ms, 1) for x in infos],
            "restore_ms_all": [round(x, 1) for x in restores],
            "promote_ms_all": [round(x, 2) for x in promotes],
            "promote_swap_ms_all": [round(x, 2) for x in swaps],
        }
    finally:
        for st in list_standbys(rt, sb.id):
            discard_standby(rt, st)
        rt.destroy(sb.id)
    return out


def scenario_fs(rt: Runtime, image: str, n_ck: int, base: Path) -> dict:  # type: ignore[no-untyped-def]
    """The small sandbox on a deltafs root: the pause of a consistent
    capture (freeze -> deltafs checkpoint -> CRIU dump -> thaw)."""
    import deltafs
    snaps = deltafs.open(str(base / "fs"))
    src = Path(rt.images.get(image).path)
    mnt = base / "fs-import"
    mnt.mkdir()
    deltafs.mount_all(snaps.prepare("import"), str(mnt))
    try:
        subprocess.run(["cp", "-a", f"{src}/.", str(mnt)], check=True, timeout=120)
    finally:
        deltafs.unmount(str(mnt))
    snaps.commit("base", "import")
    sb = rt.create(image, root=snaps.prepare("sb", parent="base"))
    store = ImageStore(base / "store-small-fs")
    try:
        start_small(rt, sb.id)
        infos = []
        for i in range(n_ck):
            rt.exec(sb.id, ["/bin/sh", "-c", f"echo {i} > /www/turn-{i}.txt"])
            snaps.prepare_checkpoint("sb")
            infos.append(checkpoint_processes(rt, sb.id, store, f"fs-{i}", fs_commit=lambda: snaps.checkpoint("sb")))
            time.sleep(0.3)
        return {"driver": snaps.driver,
                "pause_ms": round(pct([x.pause_ms for x in infos], 50), 1),
                "fs_commit_ms": round(pct([x.fs_ms for x in infos], 50), 2),
                "dump_ms": round(pct([x.dump_ms for x in infos], 50), 1)}
    finally:
        rt.destroy(sb.id)
        # btrfs: the loop-backed pool lives in `base`; unmount it before `base` goes.
        getattr(snaps, "unmount_pool", snaps.close)()


def parser() -> argparse.ArgumentParser:
    """The benchmark's options (also `crabd bench NAME --help`)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="5 checkpoints, 3 restores/promotions")
    ap.add_argument("--json", action="store_true", help="print JSON only")
    ap.add_argument("--state-dir", default=os.environ.get("CRABD_TEST_STATE_DIR", "/var/lib/crabd-test"))
    ap.add_argument("--only", choices=["small", "heap200", "small_fs"], help="run one scenario")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    if os.geteuid() != 0:
        print("bench/cr.py needs root (runc, CRIU, mounts)", file=sys.stderr)
        return 2
    n_ck, n_rs = (5, 3) if a.quick else (10, 5)
    rt = Runtime(a.state_dir, runner=CheckpointableRunner())
    base = Path(tempfile.mkdtemp(prefix="bench-cr-", dir=a.state_dir))
    res: dict = {}
    try:
        if a.only in (None, "small"):
            res["small"] = scenario(rt, "small", ensure_busybox_image(rt), start_small, n_ck, n_rs, base)
        if a.only in (None, "small_fs"):
            res["small_fs"] = scenario_fs(rt, ensure_busybox_image(rt), n_ck, base)
        if a.only in (None, "heap200"):
            if not rt.images.exists("debian-py"):
                print("heap200 needs the debian-py image: run the integration tests once "
                      "(tests/integration builds it) or build it with crabd", file=sys.stderr)
                return 2
            res["heap200"] = scenario(rt, "heap200", "debian-py", start_heap, n_ck, n_rs, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    res["host"] = {"kernel": platform.release(), "cpus": os.cpu_count(), "quick": a.quick}
    if a.json:
        print(json.dumps(res, indent=2))
        return 0
    print(f"deltacr benchmark ({'quick' if a.quick else 'full'}; kernel {platform.release()}, {os.cpu_count()} cpus)")
    print(f"{'':9} {'dump p50':>9} {'restore p50':>12} {'promote p50':>12} {'raw/image':>11} {'stored':>11} {'ratio':>6}")
    for k in ("small", "heap200"):
        if k in res:
            r = res[k]
            print(f"{k:9} {r['dump_ms']:>7.1f}ms {r['restore_ms']:>10.1f}ms {r['promote_ms']:>10.2f}ms "
                  f"{r['raw_bytes'] / 2**20:>9.1f}Mi {r['stored_bytes'] / 2**20:>9.1f}Mi "
                  f"{r['stored_bytes'] / max(1, r['raw_bytes']):>5.2f}x")
    print("ratio = stored bytes after all checkpoints / one raw image (target <= 1.5x)")
    if "small_fs" in res:
        r = res["small_fs"]
        print(f"consistent capture, small on deltafs ({r['driver']}): pause p50 {r['pause_ms']} ms "
              f"(fs commit {r['fs_commit_ms']} ms + dump {r['dump_ms']} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
