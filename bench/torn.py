"""Torn process pages: can a checkpoint's process image hold a page no run
of the process could have had? (issue 14, the oracle's s5 turn 9 difference)

A sandbox runs workers that keep rewriting one private anonymous page in a
fixed order, with no system call in the loop: iteration n writes n at
offset 8 (the step), then n at offsets 16..48 (the "hash"), then n into a
ring slot at 80 + 8 * (n % 16). In any instant of such a process,

    hash <= step <= hash + 1, every hash word >= the next one, max(ring) <= step

A copy of the page made while the worker ran (a forward copy racing the
forward writes) breaks these: the oracle's difference was step 0 with the
hash of step 1. Workers are `tight` (write all the time: any copy taken while
they run tears with a good chance) or `burst` (a burst of writes, then a
sleep of 1-20 ms: what a fork keeps until the next burst).

The stress: back-to-back manual checkpoints of the sandbox (crabd started
with `--capture full`: every one is FS_PROC, freeze -> FS commit -> CRIU dump
-> thaw) and, with `--beside`, forks of earlier checkpoints made at the same
time (CRIU restores from the same image store). Every checkpoint's image is
read back from the store (`ImageStore.get`, the restore's own path) and the
state page of every process in it is checked; every fork's live pages are
read with the fork frozen (burst workers only: a tight one rewrites its page
before the freeze) and checked too.

    nice -n 10 python -m bench.torn --checkpoints 60 --beside [--json]

Exit status 1 when any page breaks the invariant."""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.oracle import freezer_dir, set_frozen
from crabd.testing import DaemonHandle, cleanup_state_dir, settled_checkpoint, wait_until

IMAGE = "debian-py"
ADDR = 0x6F7261000000   # crabd.oracle.STATE_PAGE_ADDR: the oracle's truth reads this page
MAGIC = b"CRABORCL"     # crabd.oracle.STATE_PAGE_MAGIC
RING = 16
PAGE = 4096

# The oracle's page layout (crabd.oracle.parse_state_page): magic, step @8,
# hash @16..48, name @48, spin @64, ring of (step, hash) @80 + 24 i, times.
# Iteration n writes, in this order: step, the four hash words, spin, the
# ring slot n % 16 (step, then its hash words), the slot's time.
WORKER = r"""
import ctypes, random, sys, time
ADDR, RING = 0x6F7261000000, 16
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
if libc.mmap(ADDR, 4096, 3, 0x22 | 0x100000, -1, 0) != ADDR:
    sys.exit("mmap")
ctypes.memmove(ADDR, b"CRABORCL", 8)
kind = sys.argv[1]
ctypes.memmove(ADDR + 48, kind.encode()[:16], len(kind[:16]))
w = (ctypes.c_uint64 * 512).from_address(ADDR)
T = (80 + 24 * RING) // 8
n = 0
while True:
    for _ in range(200 if kind == "burst" else 100000):
        n += 1
        w[1] = n
        w[2] = n; w[3] = n; w[4] = n; w[5] = n
        w[8] = n
        i = n % RING
        w[10 + 3 * i] = n; w[11 + 3 * i] = n; w[12 + 3 * i] = n
        w[T + i] = n
    if kind == "burst":
        time.sleep(random.uniform(0.001, 0.02))
"""


def check_page(b: bytes) -> str | None:
    """None when the page is one a worker could have had at some instant;
    else what is wrong. Pure."""
    if len(b) < PAGE or b[:8] != MAGIC:
        return "not a state page"
    w = struct.unpack_from("<512Q", b)
    step, hs, spin = w[1], w[2:6], w[8]
    ring = [w[10 + 3 * i] for i in range(RING)]
    if any(hs[i] < hs[i + 1] for i in range(3)):
        return f"hash words out of order {hs}"
    if not hs[-1] <= hs[0] <= step <= hs[-1] + 1:
        return f"step {step} vs hash {hs}"
    if spin > hs[-1] or spin + 1 < hs[0]:
        return f"spin {spin} vs hash {hs}"
    if max(ring) > step:
        return f"ring {max(ring)} ahead of step {step}"
    return None


def page_words(b: bytes) -> dict[str, int]:
    w = struct.unpack_from("<9Q", b)
    return {"step": w[1], "hash0": w[2], "spin": w[8]}


def image_pages(image_dir: Path) -> dict[str, bytes]:
    """{pid (in the sandbox): the page at ADDR} of every process in a CRIU image dir."""
    from deltacr.store import parse_pagemap
    out: dict[str, bytes] = {}
    for pm in sorted(image_dir.glob("pagemap-*.img")):
        pid, runs = parse_pagemap(pm.read_bytes())
        off = 0
        for va, nr in runs:
            if va <= ADDR < va + nr * PAGE:
                with open(image_dir / f"pages-{pid}.img", "rb") as f:
                    f.seek(off + (ADDR - va))
                    out[pm.name[len("pagemap-"):-len(".img")]] = f.read(PAGE)
                break
            off += nr * PAGE
    return out


def live_pages(pid: int) -> dict[str, bytes]:
    """{pid (in the sandbox): the page at ADDR} of every process of the frozen cgroup of `pid`."""
    procs = freezer_dir(pid) / "cgroup.procs"
    out: dict[str, bytes] = {}
    for p in procs.read_text().split():
        try:
            with open(f"/proc/{p}/maps") as f:
                if not any(line.startswith(f"{ADDR:x}-") for line in f):
                    continue
            with open(f"/proc/{p}/status") as f:
                ns = next(line.split()[-1] for line in f if line.startswith("NSpid:"))
            with open(f"/proc/{p}/mem", "rb", buffering=0) as m:
                m.seek(ADDR)
                out[ns] = m.read(PAGE)
        except OSError:
            pass
    return out


class Run:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.state = Path(tempfile.mkdtemp(prefix="crabd-bench-torn-", dir="/var/tmp"))
        self.records = self.state / "oracle"
        # --oracle: the truth of every checkpoint read inside crabd's own freeze, right before its
        # snapshot and CRIU dump (crabd.oracle.record_at_capture): the image must hold that page
        self.dh = DaemonHandle(self.state, args=["--capture", "full", "--oracle", str(self.records)])
        self.images: dict[str, dict[str, bytes]] = {}
        import random
        self.rng = random.Random(a.seed)
        self.lock = threading.Lock()
        self.res: dict[str, Any] = {"checkpoints": 0, "image_pages": 0, "forks": 0, "fork_pages": 0,
                                    "fork_failures": 0, "truth_compared": 0, "torn": [], "errors": []}

    def torn(self, where: str, what: str, page: bytes) -> None:
        w = struct.unpack_from("<10Q", page)
        with self.lock:
            self.res["torn"].append({"where": where, "what": what, "words": list(w)})
        print(f"TORN {where}: {what}", file=sys.stderr, flush=True)

    def start(self) -> str:
        from bench import inputs
        from crabd.runtime import Runtime
        rt = Runtime(self.state)
        if not rt.images.exists(IMAGE):
            rt.images.import_path(str(inputs.image_rootfs(IMAGE)), IMAGE)
        self.dh.start()
        c = self.dh.client()
        sid = c.create_sandbox(IMAGE)["id"]
        c.exec(sid, ["/bin/sh", "-c", "mkdir -p /opt/torn && cat > /opt/torn/w.py"], stdin=WORKER)
        spawn = " ".join(f"(setsid python3 /opt/torn/w.py {k} </dev/null >/dev/null 2>&1 &);"
                         for k in ["tight"] * self.a.tight + ["burst"] * self.a.burst)
        c.exec(sid, ["/bin/sh", "-c", spawn + " sleep 0.5"])
        if self.a.turns:
            from bench.oracle import AGENT, AGENT_IN
            c.exec(sid, ["/bin/sh", "-c", f"mkdir -p /opt/oracle && cat > {AGENT_IN}"], stdin=AGENT.read_text())
        return sid

    def turn(self, sid: str, i: int, seen: set[str]) -> list[dict[str, Any]]:
        """One turn that spawns an oracle spin worker (its steps land around
        the turn's end, as in s5 turn 9) and stops the one of 4 turns ago;
        the checkpoints it made."""
        import random
        from bench.oracle import AGENT_IN
        from crabd.testing import settled_checkpoints
        c = self.dh.client()
        cmd = ["python3", AGENT_IN, "spawn", f"w{i}", "spin", str(self.rng.randint(0, 400)), "69", "4", "-"]
        if i >= 4:
            cmd += ["--", "kill", f"w{i - 4}"]
        c.exec(sid, cmd)
        time.sleep(random.uniform(0, 0.1))
        new = [ck for ck in settled_checkpoints(c, sid, 300) if ck["id"] not in seen]
        seen.update(ck["id"] for ck in new)
        return new

    def check_image(self, cid: str) -> None:
        store = self.dh_store()
        with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="torn-img-") as d:
            store.get(cid, d)
            pages = image_pages(Path(d))
        if len([b for b in pages.values() if b[48:53] in (b"tight", b"burst")]) != self.a.tight + self.a.burst:
            with self.lock:
                self.res["errors"].append(f"{cid}: {len(pages)} state pages in the image")
        from crabd.oracle import load_record, parse_state_page
        truth = load_record(self.records / f"{cid}.json.zst")["processes"]
        with self.lock:
            self.images[cid] = pages
        for ns, b in pages.items():
            mine = b[48:53] in (b"tight", b"burst")
            why = check_page(b) if mine else None
            t = (truth.get(ns) or {}).get("page")
            if why is None and t is None:
                why = "no truth page for this process"
            elif why is None and parse_state_page(b) != t:
                r = parse_state_page(b) or {}
                why = (f"not the page read in the same freeze: image step {r.get('step')} spin {r.get('spin')}, "
                       f"truth step {t['step']} spin {t['spin']}")
            with self.lock:
                self.res["image_pages"] += 1
                self.res["truth_compared"] += t is not None
            if why:
                self.torn(f"image {cid} pid {ns} ({b[48:56].rstrip(bytes(1)).decode()})", why, b)

    def dh_store(self) -> Any:
        from deltacr import ImageStore
        return ImageStore(self.state / "cr")

    def fork_and_check(self, cid: str) -> None:
        c = self.dh.client()
        try:
            fid = c.fork(cid)["sandboxes"][0]
        except Exception as e:
            with self.lock:
                self.res["fork_failures"] += 1
                self.res["errors"].append(f"fork {cid}: {e}")
            return
        try:
            info = wait_until(lambda: (lambda i: i if i.get("status") == "running" and i.get("pid") else None)(
                c.sandbox(fid)), "fork running", timeout=60, interval=0.005)
            fz = freezer_dir(info["pid"])  # type: ignore[index]
            set_frozen(fz, True)
            try:
                pages = live_pages(info["pid"])  # type: ignore[index]
            finally:
                set_frozen(fz, False)
            burst = {p: b for p, b in pages.items() if b[48:53] == b"burst"}
            if len(burst) != self.a.burst:
                with self.lock:
                    self.res["errors"].append(f"fork {fid} of {cid}: {len(burst)} burst pages (restore failed?)")
            for p, b in pages.items():
                if b[48:53] != b"burst":
                    continue
                why = check_page(b)
                img = self.images.get(cid, {}).get(p)
                if why is None and img is not None:
                    fw, iw = page_words(b), page_words(img)
                    if fw["step"] < iw["step"]:
                        why = f"fork went back: step {fw['step']} < image's {iw['step']}"
                    elif fw["step"] == iw["step"] and b[:80 + 32 * RING] != img[:80 + 32 * RING]:
                        why = f"fork's page at the image's step {iw['step']} differs from the image's"
                with self.lock:
                    self.res["fork_pages"] += 1
                if why:
                    self.torn(f"fork {fid} of {cid} pid {p}", why, b)
            with self.lock:
                self.res["forks"] += 1
        finally:
            try:
                c.delete_sandbox(fid)
            except Exception:
                pass

    def run(self) -> dict[str, Any]:
        t0 = time.monotonic()
        sid = self.start()
        c = self.dh.client()
        done: list[str] = []
        stop = threading.Event()

        def beside() -> None:
            i = 0
            while not stop.is_set():
                if not done:
                    time.sleep(0.05)
                    continue
                self.fork_and_check(done[-1 - (i % min(len(done), 3))])
                i += 1

        th = threading.Thread(target=beside, daemon=True) if self.a.beside else None
        if th:
            th.start()
        from crabd.testing import settled_checkpoints
        seen = {ck["id"] for ck in settled_checkpoints(c, sid, 300)}
        try:
            for i in range(self.a.checkpoints):
                if self.a.turns:
                    cks = self.turn(sid, i, seen)
                else:
                    cks = [settled_checkpoint(c, c.create_checkpoint(sid)["id"], timeout=300)]
                for ck in cks:
                    if ck.get("state") != "committed" or not ck.get("proc_image"):
                        self.res["errors"].append(f"{ck['id']}: {ck.get('state')} "
                                                  f"proc_image={ck.get('proc_image')} {ck.get('reasons')}")
                        continue
                    self.res["checkpoints"] += 1
                    self.check_image(ck["id"])
                    done.append(ck["id"])
        except KeyboardInterrupt:
            self.res["interrupted"] = True  # partial: what was checked until then
        finally:
            stop.set()
            if th:
                th.join(120)
        self.res["seconds"] = round(time.monotonic() - t0, 1)
        self.res["load_end"] = os.getloadavg()
        return self.res

    def close(self) -> None:
        try:
            self.dh.shutdown()
        finally:
            cleanup_state_dir(self.state)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoints", type=int, default=40)
    p.add_argument("--tight", type=int, default=2, help="workers that write their page all the time")
    p.add_argument("--burst", type=int, default=2, help="workers that write in bursts, then sleep")
    p.add_argument("--beside", action="store_true", help="fork earlier checkpoints while capturing")
    p.add_argument("--turns", action="store_true",
                   help="captures at turn ends (each turn spawns an oracle spin worker) instead of manual ones")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", help="write the result here")
    a = p.parse_args(argv)
    load0 = os.getloadavg()
    r = Run(a)
    try:
        res = r.run()
    finally:
        r.close()
    res.update(args=vars(a), load_start=load0, command="python -m bench.torn " + " ".join(argv or sys.argv[1:]))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "torn"} | {"torn": len(res["torn"])}))
    return 1 if res["torn"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
