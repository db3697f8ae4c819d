#!/usr/bin/env python3
"""deltafs benchmark: checkpoint pause and total, rollback, fork, bytes, depth — per driver.

    python -m bench.fs [--quick] [--json] [--drivers btrfs,overlay] [--image ROOTFS_DIR]

(wired to `crabd bench fs`). Needs root: it mounts, creates a loop-backed
btrfs pool and a cgroup v1 freezer cgroup.

For each driver, on a sandbox-sized tree — a base image (a rootfs dir given
with --image, else a synthetic one: ~5k small files in ~100 dirs plus a few
multi-MiB files, said so in the output) committed as the parent, plus a
~5k-file project written in the sandbox and checkpointed once — it measures
for 0, 1, 100, 10000 changed files and 1 MiB / 256 MiB changed in one file:

* pause (commit_ms): freezer FROZEN -> deltafs checkpoint -> THAWED, with a
  writer process running inside the freezer cgroup: what the agent feels;
* total (commit_total_ms): from the end of the turn's writes to the
  checkpoint being durable: prepare_checkpoint() (btrfs: syncfs writeback;
  overlay: pre-copy) + pause + sync();
* bytes_per_commit: Snapshotter.usage() of the new checkpoint (what it adds);
* checkpoint_write_bytes: what the checkpoint itself writes (btrfs: pool
  device writes during checkpoint + sync; overlay: the copied layer);

then rollback (unmount in the background, remove the active, prepare from
a checkpoint, mount on the same path), fork (prepare + mount on a new path), and the layer depth
after 200 checkpoints of a fresh fork with compact() run after each thaw
(btrfs has no layers: depth 1). --quick cuts repetitions, never keys.
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

import deltafs
from bench._stats import percentile as pct  # (bench/_stats.py: nearest rank, p in 0..100)

FREEZER = "/sys/fs/cgroup/freezer"
CLASSES = ["0", "1", "100", "10000", "1MiB", "256MiB"]


def summary(xs: list[float]) -> dict[str, float]:
    return {"p50": round(pct(xs, 50), 3), "p99": round(pct(xs, 99), 3)}


class Freezer:
    """A cgroup v1 freezer cgroup with a busy writer process inside.

    The writer rewrites 4 KiB in a tmpfs file every millisecond: a process
    the freezer really has to stop, without adding disk traffic that would
    blur what the checkpoint itself costs (its writes are not in the tree, so
    the changed-file counts stay exact).
    """

    def __init__(self, name: str, scratch: str) -> None:
        if not os.path.isdir(FREEZER):
            sys.exit(f"bench fs: {FREEZER} is missing; mount the cgroup v1 freezer "
                     "(mount -t cgroup -o freezer freezer /sys/fs/cgroup/freezer)")
        self.path = os.path.join(FREEZER, name)
        os.makedirs(self.path, exist_ok=True)
        code = ("import os,time\nf=open(%r,'wb')\nwhile True:\n f.seek(0); f.write(os.urandom(4096)); f.flush()\n"
                " time.sleep(0.001)\n") % os.path.join("/dev/shm", f"{name}.out")
        self.writer = subprocess.Popen([sys.executable, "-c", code])
        with open(os.path.join(self.path, "cgroup.procs"), "w") as f:
            f.write(str(self.writer.pid))

    def _set(self, state: str) -> None:
        with open(os.path.join(self.path, "freezer.state"), "w") as f:
            f.write(state)
        while True:
            with open(os.path.join(self.path, "freezer.state")) as f:
                if f.read().strip() == state:
                    return

    def freeze(self) -> None:
        self._set("FROZEN")

    def thaw(self) -> None:
        self._set("THAWED")

    def close(self) -> None:
        self.thaw()
        self.writer.kill()
        self.writer.wait()
        try:
            os.unlink(os.path.join("/dev/shm", f"{os.path.basename(self.path)}.out"))
        except OSError:
            pass
        time.sleep(0.05)
        try:
            os.rmdir(self.path)
        except OSError:
            pass


def pool_written(s) -> int | None:
    """Bytes written so far to the block device under a btrfs pool (None when not a btrfs store)."""
    root = getattr(s, "root", None)
    if root is None:
        return None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            if left.split()[4] == root:
                dev = os.path.basename(right.split()[1])
                with open(f"/sys/block/{dev}/stat") as st:
                    return int(st.read().split()[6]) * 512
    return None


def write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def synth_image(root: str) -> dict:
    """~5k small files in ~100 dirs plus four 4 MiB files: a stand-in for a Debian rootfs."""
    n = 0
    size = 0
    for d in range(100):
        dd = os.path.join(root, "usr", "lib", f"pkg{d:03d}")
        os.makedirs(dd)
        for i in range(50):
            b = os.urandom(200 + (i * 97) % 8000)
            write(os.path.join(dd, f"f{i}.py"), b)
            n += 1
            size += len(b)
    os.makedirs(os.path.join(root, "usr", "bin"))
    for i in range(4):
        b = os.urandom(4 << 20)
        write(os.path.join(root, "usr", "bin", f"big{i}"), b)
        n += 1
        size += len(b)
    os.makedirs(os.path.join(root, "etc"))
    write(os.path.join(root, "etc", "hosts"), b"127.0.0.1 localhost\n")
    return {"kind": "synthetic", "files": n + 1, "bytes": size}


def copy_image(src: str, dst: str) -> dict:
    n = size = 0
    for dirpath, dirnames, filenames in os.walk(src):
        rel = os.path.relpath(dirpath, src)
        for d in dirnames:
            os.makedirs(os.path.join(dst, rel, d), exist_ok=True)
        for f in filenames:
            s = os.path.join(dirpath, f)
            t = os.path.join(dst, rel, f)
            if os.path.islink(s):
                os.symlink(os.readlink(s), t)
            elif os.path.isfile(s):
                shutil.copy2(s, t)
                size += os.path.getsize(s)
            n += 1
    return {"kind": f"rootfs {src}", "files": n, "bytes": size}


def project(root: str) -> None:
    for d in range(50):
        dd = os.path.join(root, "work", "proj", f"mod{d:02d}")
        os.makedirs(dd)
        for i in range(100):
            write(os.path.join(dd, f"m{i}.py"), os.urandom(300))


def change(root: str, cls: str, rep: int) -> None:
    if cls == "0":
        return
    if cls in ("1", "100", "10000"):
        n = int(cls)
        d = os.path.join(root, "work", "changes")
        os.makedirs(d, exist_ok=True)
        payload = (b"rep %d\n" % rep) * 16
        for i in range(n):
            write(os.path.join(d, f"c{i}"), payload)
        return
    size = 1 << 20 if cls == "1MiB" else 256 << 20
    with open(os.path.join(root, "work", f"blob-{cls}"), "wb") as f:
        chunk = os.urandom(1 << 20)
        for _ in range(size >> 20):
            f.write(chunk)


def bench_driver(driver: str, quick: bool, image_dir: str | None, base: str, log) -> dict:
    state = os.path.join(base, driver, "state")
    mnts = os.path.join(base, driver, "mnt")
    os.makedirs(mnts)
    s = deltafs.open(state, driver=driver)
    targets: list[str] = []

    def mount(mounts, target=None) -> str:
        t = target or tempfile.mkdtemp(dir=mnts)
        os.makedirs(t, exist_ok=True)
        deltafs.mount_all(mounts, t)
        targets.append(t)
        return t

    def unmount(t: str, background: bool = False) -> None:
        deltafs.unmount(t, background=background)
        targets.remove(t)

    freezer = Freezer(f"deltafs-bench-{os.getpid()}-{driver}", os.path.join(base, driver))
    try:
        t0 = time.perf_counter()
        imp = mount(s.prepare("img-import"))
        info = copy_image(image_dir, imp) if image_dir else synth_image(imp)
        unmount(imp)
        s.commit("img", "img-import")
        root = mount(s.prepare("sb", parent="img"), os.path.join(mnts, "sandbox-root"))
        project(root)
        base_ckpt = s.checkpoint("sb")
        s.sync()
        log(f"{driver}: image ({info['kind']}, {info['files']} files, {info['bytes'] >> 20} MiB) "
            f"+ 5000-file project ready in {time.perf_counter() - t0:.1f} s")

        out: dict = {"commit_ms": {}, "commit_total_ms": {}, "bytes_per_commit": {}, "checkpoint_write_bytes": {}}
        last = None
        compactions: list[float] = []
        for cls in CLASSES:
            reps = {"10000": 2, "256MiB": 2}.get(cls, 5) if quick else {"10000": 10, "256MiB": 10}.get(cls, 100)
            pauses, totals, written = [], [], []
            for rep in range(reps):
                change(root, cls, rep)
                t_end = time.perf_counter()            # the turn's writes are done
                s.prepare_checkpoint("sb")             # during the LLM wait
                w0 = pool_written(s)
                f0 = time.perf_counter()
                freezer.freeze()
                last = s.checkpoint("sb")
                freezer.thaw()
                f1 = time.perf_counter()
                s.sync()                               # durable
                t1 = time.perf_counter()
                w1 = pool_written(s)
                if w0 is not None and w1 is not None:
                    written.append(w1 - w0)
                pauses.append((f1 - f0) * 1e3)
                totals.append((t1 - t_end) * 1e3)
                # What crabd's scheduler does at idle time (overlay: merge
                # layers when the chain is deeper than 16; btrfs: nothing).
                c0 = time.perf_counter()
                if s.compact(last):
                    compactions.append((time.perf_counter() - c0) * 1e3)
            out["commit_ms"][cls] = summary(pauses)
            out["commit_total_ms"][cls] = summary(totals)
            out["bytes_per_commit"][cls] = s.usage(last).size
            # What the checkpoint itself writes: btrfs, the pool device's
            # writes during checkpoint + sync (the sandbox's own data was
            # written back by prepare_checkpoint); overlay, the layer it copies.
            out["checkpoint_write_bytes"][cls] = int(pct(written, 50)) if written else out["bytes_per_commit"][cls]
            log(f"{driver}: {cls:>7} changed: pause p50 {pct(pauses, 50):8.2f} ms p99 {pct(pauses, 99):8.2f} ms; "
                f"total p50 {pct(totals, 50):8.2f} ms; adds {out['bytes_per_commit'][cls]} B, "
                f"writes {out['checkpoint_write_bytes'][cls]} B")

        out["compact_ms"] = summary(compactions) if compactions else {"p50": 0.0, "p99": 0.0}
        out["compactions"] = len(compactions)
        if compactions:
            log(f"{driver}: {len(compactions)} compactions (idle time): p50 {pct(compactions, 50):.1f} ms "
                f"p99 {pct(compactions, 99):.1f} ms")

        # Rollback: the runtime stops the container, then swaps the sandbox root.
        reps = 10 if quick else 100
        rb = []
        for i in range(reps):
            t = time.perf_counter()
            unmount(root, background=True)  # as the runtime should: see deltafs.unmount
            s.remove("sb")
            mount(s.prepare("sb", parent=last), root)
            rb.append((time.perf_counter() - t) * 1e3)
        out["rollback_ms"] = summary(rb)
        fk = []
        for i in range(reps):
            t = time.perf_counter()
            mount(s.prepare(f"fork{i}", parent=last))
            fk.append((time.perf_counter() - t) * 1e3)
        out["fork_ms"] = summary(fk)
        log(f"{driver}: rollback p50 {pct(rb, 50):.2f} ms p99 {pct(rb, 99):.2f} ms; "
            f"fork p50 {pct(fk, 50):.2f} ms p99 {pct(fk, 99):.2f} ms")

        # Depth after 200 checkpoints (one small change each, compaction after
        # each thaw) of a fresh sandbox forked from the image + project.
        deep = mount(s.prepare("deep", parent=base_ckpt))
        max_depth = 0
        for i in range(200):
            write(os.path.join(deep, "work", "turn"), b"%d" % i)
            name = s.checkpoint("deep")
            s.compact(name)
            max_depth = max(max_depth, s.depth(name))
        out["depth_after_200_commits"] = s.depth(name)
        out["max_depth_during_200_commits"] = max_depth
        out["image"] = info
        log(f"{driver}: depth after 200 checkpoints {out['depth_after_200_commits']} (max {max_depth})")
        return out
    finally:
        freezer.close()
        for t in reversed(targets):
            deltafs.unmount(t, detach=True)
        if driver == "btrfs":
            s.unmount_pool()  # type: ignore[attr-defined]
        else:
            s.close()


def parser() -> argparse.ArgumentParser:
    """The benchmark's options (also `crabd bench NAME --help`)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (same keys), < 60 s")
    ap.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    ap.add_argument("--drivers", default="btrfs,overlay")
    ap.add_argument("--image", help="rootfs directory to use as the base image (default: synthetic)")
    ap.add_argument("--workdir", default="/var/tmp", help="where state dirs are created (and deleted)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if os.geteuid() != 0:
        sys.exit("bench fs needs root (mounts, loop devices, cgroup freezer)")
    log = (lambda m: print(m, file=sys.stderr, flush=True)) if args.json else (lambda m: print(m, flush=True))
    base = tempfile.mkdtemp(prefix="deltafs-bench-", dir=args.workdir)
    t0 = time.perf_counter()
    result: dict = {"drivers": {}}
    try:
        for d in args.drivers.split(","):
            result["drivers"][d] = bench_driver(d, args.quick, args.image, base, log)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    result["meta"] = {"quick": args.quick, "seconds": round(time.perf_counter() - t0, 1),
                      "kernel": platform.release(), "state_fs": args.workdir,
                      "command": " ".join(["python", "bench/fs.py"] + (argv if argv is not None else sys.argv[1:]))}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        log(f"done in {result['meta']['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
