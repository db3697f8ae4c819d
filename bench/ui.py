#!/usr/bin/env python3
"""The operator view at scale, in a real browser: 500 sandboxes, 10,000 checkpoints, a 1,000-turn tree.

    crabd bench ui [--quick] [--json] [--sandboxes N] [--checkpoints N] [--big-turns N] [--runs N]

The data is synthesised straight into a fresh state directory's SQLite
through crabd.store.Store (sandbox rows, committed checkpoint rows with
plans, bytes, pauses and a few rollback branches, and the big sandbox's
turn.ended events): no containers exist behind them, so a real daemon
(`crabd serve`, /proc inspector, retention set to keep everything) starts on
that state directory, marks them dead ("runtime state is gone") and serves
them. The browser is Debian's Chromium driven by Playwright, through
`crabd ui`'s forwarder, as an operator would open it.

Measured per run, on a fresh page load each (the median of --runs):
* `host_ms`: navigation start until the host view (stats + the first page of
  the sandbox table) is rendered, the page's own `crabd:host-rendered` mark;
* `sandbox_ms`: the same for the big sandbox's view (tree, time line,
  effects, budget): `crabd:sandbox-rendered`;
* `tree_jump_ms`: jumping to the oldest row of the big sandbox's tree
  (scrolled to the bottom, its window of rows drawn: the tree is
  virtualised, only the rows in view are in the page);
* `tree_scroll_step_max_ms`: scrolling through the whole tree a view at a
  time, one animation frame each: the slowest step;
* `longest_task_ms`: the longest main-thread task the browser reported
  (PerformanceObserver `longtask`, tasks over 50 ms; 0 when none) over both
  loads and the scrolling: how long the page froze.
`sandbox_requests` / `sandbox_api_requests`: the requests of that fresh
load of the sandbox view (all, and those to /v1/) until it is drawn and
its event stream open; `sandbox_request_paths` names them (last run).
Also the API's own times for the biggest replies (`/v1/host`, the big
sandbox's view, which the page reads; its tree and its newest 200 events,
which the view holds; its full
checkpoint list and newest 1,000 events, which it read before) and their
sizes. `--quick`: one run. Needs root and chromium. The host's load average
(1 min) is recorded before and after: the machine is shared.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench._stats import median

__all__ = ["parser", "main", "synthesise"]

# Scroll the tree from the top to the bottom a view at a time, one frame per
# step (the browser lays out and paints in between): the slowest step, ms.
_SCROLL_THROUGH = """(async () => {
  const b = document.getElementById('tree-box');
  b.scrollTop = 0; await new Promise((r) => requestAnimationFrame(r));
  let worst = 0;
  while (b.scrollTop + b.clientHeight < b.scrollHeight - 1) {
    const t = performance.now();
    b.scrollTop += b.clientHeight;
    await new Promise((r) => requestAnimationFrame(r));
    worst = Math.max(worst, performance.now() - t);
  }
  return worst;
})()"""

_LONGTASKS = """
window.__longtasks = [];
try {
  new PerformanceObserver((l) => { for (const e of l.getEntries()) window.__longtasks.push(e.duration); })
    .observe({ type: 'longtask', buffered: true });
} catch (_) {}
"""


def synthesise(state: Path, sandboxes: int, checkpoints: int, big_turns: int, seed: int = 1) -> str:
    """Fill `state`'s store; returns the big sandbox's id. Every sandbox has
    at least its initial checkpoint; the big one `big_turns` turns with a
    rollback every 100 turns; the rest share what remains of `checkpoints`."""
    from crabd.store import CheckpointRow, SandboxRow, Store
    rng = random.Random(seed)
    st = Store(state)
    plans = ["SKIP", "SKIP", "SKIP", "FS", "FS", "FS_PROC"]
    big = "sb-big000000"
    rest = max(0, checkpoints - (big_turns + 1))
    per = [1 + rest // max(1, sandboxes - 1) - 1] * (sandboxes - 1)
    for i in range(rest - sum(per)):
        per[i % len(per)] += 1
    with st.transaction():
        for i in range(sandboxes):
            sid = big if i == 0 else f"sb-{i:010x}"
            turns = big_turns if i == 0 else per[i - 1]
            st.add_sandbox(SandboxRow(id=sid, name=f"agent-{i:03d}" if i else "big-tree", image="debian-py",
                                      fs_key=f"root-{sid}", lineage=sid, owner="", state="running", turn=turns,
                                      next_seq=turns + 1))
            parent, branch = None, 0
            ids: list[str] = []
            for seq in range(turns + 1):
                if i == 0 and seq and seq % 100 == 0:   # a rollback 50 turns back: a new branch
                    branch += 1
                    parent = ids[seq - 50]
                p = plans[rng.randrange(len(plans))] if seq else "FS"
                cid = f"{sid}-{seq}"
                st.add_checkpoint(CheckpointRow(
                    id=cid, sandbox_id=sid, seq=seq, parent=parent, branch=branch, turn=seq, plan=p,
                    reasons=[f"synthetic {p} turn"], fs_snapshot=f"{sid}-{seq}" if p != "SKIP" else None,
                    bytes=0 if p == "SKIP" else rng.randrange(4096, 64 << 20), state="committed",
                    # sized, as a live host's are (else the daemon's start queues
                    # thousands of sizing jobs of snapshots that do not exist)
                    durations={"pause": rng.uniform(0.001, 0.05), "size": 0.001}))
                ids.append(cid)
                parent = cid
            st.update_sandbox(sid, head=parent, branch=branch)
    for seq in range(1, big_turns + 1):
        st.add_event("turn.ended", big, turn=seq, checkpoint=f"{big}-{seq}", branch=seq // 100,
                     cmd=f"python -m pytest -q tests/test_{seq % 37}.py -k case_{seq}", cmd_truncated=False,
                     exit_code=1 if seq % 7 == 0 else 0, error=None, duration_s=rng.uniform(0.05, 5), stall_ms=0.0)
    st.close()
    return big


def run(a: argparse.Namespace) -> dict[str, Any]:
    from playwright.sync_api import sync_playwright

    from crabd.testing import DaemonHandle, cleanup_state_dir
    from crabd.ui.forward import Forwarder
    exe = shutil.which("chromium")
    if exe is None:
        raise SystemExit("bench ui: Debian's chromium is missing (scripts/setup-host installs it)")
    state = Path(tempfile.mkdtemp(prefix="crabd-bench-ui-", dir="/var/tmp"))
    conf = state / "bench-ui.toml"
    t0 = time.monotonic()
    big = synthesise(state, a.sandboxes, a.checkpoints, a.big_turns)
    load_before = os.getloadavg()
    synth_s = time.monotonic() - t0
    conf.write_text("[retention]\nkeep_last = 1000000\n")   # nothing retired while measuring
    d = DaemonHandle(state, args=["--config", str(conf), "--no-auto-rollback", "--no-docker"],
                     env={"CRABD_INSPECTOR": "proc"})
    loop = asyncio.new_event_loop()
    fwd = Forwarder(str(d.socket))
    try:
        d.start(wait_inspector=False)
        loop.run_until_complete(fwd.start())
        threading.Thread(target=loop.run_forever, daemon=True).start()
        c = d.client()
        api: dict[str, list[float]] = {k: [] for k in ("host", "view", "tree", "checkpoints", "turns", "turns_1000")}
        size: dict[str, int] = {}
        paths = {"host": "/v1/host", "view": f"/v1/sandboxes/{big}/view?turns=200",   # what the page reads
                 "tree": f"/v1/sandboxes/{big}/tree",
                 "checkpoints": f"/v1/sandboxes/{big}/checkpoints?all=true",
                 "turns": f"/v1/events?follow=false&sandbox={big}&latest=200",       # what the page reads
                 "turns_1000": f"/v1/events?follow=false&sandbox={big}&latest=1000"}  # what it read before
        counted: dict[str, int] = {}
        for _ in range(max(1, a.runs)):
            for k, path in paths.items():
                t = time.monotonic()
                r = c._http.get(path)
                api[k].append((time.monotonic() - t) * 1000)
                assert r.status_code == 200, r.text
                size[k] = len(r.content)
                body = r.json()
                counted[k] = len(body["tree"]["checkpoints"] if k == "view" else
                                 body[{"host": "sandboxes", "tree": "checkpoints", "checkpoints": "checkpoints"}.get(k, "events")])
        assert (counted["host"], counted["view"], counted["tree"], counted["checkpoints"]) == \
            (a.sandboxes, a.big_turns + 1, a.big_turns + 1, a.big_turns + 1), counted
        runs: list[dict[str, float]] = []
        paths_seen: list[str] = []
        base = fwd.url.split("/ui/login")[0]
        with sync_playwright() as pw:
            b = pw.chromium.launch(executable_path=exe, args=["--no-sandbox"])
            for _ in range(max(1, a.runs)):
                ctx = b.new_context(viewport={"width": 1400, "height": 900}, bypass_csp=True)  # the probes are evaluated JS
                ctx.add_init_script(_LONGTASKS)
                pg = ctx.new_page()
                pg.set_default_timeout(60_000)
                pg.goto(fwd.url)
                pg.wait_for_function("performance.getEntriesByName('crabd:host-rendered').length > 0")
                host_ms = pg.evaluate("performance.getEntriesByName('crabd:host-rendered')[0].startTime")
                host_data = pg.evaluate("performance.getEntriesByName('crabd:host-data')[0].startTime")
                rows = pg.locator("#host-table tbody tr").count()
                tasks = pg.evaluate("window.__longtasks")
                pg.goto(f"{base}/ui/#/sb/{big}")
                pg.wait_for_function("performance.getEntriesByName('crabd:sandbox-rendered').length > 0")
                reqs: list[str] = []
                pg.on("request", lambda r: reqs.append(r.url.split("//", 1)[1].split("/", 1)[1]))
                pg.reload()   # a fresh load of the sandbox view itself
                pg.wait_for_function("performance.getEntriesByName('crabd:sandbox-rendered').length > 0")
                # Its requests: those until the view is drawn and the event stream open.
                pg.wait_for_function("document.getElementById('live').textContent === 'live'")
                api_reqs = [u.split("?")[0] for u in reqs if u.startswith("v1/")]
                sb_ms = pg.evaluate("performance.getEntriesByName('crabd:sandbox-rendered')[0].startTime")
                sb_data = pg.evaluate("performance.getEntriesByName('crabd:sandbox-data')[0].startTime")
                tree_rows = pg.locator("#sb-tree tr[data-checkpoint]").count()
                total = pg.evaluate("state.sb.checkpoints.length")
                jump = pg.evaluate("(() => { const b = document.getElementById('tree-box'); const t = performance.now();"
                                   " b.scrollTop = b.scrollHeight; renderTreeWindow(); return performance.now() - t; })()")
                assert pg.locator(f"#sb-tree tr[data-checkpoint='{big}-0']").count() == 1, "the oldest row is not drawn"
                step = pg.evaluate(_SCROLL_THROUGH)
                tasks += pg.evaluate("window.__longtasks")
                runs.append({"host_ms": host_ms, "host_data_ms": host_data, "host_render_ms": host_ms - host_data,
                             "sandbox_ms": sb_ms, "sandbox_data_ms": sb_data, "sandbox_render_ms": sb_ms - sb_data,
                             "tree_jump_ms": jump, "tree_scroll_step_max_ms": step,
                             "longest_task_ms": max(tasks) if tasks else 0.0, "host_rows": rows,
                             "tree_rows_drawn": tree_rows, "tree_rows_total": total,
                             "sandbox_requests": len(reqs), "sandbox_api_requests": len(api_reqs)})
                paths_seen = [u.split("?")[0] for u in reqs]
                ctx.close()
            b.close()
    finally:
        loop.call_soon_threadsafe(loop.stop)
        d.stop()
        cleanup_state_dir(state)
    med = {k: round(median([r[k] for r in runs]), 1) for k in runs[0]}
    return {"bench": "ui", "config": {"sandboxes": a.sandboxes, "checkpoints": a.checkpoints,
                                      "big_turns": a.big_turns, "runs": len(runs), "quick": a.quick,
                                      "data": "synthesised into the state dir's SQLite (crabd.store.Store)"},
            "host": {"machine": platform.node(), "cpus": os.cpu_count(), "chromium": exe},
            "synthesise_s": round(synth_s, 2),
            "load_avg": {"before": [round(x, 2) for x in load_before],
                         "after": [round(x, 2) for x in os.getloadavg()]},
            "api_ms": {k: round(median(list(v)), 1) for k, v in api.items()}, "api_bytes": size, "api_items": counted,
            "median": med, "runs": runs, "sandbox_request_paths": paths_seen,
            "within_1s": med["host_ms"] < 1000 and med["sandbox_ms"] < 1000}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.ui", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one run (default: 3)")
    ap.add_argument("--runs", type=int, help="page loads measured (default 3, --quick 1)")
    ap.add_argument("--sandboxes", type=int, default=500)
    ap.add_argument("--checkpoints", type=int, default=10_000, help="checkpoints in all, the big sandbox's included")
    ap.add_argument("--big-turns", type=int, default=1000, help="turns of the one big sandbox")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    a.runs = a.runs or (1 if a.quick else 3)
    r = run(a)
    if a.json:
        print(json.dumps(r, indent=1))
    else:
        m = r["median"]
        print(f"{a.sandboxes} sandboxes, {a.checkpoints} checkpoints, a {a.big_turns}-turn tree "
              f"(median of {a.runs}): host view {m['host_ms']:.0f} ms, sandbox view {m['sandbox_ms']:.0f} ms, "
              f"tree jump {m['tree_jump_ms']:.0f} ms, scroll step {m['tree_scroll_step_max_ms']:.0f} ms, "
              f"longest task {m['longest_task_ms']:.0f} ms; API /v1/host {r['api_ms']['host']:.0f} ms, tree "
              f"{r['api_ms']['tree']:.0f} ms; load {r['load_avg']['before'][0]:.1f} -> {r['load_avg']['after'][0]:.1f}")
    return 0 if r["within_1s"] else 1


if __name__ == "__main__":
    sys.exit(main())
