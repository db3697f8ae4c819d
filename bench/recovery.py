#!/usr/bin/env python3
"""Recovery benchmark: agent traces, injected faults, and how each method recovers.

    python -m bench.recovery [--quick] [--traces DIR] [--methods chat-only,replay,full,crabd-fs,crabd]
                             [--faults boundary,mid-turn,daemon|none] [--time-scale 0.05]
                             [--json] [--out DIR]
    python -m bench.recovery --scale 1,4,16,32 [--scale-trace NAME] [--json] [--out DIR]
    (or: crabd bench recovery ...)

For every trace (bench/traces/*.json, format in README.md "Traces"):
1. a fault-free run on a bare runtime sandbox (no daemon, no checkpoints) is
   the reference: its checks and the digests of its state paths are what a
   correct recovery must reach, and its time is the baseline of every
   method's overhead;
2. per method, a fault-free run measures checkpoint bytes and latencies,
   stalls, SKIP turns and the end-to-end time;
3. per fault point and method, the trace runs to the fault, the fault hits,
   the method recovers, the trace goes on; correct = checks pass and every
   state digest equals the reference's.

Methods: `chat-only` (a fresh sandbox from the image with the task's files and
setup, then the next turn: a framework that saved only the transcript),
`replay` (the same, then every earlier turn re-run, without LLM waits),
`full` (`crabd serve --capture full`: every turn an FS snapshot and a CRIU
dump, through the same snapshots and de-duplicating, compressing image store
as crabd, and counted the same way: the fair baseline, see "Bytes" below),
`crabd-fs` (`--capture fs-only`: never process images), `crabd`
(`--capture auto`). The crabd methods recover on their own: the
agent waits for the daemon's `sandbox.rolled_back` event and goes on after
the turn of the checkpoint it restored (re-issuing later commands, as an
agent that keeps its transcript would; an unknown turn means the interrupted
turn's own partial checkpoint, and the agent retries that turn).

Faults (`--faults`):
- `boundary`: kill -9 of every process of the sandbox in the LLM wait after
  turn k, once turn k's checkpoint is durable;
- `mid-turn`: the same kill at a seeded random instant inside turn k's
  command (20-80 % of its fault-free duration); the agent retries turn k;
- `daemon`: kill -9 of crabd right after turn k's reply, while its
  checkpoint is being captured, then a restart. Then the state is checked
  three times against the per-turn reference digests (a bare run with a
  digest after every turn, `recovery_chain.reference`): the live sandbox
  (it kept running: turn k's state), a rollback to the recovery target
  (`rollback` with no checkpoint: the newest complete checkpoint, what
  automatic recovery picks) and a rollback to an older checkpoint (the
  newest one before the target's turn); the agent goes on from the older
  one. Each check is in the run's `rollback_checks`; a failed one makes the
  run wrong even if the end state is right. chat-only and replay own no
  daemon: for them the process that owned the sandbox died, so the sandbox
  is lost, which is the `boundary` case.
Full mode: every fault at every turn k. `--quick`: at most 3 traces (a fixed
list), one fault each in rotation (with fewer traces than faults, a trace
takes several); k = the middle turn (boundary), the
longest command of the middle third (mid-turn), the first turn from the
middle on whose plan is not SKIP in crabd's run (daemon).

Bytes: each daemon method starts with an empty process-image store (the
daemon is stopped and the store's chunks collected), so no method
de-duplicates against another's images. `full` is what one would ship as
"checkpoint everything every turn" with the machinery crabd has: a
copy-on-write snapshot of the files and a CRIU dump into the chunked, zstd,
de-duplicated store at every turn, its bytes counted exactly as crabd's are
(the snapshot's bytes over its parent + the store's new bytes). So
`bytes_vs_full_pct` is what crabd's plans save over dumping everything, and
nothing else. The naive figure is kept beside it (`bytes_vs_full_raw_pct`,
`full.bytes_naive_raw`): per `full` checkpoint, the raw CRIU image plus a
tar of every file that differs from the image, as `docker commit` /
`podman checkpoint --export` per turn would write; computed after the run
(untimed) from the checkpoint's diff against the sandbox's image and the
image store's manifest, with tar's own header and padding sizes.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import Any

from bench import recovery_chain as chain
from bench.recovery_report import inspector_fields, progress, summarize, write_out
from bench.recovery_runs import (
    DAEMON_METHODS,
    FAULTS,
    METHODS,
    ROOT,
    Bench,
    RunRecord,
    Verdict,
    longest_middle_turn,
    pick_traces,
    plan_runs,
)
from bench.recovery_scale import run_scale
from crabd.errors import CrabdError
from crabd.traces import Trace, load_traces


def parser() -> argparse.ArgumentParser:
    """The benchmark's options (also `crabd bench NAME --help`)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="at most 3 traces, one fault each in rotation")
    ap.add_argument("--traces", default=str(ROOT / "bench" / "traces"))
    ap.add_argument("--trace", action="append", default=[], help="only these traces (by name; repeatable)")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--faults", default=",".join(FAULTS), help="boundary,mid-turn,daemon or none")
    ap.add_argument("--time-scale", type=float, default=0.05, help="multiplier of the traces' LLM waits")
    ap.add_argument("--chain", action="store_true",
                    help="every fault point of every trace, chained: one run per trace, fault and crabd method "
                         "(bench/recovery_chain.py)")
    ap.add_argument("--reps", type=int, default=1,
                    help="rounds of fault-free runs (bare and each daemon method, interleaved); "
                         "the overhead is taken from the per-trace medians")
    ap.add_argument("--scale", default=None, help="run the scale benchmark instead: numbers of concurrent sandboxes")
    ap.add_argument("--scale-trace", default="calc-repair", help="the trace every sandbox runs in --scale")
    ap.add_argument("--inspector", choices=("bpf", "proc"), default="bpf",
                    help="the daemon's turn inspector (proc: no BPF compile at each daemon start; for tests)")
    ap.add_argument("--json", action="store_true", help="print the results as one JSON line")
    ap.add_argument("--out", default=None, help="directory for results.json, report.md and PNG plots")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    given = sys.argv[1:] if argv is None else argv   # written into report.md
    if os.geteuid() != 0:
        raise SystemExit("the recovery benchmark needs root (it runs crabd and runc sandboxes)")
    # kill/SIGTERM: unwind like Ctrl-C, so that sandboxes, daemons and mounts go
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    unknown = set(methods) - set(METHODS)
    if unknown:
        raise SystemExit(f"unknown methods {sorted(unknown)}; known: {', '.join(METHODS)}")
    faults = [] if a.faults.strip() == "none" else [f.strip() for f in a.faults.split(",") if f.strip()]
    if set(faults) - set(FAULTS):
        raise SystemExit(f"unknown faults {sorted(set(faults) - set(FAULTS))}; known: {', '.join(FAULTS)} or none")
    traces = load_traces(a.traces)
    if a.trace:
        missing = set(a.trace) - {t.name for t in traces}
        if missing:
            raise SystemExit(f"no traces named {sorted(missing)} in {a.traces}")
        traces = [t for t in traces if t.name in a.trace]
    t_start = time.monotonic()
    b = Bench(a)
    if a.scale:
        ns = [int(x) for x in a.scale.split(",") if x.strip()]
        trace = next((t for t in traces if t.name == a.scale_trace), None)
        if trace is None:
            raise SystemExit(f"no trace {a.scale_trace!r} in {a.traces}")
        try:
            b.prepare([trace])
            scale = run_scale(b, trace, ns)
        finally:
            b.close()
        result: dict[str, Any] = {"methods": {}, "scale": scale, "scale_trace": trace.name,
                                  "time_scale": a.time_scale, "seconds": round(time.monotonic() - t_start, 1)}
        write_out(result, a, given)
        return 0

    traces = pick_traces(traces, a.quick)
    if a.chain:
        result = run_chained(b, traces, methods, faults)
        result["seconds"] = round(time.monotonic() - t_start, 1)
        write_out(result, a, given)
        return 0 if all(m["end_correct"] == m["runs"] for f in result["chain"].values() for m in f.values()) else 1
    order = [m for m in DAEMON_METHODS if m in methods] + [m for m in methods if m not in DAEMON_METHODS]
    fault_runs = plan_runs(traces, faults, a.quick)
    reps = max(1, a.reps)
    total = reps * len(traces) * (1 + sum(m in DAEMON_METHODS for m in methods)) + len(fault_runs) * len(methods)
    records: list[RunRecord] = []
    refs: dict[str, tuple[RunRecord, Verdict]] = {}
    with progress(total) as bar:
        def step(rec: RunRecord) -> None:
            records.append(rec)
            what = f"{rec.method} {rec.trace}" + (f" {rec.fault}@{rec.k}" if rec.fault else " fault-free")
            bar.advance(what + ("" if rec.correct is None else " ok" if rec.correct else " WRONG"))
        try:
            b.prepare(traces)
            # --reps N: the fault-free runs N times, interleaved (bare, then each
            # daemon method, again and again), so that the host's drift hits
            # every method alike; the fault runs come once, in the last round.
            for rep in range(reps):
                for t in traces:
                    bar.describe(f"reference {t.name}" + (f" (round {rep + 1}/{reps})" if reps > 1 else ""))
                    rec, v = b.run_bare(t, "reference")
                    rec.rep = rep
                    rec.correct = b.correct(t, v, refs[t.name][1] if t.name in refs else v)
                    if not rec.correct:
                        raise SystemExit(f"trace {t.name}: its checks fail even without a fault "
                                         f"(or its state differs between fault-free runs): {v[0]}")
                    refs.setdefault(t.name, (rec, v))
                    step(rec)
                    if rep == reps - 1 and t.name not in b.step_digests and any(
                            ft is t and f == "daemon" for ft, f, _ in fault_runs) and set(methods) & set(DAEMON_METHODS):
                        # the daemon fault's rollbacks are checked against the
                        # state after each turn: an untimed bare run with a digest
                        # after every turn (before any daemon runs: a restarted
                        # daemon would reap a bare sandbox it does not know)
                        bar.describe(f"reference {t.name}: a digest after every turn")
                        b.step_digests[t.name] = chain.reference(b, t)[0]
                for m in order:
                    last = rep == reps - 1
                    if m not in DAEMON_METHODS and not last:
                        continue
                    if m in DAEMON_METHODS:
                        b.serve_method(m)
                    for t in traces:
                        ref, v = refs[t.name]
                        if m in DAEMON_METHODS:
                            bar.describe(f"{m} {t.name} fault-free")
                            rec, got = b.run_daemon(t, m)
                            rec.rep = rep
                            rec.correct = b.correct(t, got, v)
                            step(rec)
                        for (ft, f, k) in fault_runs if last else []:
                            if ft is not t:
                                continue
                            if k == -1:
                                k = longest_middle_turn(ref)
                            if f == "daemon" and k is None and m not in DAEMON_METHODS:
                                k = b.k_daemon.get(t.name, len(t.turns) // 2)
                            if m in DAEMON_METHODS and f == "daemon" and b.unsized:
                                # A restart queues the sizing still pending with the
                                # raw image bytes (Daemon._resize_unsized), not the
                                # bytes the store wrote: count the kept fault-free
                                # runs before this fault kills the daemon.
                                bar.describe(f"{m}: waiting for checkpoint sizes before the daemon fault")
                                b.finish_sizing()
                            bar.describe(f"{m} {t.name} {f}@{k if k is not None else 'auto'}")
                            try:
                                if m in DAEMON_METHODS:
                                    rec, got = b.run_daemon(t, m, f, k, ref, quick=a.quick and f == "daemon")
                                else:
                                    rec, got = b.run_bare(t, m, f, k, ref)
                                # right = the end state, and every state checked on the way
                                rec.correct = b.correct(t, got, v) and all(ch["ok"] for ch in rec.rollback_checks)
                            except (CrabdError, RuntimeError) as e:
                                # a recovery that breaks the session is a wrong
                                # recovery, reported; the other runs go on
                                rec = RunRecord(t.name, m, f, k if k is not None else b.k_daemon.get(t.name),
                                                correct=False, inspector=b.inspector_used if m in DAEMON_METHODS
                                                else "", note=f"the run failed: {type(e).__name__}: {e}")
                            step(rec)
                    if m in DAEMON_METHODS:
                        bar.describe(f"{m}: waiting for checkpoint sizes")
                        b.finish_sizing()
                        b.stop_daemon()
        finally:
            b.close()
    result = summarize(records, methods, faults, traces, a)
    result["seconds"] = round(time.monotonic() - t_start, 1)
    write_out(result, a, given)
    return 0


def run_chained(b: Bench, traces: list[Trace], methods: list[str], faults: list[str]) -> dict[str, Any]:
    """--chain: per trace a reference with a digest after every turn, then per
    crabd method and fault one run with the fault at every point."""
    dms = [m for m in DAEMON_METHODS if m in methods]
    if not dms or not faults:
        raise SystemExit("--chain runs the crabd methods (crabd, crabd-fs, full) with at least one fault")
    records: list[chain.ChainRecord] = []
    with progress(len(traces) * (1 + len(dms) * len(faults))) as bar:
        try:
            b.prepare(traces)
            refs = {}
            for t in traces:
                bar.describe(f"reference {t.name} (a digest after every turn)")
                refs[t.name] = chain.reference(b, t)
                b.step_digests[t.name] = refs[t.name][0]   # the daemon fault's rollback checks
                bar.advance(f"reference {t.name}: {len(t.turns)} turns")
            for m in dms:
                b.serve_method(m)
                for t in traces:
                    for f in faults:
                        bar.describe(f"{m} {t.name} {f} at every turn")
                        rec = chain.run_chain(b, t, m, f, *refs[t.name])
                        records.append(rec)
                        bad = [p.k for p in rec.points if not p.state_ok]
                        bar.advance(f"{m} {t.name} {f}: {len(rec.points)} points, "
                                    f"{len(rec.points) - len(bad)} right" + (f" (wrong at {bad})" if bad else "")
                                    + ("; end ok" if rec.correct else "; END WRONG")
                                    + (f"; {rec.error}" if rec.error else ""))
                b.stop_daemon()
        finally:
            b.close()
    return {"methods": {}, "chain": chain.summarize(records, traces), "traces": [t.name for t in traces],
            "faults": faults, "time_scale": b.a.time_scale,
            **inspector_fields([r.inspector for r in records], b.a.inspector),
            "chain_runs": chain.records_dict(records)}


if __name__ == "__main__":
    sys.exit(main())
