#!/usr/bin/env python3
"""ebpf inspector benchmark: overhead on syscall-heavy workloads, accuracy on labelled turns.

    python -m bench.inspector [--quick] [--json] [--runs N]

(wired to `crabd bench inspector`). Needs root: it loads BPF programs and
creates cgroups under /sys/fs/cgroup/unified and two network namespaces.

Overhead: each workload runs in a fresh cgroup v2 directory (as a runc exec'd
process runs in its container's cgroup) and its wall time is measured
(median of --runs runs, >= 5), with the CPU time (user + sys of the
workload's processes, which includes the BPF programs run in their context)
alongside. Baseline and inspected runs alternate (ABBA) on one loaded
program: for a baseline run its tracepoints are detached (a detached program
costs nothing); for an inspected run they are attached, the cgroup is
watched and a turn is open around the run (end_turn, with its drain and
/proc scan, is outside the timed region).
Workloads:
  storm:  100k x (open O_WRONLY|O_CREAT, write 16 B, close) over 100 file
          names, from a small C program (so the syscalls, not an
          interpreter, dominate) — every open is an event;
  untar:  extract a tarball of a source tree (the kernel headers' include/,
          ~6k files; --quick: include/linux, ~2.7k files);
  tests:  a generated pytest suite (300 tests doing small file I/O).
--quick: 5 runs of a 20k-iteration storm and a smaller tree (not comparable
with the full numbers; the JSON says so).

Accuracy: every turn of ebpf.testing.LABELLED_TURNS runs once, watched, and
is classified; a false negative is a plan below its label, a false
positive one above it. skip_fraction is the fraction of turns the
classifier said SKIP.

Since wall time on a shared host is noisy, the in-kernel run time of the
programs (kernel.bpf_stats_enabled, set for the run and restored) and the
CPU time of the draining thread are reported too, as % of baseline wall.

JSON: {"overhead_pct": {workload: pct}, "false_negatives": n,
"false_positives": n, "skip_fraction": x, ...details}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from bench._stats import median
from ebpf import BPFUnavailable, Inspector, PlanKind, classify
from ebpf.testing import LABELLED_TURNS, CgroupCell, TestPeer

RANK = {PlanKind.SKIP: 0, PlanKind.FS: 1, PlanKind.FS_PROC: 2}

STORM_C = r"""
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 100000;
    char name[32];
    for (long i = 0; i < n; i++) {
        snprintf(name, sizeof name, "f%ld", i % 100);
        int fd = open(name, O_WRONLY | O_CREAT, 0644);
        if (fd < 0) { perror("open"); return 1; }
        if (write(fd, "0123456789abcdef", 16) != 16) { perror("write"); return 1; }
        close(fd);
    }
    return 0;
}
"""

TEST_MODULE = '''
import json
import pytest

@pytest.mark.parametrize("i", range(300))
def test_roundtrip(tmp_path, i):
    data = {"i": i, "items": list(range(i % 50)), "name": "x" * (i % 17)}
    p = tmp_path / "d.json"
    p.write_text(json.dumps(data))
    assert json.loads(p.read_text()) == data
    assert sum(data["items"]) == sum(range(i % 50))
'''


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Workloads:
    def __init__(self, work: Path, quick: bool) -> None:
        self.work = work
        self.quick = quick
        self.storm_bin = work / "storm"
        src = work / "storm.c"
        src.write_text(STORM_C)
        subprocess.run(["gcc", "-O2", "-o", str(self.storm_bin), str(src)], check=True, timeout=60)
        self.storm_n = 20000 if quick else 100000
        # A source tree: the kernel headers' include/ (~6k files, ~57 MB) when
        # installed (setup-host installs them for bcc), else the standard library.
        tree = next(iter(sorted(Path("/usr/src").glob("linux-headers-*-common/include"))), None)
        if tree is None:
            tree = Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
        if quick:
            tree = tree / "linux" if (tree / "linux").is_dir() else tree / "json"
        self.tree = tree
        self.tarball = work / "tree.tar"
        skip = ("__pycache__", "site-packages", "dist-packages")
        with tarfile.open(self.tarball, "w") as t:
            t.add(tree, arcname="src", filter=lambda ti: None if any(x in ti.name for x in skip) else ti)
        with tarfile.open(self.tarball) as t:
            self.tar_files = sum(1 for m in t.getmembers() if m.isfile())
        self.suite = work / "suite"
        self.suite.mkdir()
        (self.suite / "test_gen.py").write_text(TEST_MODULE)

    def commands(self) -> dict[str, str]:
        return {
            "storm": f"{self.storm_bin} {self.storm_n}",
            "untar": f"mkdir -p x && tar -xf {self.tarball} -C x",
            "tests": f"{sys.executable} -m pytest -q -p no:cacheprovider -x {self.suite} >/dev/null",
        }


class Attachment:
    """Detach and re-attach the loaded program's tracepoints, so that
    baseline and inspected runs can alternate without recompiling: a
    detached program costs nothing, as if no inspector were loaded."""

    def __init__(self, insp: Inspector) -> None:
        self.bpf = insp._loader._bpf  # noqa: SLF001 - bench-only reach into bcc
        self.tps = list(self.bpf.tracepoint_fds)

    def off(self) -> None:
        for tp in list(self.bpf.tracepoint_fds):
            self.bpf.detach_tracepoint(tp)

    def on(self) -> None:
        for tp in self.tps:
            if tp not in self.bpf.tracepoint_fds:
                cat, ev = tp.split(b":")
                self.bpf.attach_tracepoint(tp=tp, fn_name=b"tracepoint__" + cat + b"__" + ev)


class BPFStats:
    """In-kernel run time of the inspector's programs (kernel.bpf_stats_enabled,
    read from each program fd's fdinfo) and CPU time of the draining thread:
    precise costs, where wall time on a shared host is noisy."""

    KNOB = Path("/proc/sys/kernel/bpf_stats_enabled")

    def __init__(self, insp: Inspector) -> None:
        bpf = insp._loader._bpf  # noqa: SLF001 - bench-only reach into bcc
        self.fds = [f.fd for f in bpf.funcs.values()]
        self.thread = insp._thread  # noqa: SLF001
        self.old = self.KNOB.read_text().strip()
        self.KNOB.write_text("1")

    def close(self) -> None:
        self.KNOB.write_text(self.old)

    def bpf_ns(self) -> int:
        total = 0
        for fd in self.fds:
            for line in Path(f"/proc/self/fdinfo/{fd}").read_text().splitlines():
                if line.startswith("run_time_ns:"):
                    total += int(line.split()[1])
        return total

    def poller_ns(self) -> int:
        if self.thread is None or self.thread.ident is None:
            return 0
        return time.clock_gettime_ns(time.pthread_getcpuclockid(self.thread.ident))


def one_run(cell: CgroupCell, cmd: str, insp: Inspector | None,
            stats: BPFStats | None = None) -> tuple[float, float, dict]:
    """Wall and CPU (user+sys of the workload's processes) seconds of one run."""
    # fresh output, removed outside the cgroup and outside the timing
    subprocess.run(["sh", "-c", "rm -rf x f*"], cwd=cell.scratch, check=True)
    if insp:
        insp.begin_turn(cell.name)
    b0 = stats.bpf_ns() if stats else 0
    p0 = stats.poller_ns() if stats else 0
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = cell.run(cmd, timeout=600)
    dt = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    b1 = stats.bpf_ns() if stats else 0
    p1 = stats.poller_ns() if stats else 0
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    if r.returncode != 0:
        raise RuntimeError(f"workload {cmd!r} failed: {r.stderr.strip()[-500:]}")
    info: dict = {}
    if insp:
        e = insp.end_turn(cell.name)
        info = {"plan": classify(e).kind.value, "events": e.file_changes + e.transient_files,
                "dropped": e.dropped_events, "bpf_ms": (b1 - b0) / 1e6, "poller_ms": (p1 - p0) / 1e6}
    return dt, cpu, info


def overhead(work: Path, quick: bool, runs: int) -> dict:
    wl = Workloads(work, quick)
    cmds = wl.commands()
    log("loading the inspector ...")
    t0 = time.perf_counter()
    insp = Inspector()
    insp.open()
    load_s = time.perf_counter() - t0
    att = Attachment(insp)
    stats = BPFStats(insp)
    out = {}
    with CgroupCell(work, "bench") as cell:
        insp.watch(cell.name, cell.cgroup)
        try:
            for name, cmd in cmds.items():
                log(f"{name}: {runs} baseline and {runs} inspected runs, interleaved ...")
                cell.run(cmd, timeout=600)  # warm caches
                wall: dict[str, list[float]] = {"base": [], "insp": []}
                cpu: dict[str, list[float]] = {"base": [], "insp": []}
                turns = []
                for i in range(runs):
                    # ABBA order, so that drift hits both modes alike
                    for mode in (("base", "insp") if i % 2 == 0 else ("insp", "base")):
                        if mode == "base":
                            att.off()
                            w, c, _ = one_run(cell, cmd, None)
                            att.on()
                            insp.end_turn(cell.name)  # nothing of it: detached
                        else:
                            w, c, info = one_run(cell, cmd, insp, stats)
                            turns.append(info)
                        wall[mode].append(w)
                        cpu[mode].append(c)
                bw, iw = median(wall["base"]), median(wall["insp"])
                bc, ic = median(cpu["base"]), median(cpu["insp"])
                bpf_ms = median(t["bpf_ms"] for t in turns)
                poll_ms = median(t["poller_ms"] for t in turns)
                out[name] = {
                    "baseline_s": round(bw, 4),
                    "inspected_s": round(iw, 4),
                    "overhead_pct": round(100 * (iw - bw) / bw, 2),
                    "cpu_baseline_s": round(bc, 4),
                    "cpu_inspected_s": round(ic, 4),
                    "cpu_overhead_pct": round(100 * (ic - bc) / bc, 2) if bc else None,
                    # in-kernel program time and draining-thread CPU, relative to baseline wall time
                    "bpf_ms": round(bpf_ms, 3),
                    "bpf_pct": round(100 * bpf_ms / 1000 / bw, 2),
                    "poller_ms": round(poll_ms, 3),
                    "poller_pct": round(100 * poll_ms / 1000 / bw, 2),
                    "baseline_runs_s": [round(x, 4) for x in wall["base"]],
                    "inspected_runs_s": [round(x, 4) for x in wall["insp"]],
                    "turns": turns,
                }
        finally:
            stats.close()
            insp.unwatch(cell.name)
            insp.close()
    return {"workloads": out, "load_s": round(load_s, 2), "storm_iterations": wl.storm_n,
            "untar_files": wl.tar_files, "untar_tree": str(wl.tree), "loadavg_at_start": os.getloadavg()}


def accuracy(work: Path) -> dict:
    rows = []
    peer = TestPeer().start()
    insp = Inspector()
    insp.open()
    try:
        for turn in LABELLED_TURNS:
            with CgroupCell(work, "acc") as cell:
                cell.setup(turn)
                insp.watch(cell.name, cell.cgroup)
                try:
                    insp.begin_turn(cell.name)
                    r = cell.run(turn.cmd)
                    e = insp.end_turn(cell.name)
                finally:
                    insp.unwatch(cell.name)
                plan = classify(e)
                rows.append({
                    "turn": turn.name, "label": turn.label, "plan": plan.kind.value,
                    "external": plan.external, "external_label": turn.external,
                    "ok_exit": r.returncode == 0, "reasons": plan.reasons,
                })
    finally:
        insp.close()
        peer.stop()
    fn = sum(1 for r in rows if RANK[PlanKind(r["plan"])] < RANK[PlanKind(r["label"])])
    fp = sum(1 for r in rows if RANK[PlanKind(r["plan"])] > RANK[PlanKind(r["label"])])
    ext_miss = sum(1 for r in rows if r["external_label"] and not r["external"])
    ext_extra = sum(1 for r in rows if r["external"] and not r["external_label"])
    skip = sum(1 for r in rows if r["plan"] == "SKIP") / len(rows)
    label_skip = sum(1 for r in rows if r["label"] == "SKIP") / len(rows)
    return {"turns": rows, "false_negatives": fn, "false_positives": fp, "skip_fraction": round(skip, 3),
            "label_skip_fraction": round(label_skip, 3), "external_missed": ext_miss, "external_extra": ext_extra}


def parser() -> argparse.ArgumentParser:
    """The benchmark's options (also `crabd bench NAME --help`)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer runs, smaller workloads")
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    ap.add_argument("--runs", type=int, default=None, help="runs per workload and mode (default 9, quick 5)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if os.geteuid() != 0:
        print("bench/inspector.py needs root (BPF, cgroups, network namespaces)", file=sys.stderr)
        return 2
    runs = args.runs or (5 if args.quick else 9)
    with tempfile.TemporaryDirectory(prefix="crabd-bench-inspector-") as d:
        work = Path(d)
        try:
            ov = overhead(work, args.quick, runs)
            acc = accuracy(work)
        except BPFUnavailable as e:
            print(f"BPF inspector unavailable: {e}", file=sys.stderr)
            return 1
    result = {
        "overhead_pct": {k: v["overhead_pct"] for k, v in ov["workloads"].items()},
        "false_negatives": acc["false_negatives"],
        "false_positives": acc["false_positives"],
        "skip_fraction": acc["skip_fraction"],
        "label_skip_fraction": acc["label_skip_fraction"],
        "external_missed": acc["external_missed"],
        "quick": args.quick,
        "runs": runs,
        "host": {"kernel": platform.release(), "cpus": os.cpu_count()},
        "overhead": ov,
        "accuracy": acc["turns"],
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"inspector overhead (median of {runs} runs; kernel {platform.release()}, {os.cpu_count()} CPUs)")
    print(f"{'workload':<8} {'base s':>7} {'insp s':>7} {'wall':>7} {'cpu':>7} {'bpf':>6} {'drain':>6}  plan/dropped")
    for k, v in ov["workloads"].items():
        t = v["turns"][-1] if v["turns"] else {}
        print(f"{k:<8} {v['baseline_s']:>7.3f} {v['inspected_s']:>7.3f} {v['overhead_pct']:>6.1f}% "
              f"{v['cpu_overhead_pct']:>6.1f}% {v['bpf_pct']:>5.1f}% {v['poller_pct']:>5.1f}%  "
              f"{t.get('plan')}/{t.get('dropped')}")
    print("wall, cpu: inspected vs baseline medians; bpf: in-kernel program time, drain: the")
    print("draining thread's CPU, both as % of the baseline wall time")
    print(f"load average at start: {', '.join(f'{x:.2f}' for x in ov['loadavg_at_start'])}")
    print(f"program load: {ov['load_s']} s")
    print(f"labelled turns: {len(acc['turns'])}, false negatives {acc['false_negatives']}, "
          f"false positives {acc['false_positives']}, SKIP fraction {acc['skip_fraction']:.2f} "
          f"(labels: {acc['label_skip_fraction']:.2f}), external missed {acc['external_missed']}")
    for r in acc["turns"]:
        mark = "" if r["plan"] == r["label"] else "  <-- " + ("FN" if RANK[PlanKind(r["plan"])] < RANK[PlanKind(r["label"])] else "FP")
        print(f"  {r['turn'][:34]:<34} label {r['label']:<7} plan {r['plan']:<7}{mark}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
