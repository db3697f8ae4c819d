#!/usr/bin/env python3
"""Stall and overhead of crabd's turn-end checkpoints, at 1..N sandboxes.

    crabd bench stall [--sandboxes 1,4,16] [--turns N] [--image busybox] [--json]
                      [--out DIR] [--label NAME] [--crabd-src DIR] [--seed S]

N sandboxes run the same agent-like session at once: each turn is one exec
that writes a few files (2 of 3 turns) or only reads (1 of 3), then an "LLM
wait" of 1-3 s (seeded, the same sequence in every configuration). The
session runs three ways, interleaved per sandbox count so host load hits
them alike:

* `bare`: crabd.runtime.Runtime sandboxes, no daemon (no inspector, no
  checkpoints): the baseline;
* `sched`: through a crabd daemon with its host-scoped scheduler;
* `nosched`: a daemon started with --no-scheduler (every capture at once).

Reported per configuration: stall p50/p99 (the exec reply's `stall_ms`: how
long the turn waited for its sandbox's previous capture), checkpoint latency
p50/p99 (queue + capture until committed and durable, FS and FS_PROC
checkpoints), pause p50/p99 (how long the sandbox was frozen), and the
end-to-end overhead: mean session time vs `bare`'s, in percent.

`--crabd-src DIR` runs the daemons from another source tree (e.g. an older
commit unpacked with `git archive`), for before/after comparisons. Results go
to --out (default bench/results/stall/) as <label>.json and <label>.md.
Needs root, runc, CRIU; images come from $CRABD_TEST_STATE_DIR or
/var/lib/crabd-test (busybox is made from /bin/busybox if missing).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

from bench._stats import percentile
from crabd.runtime import Runtime
from crabd.testing import DaemonHandle, cleanup_state_dir, ensure_busybox_image

ROOT = Path(__file__).resolve().parent.parent

TEST_STATE = Path(os.environ.get("CRABD_TEST_STATE_DIR", "/var/lib/crabd-test"))


def pct(xs: list[float], p: float) -> float | None:
    """The nearest-rank percentile of bench/_stats.py (p in 0..100), rounded to 3 digits."""
    return percentile(xs, p, 3)


def session(seed: int, turns: int, wait_min: float, wait_max: float) -> list[tuple[str, float]]:
    """One sandbox's turns: (shell command, LLM wait in s). Deterministic."""
    rng = random.Random(seed)
    out = []
    for k in range(turns):
        if k % 3 == 2:
            cmd = "ls -la /work >/dev/null 2>&1; cat /work/d*/f* 2>/dev/null | wc -c; grep -r zz /work >/dev/null; true"
        else:
            d = f"/work/d{k % 4}"
            parts = [f"mkdir -p {d}"]
            for j in range(3):
                size = rng.choice([512, 4096, 16384, 65536])
                parts.append(f"head -c {size} /dev/urandom > {d}/f{k}_{j}")
            if k >= 4 and rng.random() < 0.3:
                parts.append(f"rm -f /work/d{(k - 4) % 4}/f{k - 4}_0")
            cmd = " && ".join(parts)
        out.append((cmd, round(rng.uniform(wait_min, wait_max), 3)))
    return out


def run_agents(n: int, plans: list[list[tuple[str, float]]],
               exec_fn: Callable[[int, str], dict[str, Any]]) -> list[dict[str, Any]]:
    """Run n sessions at once (a thread each); per sandbox: session seconds and per-turn replies."""
    results: list[dict[str, Any]] = [{} for _ in range(n)]
    errors: list[BaseException] = []
    start = threading.Barrier(n)

    def agent(i: int) -> None:
        try:
            start.wait()
            t0 = time.monotonic()
            replies = []
            for cmd, wait in plans[i]:
                t = time.monotonic()
                r = exec_fn(i, cmd)
                r["client_ms"] = (time.monotonic() - t) * 1000
                if r.get("exit_code", 0) != 0:
                    raise RuntimeError(f"turn failed in sandbox {i}: {cmd!r}: {r}")
                replies.append(r)
                time.sleep(wait)
            results[i] = {"session_s": time.monotonic() - t0, "replies": replies}
        except BaseException as e:  # reported after join
            errors.append(e)
            start.abort()

    threads = [threading.Thread(target=agent, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def bare_run(rt: Runtime, image: str, n: int, plans: list) -> dict[str, Any]:
    sids = [rt.create(image).id for _ in range(n)]
    try:
        for s in sids:
            rt.exec(s, "mkdir -p /work")
        res = run_agents(n, plans, lambda i, cmd: rt.exec(sids[i], cmd).to_dict())
    finally:
        for s in sids:
            try:
                rt.destroy(s)
            except Exception as e:
                print(f"warning: destroying bare sandbox {s}: {e}", file=sys.stderr)
    sess = [r["session_s"] for r in res]
    return {"session_s": round(statistics.mean(sess), 3),
            "exec_ms": {"p50": pct([r["duration"] * 1000 for x in res for r in x["replies"]], 50),
                        "p99": pct([r["duration"] * 1000 for x in res for r in x["replies"]], 99)}}


def daemon_run(d: DaemonHandle, image: str, n: int, plans: list) -> dict[str, Any]:
    c = d.client()
    sids = [c.create_sandbox(image)["id"] for _ in range(n)]
    try:
        for s in sids:
            c.exec(s, "mkdir -p /work")
        clients = [d.client() for _ in range(n)]
        res = run_agents(n, plans, lambda i, cmd: clients[i].exec(sids[i], cmd))
        # every checkpoint committed (hang guard: 10 min)
        deadline = time.monotonic() + 600
        while True:
            cks = [k for s in sids for k in c.checkpoints(s, all=True) if k["seq"] > 1]
            if all(k["state"] != "pending" for k in cks):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"checkpoints still pending after 10 min: {[k['id'] for k in cks]}")
            time.sleep(0.2)
    finally:
        for s in sids:
            try:
                c.delete_sandbox(s)
            except Exception as e:
                print(f"warning: deleting sandbox {s}: {e}", file=sys.stderr)
    stalls = [r["stall_ms"] for x in res for r in x["replies"]]
    caps = [k for k in cks if k["plan"] != "SKIP" and k["state"] == "committed"]
    lat = [(k["durations"].get("queue", 0) + k["durations"].get("total", 0)) * 1000 for k in caps]
    pause = [k["durations"].get("pause", 0) * 1000 for k in caps]
    sess = [r["session_s"] for r in res]
    return {
        "session_s": round(statistics.mean(sess), 3),
        "stall_ms": {"p50": pct(stalls, 50), "p99": pct(stalls, 99), "max": pct(stalls, 100)},
        "ckpt_ms": {"p50": pct(lat, 50), "p99": pct(lat, 99)},
        "pause_ms": {"p50": pct(pause, 50), "p99": pct(pause, 99)},
        "plans": {p: sum(1 for k in cks if k["plan"] == p) for p in ("SKIP", "FS", "FS_PROC")},
        "failed": sum(1 for k in cks if k["state"] == "failed"),
        "turns": len(stalls),
    }


def ensure_image(rt: Runtime, image: str) -> str:
    if rt.images.exists(image):
        return rt.images.get(image).path
    if image != "busybox":
        raise SystemExit(f"image {image!r} not in {TEST_STATE}: run the integration tests once "
                         f"(or `crabd image build-debian debian-py`)")
    return rt.images.get(ensure_busybox_image(rt)).path


def parser() -> argparse.ArgumentParser:
    """The benchmark's options (also `crabd bench NAME --help`)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sandboxes", default="1,4,16", help="comma-separated sandbox counts")
    ap.add_argument("--turns", type=int, default=12)
    ap.add_argument("--image", default="busybox")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--wait-min", type=float, default=1.0)
    ap.add_argument("--wait-max", type=float, default=3.0)
    ap.add_argument("--configs", default="bare,sched,nosched", help="which of bare,sched,nosched to run")
    ap.add_argument("--crabd-src", default=None, help="run the daemons from this source tree (before/after)")
    ap.add_argument("--label", default="latest")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "stall"))
    ap.add_argument("--json", action="store_true")
    return ap


def main(argv: list[str] | None = None) -> None:
    a = parser().parse_args(argv)
    counts = [int(x) for x in a.sandboxes.split(",") if x]
    configs = [x for x in a.configs.split(",") if x]
    if os.geteuid() != 0:
        raise SystemExit("bench stall needs root (runc, mounts, CRIU)")

    src_rt = Runtime(TEST_STATE)
    image_path = ensure_image(src_rt, a.image)
    work = Path(tempfile.mkdtemp(prefix="crabd-stall-", dir="/var/tmp"))
    env = None
    if a.crabd_src:
        # The editable install's import hook would win over PYTHONPATH: a
        # wrapper drops it and imports crabd (and deltafs, ...) from the tree.
        import crabd.testing
        src = str(Path(a.crabd_src).resolve())
        wrapper = work / "crabd-from-src"
        wrapper.write_text(f"#!{sys.executable}\n"
                           "import sys\n"
                           "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f)]\n"
                           f"sys.path.insert(0, {src!r})\n"
                           "import crabd\n"
                           f"assert crabd.__file__.startswith({src!r}), crabd.__file__\n"
                           "from crabd.cli import main\n"
                           "main()\n")
        wrapper.chmod(0o755)
        crabd.testing.CRABD = str(wrapper)  # type: ignore[attr-defined]
    daemons: dict[str, DaemonHandle] = {}
    out: dict[str, Any] = {"host": {"cpus": os.cpu_count(), "kernel": platform.release(),
                                    "load_avg_start": os.getloadavg()},
                           "args": {k: v for k, v in vars(a).items() if k not in ("json", "out")},
                           "runs": {}}
    t_all = time.monotonic()
    try:
        for cfg in configs:
            if cfg == "bare":
                continue
            st = work / cfg
            Runtime(st).images.import_path(image_path, a.image)
            d = DaemonHandle(st, args=["--no-scheduler"] if cfg == "nosched" else [], env=env)
            d.start()
            daemons[cfg] = d
        bare_rt = Runtime(work / "bare") if "bare" in configs else None
        if bare_rt is not None:
            bare_rt.images.import_path(image_path, a.image)
        for n in counts:
            plans = [session(a.seed * 1000 + i, a.turns, a.wait_min, a.wait_max) for i in range(n)]
            row: dict[str, Any] = {}
            for cfg in configs:
                print(f"[stall] {n} sandbox(es), {cfg} ...", file=sys.stderr, flush=True)
                if cfg == "bare":
                    assert bare_rt is not None
                    row[cfg] = bare_run(bare_rt, a.image, n, plans)
                else:
                    row[cfg] = daemon_run(daemons[cfg], a.image, n, plans)
            if "bare" in row:
                for cfg in ("sched", "nosched"):
                    if cfg in row:
                        b = row["bare"]["session_s"]
                        row[cfg]["overhead_pct"] = round((row[cfg]["session_s"] - b) / b * 100, 2)
            out["runs"][str(n)] = row
    finally:
        for d in daemons.values():
            d.stop()
        cleanup_state_dir(work)
    out["host"]["load_avg_end"] = os.getloadavg()
    out["duration_s"] = round(time.monotonic() - t_all, 1)

    md = [f"# bench stall: {a.label}", "",
          f"`crabd bench stall --sandboxes {a.sandboxes} --turns {a.turns} --image {a.image} --seed {a.seed}`"
          + (f" (daemon from {a.crabd_src})" if a.crabd_src else ""),
          f"host: {os.cpu_count()} CPUs, load {out['host']['load_avg_start'][0]:.1f} -> "
          f"{out['host']['load_avg_end'][0]:.1f}; run time {out['duration_s']} s", "",
          "| sandboxes | config | stall p50 / p99 / max ms | ckpt p50 / p99 ms | pause p50 / p99 ms | overhead % |",
          "|---|---|---|---|---|---|"]
    for n, row in out["runs"].items():
        for cfg, r in row.items():
            if cfg == "bare":
                md.append(f"| {n} | bare | - | - | - | 0 (session {r['session_s']} s) |")
                continue
            md.append(f"| {n} | {cfg} | {r['stall_ms']['p50']} / {r['stall_ms']['p99']} / {r['stall_ms']['max']} | "
                      f"{r['ckpt_ms']['p50']} / {r['ckpt_ms']['p99']} | {r['pause_ms']['p50']} / {r['pause_ms']['p99']} | "
                      f"{r.get('overhead_pct', '-')} |")
    outdir = Path(a.out)
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / f"{a.label}.json").write_text(json.dumps(out, indent=2) + "\n")
    (outdir / f"{a.label}.md").write_text("\n".join(md) + "\n")
    print(json.dumps(out, indent=2) if a.json else "\n".join(md))


if __name__ == "__main__":
    main()
