"""What tamper detection costs: the time to seal a checkpoint at commit and to
verify one before a rollback or fork, per snapshot driver, for a line of N
checkpoints (overlay verifies every ancestor's layer), with and without a
process image.

    crabd bench seals [--quick] [--json] [--turns N] [--mib M]

Runs an in-process daemon (the /proc inspector) on a temporary state dir
with the cached busybox test image (/var/lib/crabd-test; run the
integration tests or `crabd image import` once first). Root.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._stats import median


def _ms(xs: list[float]) -> dict[str, float]:
    return {"median_ms": round(median(xs) * 1000, 3), "max_ms": round(max(xs) * 1000, 3)}


async def one_driver(driver: str, turns: int, mib: int, reps: int) -> dict[str, Any]:
    from crabd.daemon import Daemon, DaemonOptions
    from crabd.runtime import Runtime
    from crabd.testing import cleanup_state_dir
    src = Runtime(Path("/var/lib/crabd-test")).images.get("busybox").path
    st = Path(tempfile.mkdtemp(prefix="crabd-bench-seals-", dir="/var/tmp"))
    d = None
    try:
        Runtime(st).images.import_path(src, "busybox")
        d = Daemon(st, options=DaemonOptions(snapshot_driver=driver, use_bpf=False, auto_rollback=False))
        await d.start()
        sid = (await asyncio.to_thread(d.create_sandbox, "busybox")).id
        for i in range(turns):
            out = await d.exec(sid, f"head -c {mib << 20} /dev/urandom > /root/f{i}")
            await d._wait_capture(d.turns[sid])
        ck = d.store.get_checkpoint(out["checkpoint"])
        assert ck.state == "committed" and ck.plan != "SKIP", (ck.state, ck.plan)
        seal, verify = [], []
        for _ in range(reps):
            t = time.monotonic()
            await asyncio.to_thread(d._seal_row, ck)
            seal.append(time.monotonic() - t)
            t = time.monotonic()
            await asyncio.to_thread(d._verify_checkpoint, ck)
            verify.append(time.monotonic() - t)
        # A process image: a process started in the turn and alive at its end (FS_PROC).
        out = await d.exec(sid, "sleep 3600 </dev/null >/dev/null 2>&1 &")
        await d._wait_capture(d.turns[sid])
        pk = d.store.get_checkpoint(out["checkpoint"])
        proc: dict[str, Any] = {"plan": pk.plan, "proc_image": bool(pk.proc_image)}
        if pk.proc_image:
            times = []
            for _ in range(reps):
                t = time.monotonic()
                await asyncio.to_thread(d._verify_checkpoint, pk)
                times.append(time.monotonic() - t)
            proc.update(image_bytes=sum(f.size for f in d.images.manifest(pk.proc_image).files), verify=_ms(times))
        await d.destroy(sid)
        return {"driver": d.fs.driver, "line": turns + 1, "mib_per_turn": mib, "seal_latest": _ms(seal),
                "verify_latest_fs_and_line": _ms(verify), "with_process_image": proc}
    finally:
        if d is not None:
            await d.close()
        cleanup_state_dir(st)


def parser() -> argparse.ArgumentParser:
    """The benchmark's options (also `crabd bench NAME --help`)."""
    ap = argparse.ArgumentParser(prog="crabd bench seals", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="5 turns, 3 repetitions")
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--mib", type=int, default=1, help="MiB written per turn")
    ap.add_argument("--json", action="store_true")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    turns, reps = (5, 3) if a.quick else (a.turns, 10)
    out = {"bench": "seals", "results": [asyncio.run(one_driver(drv, turns, a.mib, reps))
                                         for drv in ("btrfs", "overlay")]}
    if a.json:
        print(json.dumps(out, indent=2))
    else:
        for r in out["results"]:
            p = r["with_process_image"]
            print(f"{r['driver']:8} line {r['line']:3}  seal {r['seal_latest']['median_ms']:8.2f} ms  "
                  f"verify {r['verify_latest_fs_and_line']['median_ms']:8.2f} ms  "
                  f"+image {p.get('verify', {}).get('median_ms', 'n/a')} ms ({p.get('image_bytes', 0)} B)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
