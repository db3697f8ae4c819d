"""The recovery benchmark's scale run: N sandboxes run one trace at the same
time through one daemon, with the host-scoped scheduler and without it
(`crabd serve --no-scheduler`: every checkpoint starts at once). Fault-free;
it measures what concurrency does to the stall (the time a turn waits for
the previous turn's capture), the total time and the bytes written."""

from __future__ import annotations

import threading
import time
from typing import Any

from bench._stats import percentile, quantiles
from bench.recovery_report import progress
from bench.recovery_runs import Bench


def run_scale(b: Bench, trace: Any, ns: list[int]) -> list[dict[str, Any]]:
    out = []
    with progress(2 * len(ns)) as bar:
        for sched in (True, False):
            b.serve((["--capture", "auto"] if b.capture_flag else []) + ([] if sched else ["--no-scheduler"]))
            for n in ns:
                bar.describe(f"scale {n} sandboxes, scheduler {'on' if sched else 'off'}")
                boxes = [b.daemon_box(trace.image) for _ in range(n)]
                try:
                    for box in boxes:   # the task's files and setup: not measured
                        b.start(trace, box)
                    stalls: list[list[float]] = [[] for _ in boxes]
                    errors: list[str] = []

                    def agent(i: int) -> None:
                        try:
                            for j, turn in enumerate(trace.turns):
                                r = boxes[i].run(turn.run)
                                stalls[i].append(r["stall_ms"])
                                b.wait(trace, j)
                        except Exception as e:  # reported, not hidden
                            errors.append(f"sandbox {i}: {e}")

                    threads = [threading.Thread(target=agent, args=(i,)) for i in range(n)]
                    t0 = time.monotonic()
                    for th in threads:
                        th.start()
                    for th in threads:
                        th.join()
                    seconds = time.monotonic() - t0
                    total_bytes = 0
                    for box in boxes:
                        total_bytes += sum(c["bytes"] or 0 for c in b.wait_durable(box.sid, sized=True, timeout=60)
                                           if c["state"] == "committed")
                    xs = [x for s in stalls for x in s]
                    out.append({"n": n, "scheduler": sched, "stall_ms": quantiles(xs),
                                "seconds": round(seconds, 2), "bytes": total_bytes, "errors": errors})
                    bar.advance(f"scale {n} scheduler {'on' if sched else 'off'}: stall p99 {percentile(xs, 99, 3)} ms, "
                                f"{seconds:.1f} s" + (f", {len(errors)} errors" if errors else ""))
                finally:
                    for box in boxes:
                        try:
                            box.destroy()
                        except Exception:
                            pass
            b.stop_daemon()
    return out
