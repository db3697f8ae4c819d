#!/usr/bin/env python3
"""Cost of CrabdCheckpointSaver: what keeping chat and sandbox state together adds.

    crabd bench langgraph [--steps N] [--runs R] [--quick] [--json]

A LangGraph graph of N steps, each running one command in a busybox sandbox
(writes a file), runs R times with the graph state in LangGraph's
InMemorySaver (`plain`: the commands still go through crabd, so every exec is
a crabd turn) and R times with CrabdCheckpointSaver around an InMemorySaver
(`crabd`), interleaved so host load hits both alike. Reported:

* per-step overhead: (mean run time of `crabd` - `plain`) / N, in ms;
* time travel: time to the first value of `graph.stream(None, <config of step
  N/2>)` (the saver rolls the sandbox back to the step's crabd checkpoint);
* fork: `saver.fork_thread(<config of step N/2>, new)` (crabd fork + put).

(This file is not named langgraph.py: it would shadow the package.) Needs root and runc; one `crabd serve` child on a temporary state dir with the
/proc inspector (CRABD_INSPECTOR=proc). Images come from $CRABD_TEST_STATE_DIR
or /var/lib/crabd-test (busybox, made by the integration tests or setup-host).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TypedDict

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph

from bench._stats import median
from crabd.client import Client
from crabd.integrations.langgraph import CrabdCheckpointSaver
from crabd.runtime import Runtime
from crabd.testing import DaemonHandle, cleanup_state_dir

ROOT = Path(__file__).resolve().parent.parent

TEST_STATE = Path(os.environ.get("CRABD_TEST_STATE_DIR", "/var/lib/crabd-test"))


class State(TypedDict):
    n: int


def build(checkpointer: Any, c: Client, steps: int, sandbox: Any) -> Any:
    def step(state: State, config: RunnableConfig) -> dict[str, Any]:
        n = state["n"] + 1
        r = c.exec(sandbox(config), f"mkdir -p /work && echo step {n} > /work/f{n}")
        assert r["exit_code"] == 0, r["stderr"]
        return {"n": n}

    g = StateGraph(State)
    g.add_node("step", step)
    g.add_edge(START, "step")
    g.add_conditional_edges("step", lambda s: END if s["n"] >= steps else "step")
    return g.compile(checkpointer=checkpointer)


def parser() -> argparse.ArgumentParser:
    """The benchmark's options (also `crabd bench NAME --help`)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="--steps 8 --runs 2")
    ap.add_argument("--json", action="store_true")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    if a.quick:
        a.steps, a.runs = 8, 2
    src = Runtime(TEST_STATE).images
    if not src.exists("busybox"):
        print(f"busybox image missing in {TEST_STATE}: run the integration tests or scripts/setup-host",
              file=sys.stderr)
        return 2
    st = Path(tempfile.mkdtemp(prefix="crabd-bench-lg-", dir="/var/tmp"))
    Runtime(st).images.import_path(src.get("busybox").path, "busybox")
    d = DaemonHandle(st, env={"CRABD_INSPECTOR": "proc"})
    d.start()
    c = d.client()
    res: dict[str, list[float]] = {"plain": [], "crabd": [], "time_travel": [], "fork": []}
    try:
        for r in range(a.runs):
            sid = c.create_sandbox("busybox")["id"]
            plain = build(InMemorySaver(), c, a.steps, lambda _cfg: sid)
            t = time.monotonic()
            plain.invoke({"n": 0}, {"configurable": {"thread_id": f"p{r}"}})
            res["plain"].append(time.monotonic() - t)
            c.delete_sandbox(sid)

            saver = CrabdCheckpointSaver(c)
            sid = c.create_sandbox("busybox")["id"]
            saver.bind(f"c{r}", sid)  # made outside the timing, as for `plain`
            graph = build(saver, c, a.steps, saver.sandbox_for)
            cfg: RunnableConfig = {"configurable": {"thread_id": f"c{r}"}}
            t = time.monotonic()
            graph.invoke({"n": 0}, cfg)
            res["crabd"].append(time.monotonic() - t)
            mid = next(s for s in graph.get_state_history(cfg) if s.values.get("n") == a.steps // 2)
            t = time.monotonic()
            for _ in graph.stream(None, mid.config, stream_mode="values"):
                res["time_travel"].append(time.monotonic() - t)
                break
            t = time.monotonic()
            saver.fork_thread(mid.config, f"f{r}")
            res["fork"].append(time.monotonic() - t)
            saver.delete_thread(f"f{r}")
            saver.delete_thread(f"c{r}")
            c.delete_sandbox(sid)
    finally:
        for sb in c.sandboxes():
            c.delete_sandbox(sb["id"])
        d.stop()
        cleanup_state_dir(st)
    ms = lambda xs: round(median(xs) * 1000, 1)  # noqa: E731
    out = {
        "steps": a.steps, "runs": a.runs,
        "plain_run_ms_p50": ms(res["plain"]), "crabd_run_ms_p50": ms(res["crabd"]),
        "per_step_overhead_ms": round((statistics.mean(res["crabd"]) - statistics.mean(res["plain"]))
                                      * 1000 / a.steps, 1),
        "time_travel_ms_p50": ms(res["time_travel"]), "fork_thread_ms_p50": ms(res["fork"]),
        "load1": round(os.getloadavg()[0], 1),
    }
    if a.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:24s} {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
