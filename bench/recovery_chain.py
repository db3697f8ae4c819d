"""The recovery benchmark's chained mode (`--chain`): every fault point of a
trace in one run per fault kind and method.

Independent full mode runs the trace once per fault point (816 points over the
15 shipped traces, about 18 h on a 2-core host for all methods). A chained run
plays the trace once and injects the fault at every point of it in turn:
`boundary` and `daemon` after every turn k = 1..n-1, `mid-turn` inside every
turn k = 1..n (the retried turn is not hit again). After each recovery the
digest of the state paths must equal the reference's after the number of turns
the agent goes on from (`state_ok` per point), and at the end the trace's
checks pass and the final digest matches (`correct`). Faults stack: a
recovery that loses state fails its own point and, usually, the end.

The reference: one bare run (no daemon, no checkpoints) with the digest taken
after the task's setup and after every turn, untimed. Only the crabd methods
(crabd, crabd-fs, full) run chained: chat-only and replay have nothing to
recover from but the transcript, so stacking their faults measures nothing new.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from bench._stats import quantiles
from bench.recovery_runs import DIGEST_PY, DIGEST_SH, Bench, Box, RunRecord
from crabd.errors import CrabdError
from crabd.traces import Trace


@dataclass
class ChainPoint:
    k: int                  # the turn the fault hit (after it; inside it for mid-turn)
    resumed_at: int         # trace turns done when the agent went on
    state_ok: bool          # the state digest then == the reference's after `resumed_at` turns
    rollback_ms: float
    note: str = ""


@dataclass
class ChainRecord:
    trace: str
    method: str
    fault: str
    points: list[ChainPoint] = field(default_factory=list)
    correct: bool | None = None    # the checks pass and the final digest matches at the end
    seconds: float = 0.0
    error: str = ""
    inspector: str = ""            # the daemon's inspector (its health); "a, then b" if a restart changed it


def reference(b: Bench, t: Trace) -> tuple[list[str], RunRecord]:
    """Digests after the setup (index 0) and after every turn i (index i), and
    the turns' durations (the mid-turn clock), from one bare run."""
    ref = RunRecord(t.name, "reference")
    box = b.bare_box(t.image)
    try:
        b.start(t, box)
        digests = [b.digest(t, box)]
        for turn in t.turns:
            t1 = time.monotonic()
            box.run(turn.run)
            ref.durations.append(time.monotonic() - t1)
            digests.append(b.digest(t, box))
        ok, _ = b.verdict(t, box)
        ref.correct = b.correct(t, (ok, digests[-1]), ([], digests[-1]))
        if not ref.correct:
            raise SystemExit(f"trace {t.name}: its checks fail even without a fault: {ok}")
        return digests, ref
    finally:
        box.destroy()


def run_chain(b: Bench, t: Trace, method: str, fault: str, digests: list[str], ref: RunRecord) -> ChainRecord:
    assert b.dh is not None
    out = ChainRecord(t.name, method, fault, inspector=b.inspector_used)
    box = b.daemon_box(t.image)
    t0 = time.monotonic()
    try:
        pos_of = {0: 0}   # the daemon's turn number -> trace turns done after it
        for r in b.start(t, box):
            pos_of[r["turn"]] = 0
        n, pos, next_k = len(t.turns), 0, 1
        while pos < n:
            if fault == "mid-turn" and pos + 1 == next_k:
                since = b.last_seq(box.sid)
                timer = b.mid_turn_timer(t, next_k, ref, box.sid)
                b.killed_at = None
                sent = time.time()
                timer.start()
                tk = time.monotonic()
                replied, note = False, ""
                try:
                    r = box.run(t.turns[pos].run)
                    pos_of[r["turn"]] = pos + 1
                    replied, note = True, f"the command replied (exit {r['exit_code']})"
                    note += f" (reply {time.time() - sent:.3f} s after the request"
                except CrabdError:
                    pass
                timer.join()
                if replied:
                    note += f", kill at {b.killed_at - sent:.3f} s)" if b.killed_at else ")"
                turn = b.await_rollback(t, box.sid, since)
                ms = (time.monotonic() - tk) * 1000
                done = pos
                pos = pos_of.get(b.head_turn(box.sid), pos_of.get(turn, pos))
                if replied and pos == done + 1:
                    b.external(t, done, box, ledger=True)   # the agent saw the reply: it goes on with it
                out.points.append(_point(b, t, box, pos_of, next_k, pos, ms, digests, note, since))
                next_k += 1
                continue
            since_pre = b.last_seq(box.sid) if fault == "daemon" else 0
            r = box.run(t.turns[pos].run)
            pos_of[r["turn"]] = pos + 1
            b.external(t, pos, box, ledger=True)
            pos += 1
            done = pos - 1
            if fault in ("boundary", "daemon") and pos == next_k and pos < n:
                one = RunRecord(t.name, method, fault, pos)
                pos = b.inject(t, box, fault, r, pos_of, one, since_pre)
                pt = _point(b, t, box, pos_of, next_k, pos, one.rollback_ms or 0.0, digests,
                            one.note if fault == "daemon" else "", since_pre)
                bad = [ch for ch in one.rollback_checks if not ch["ok"]]
                if bad:   # daemon: a rollback after the restart reached a wrong state
                    pt.state_ok = False
                    pt.note += "; " + "; ".join(f"{ch['what']} {ch['checkpoint']}: {ch['error']}" for ch in bad)
                out.points.append(pt)
                next_k += 1
            b.wait(t, done)
        out.seconds = time.monotonic() - t0
        out.correct = b.correct(t, b.verdict(t, box), ([], digests[-1]))
    except (CrabdError, RuntimeError) as e:
        out.error = f"{type(e).__name__}: {e}"
        out.correct = False
    finally:
        if b.inspector_used != out.inspector:
            out.inspector += f", then {b.inspector_used}"
        b.outside.take()
        try:
            box.destroy()
        except CrabdError as e:
            out.error = out.error or f"destroying {box.sid}: {e}"
    return out


def _point(b: Bench, t: Trace, box: Box, pos_of: dict[int, int], k: int, pos: int, ms: float,
           digests: list[str], note: str, since: int) -> ChainPoint:
    r = box.run(["/bin/sh", "-c", DIGEST_SH, "digest", *t.state_paths], env={"CRABD_DIGEST_PY": DIGEST_PY})
    pos_of[r["turn"]] = pos   # the digest is an exec, so a turn too: a rollback to it goes on from here
    ok = r["stdout"].strip() == digests[pos]
    if not ok:   # what crabd restored, for the report: the newest checkpoints and the head
        assert b.dh is not None
        c = b.client()
        head = c.sandbox(box.sid)["head"]
        cks = sorted(c.checkpoints(box.sid, all=True), key=lambda x: x["seq"])[-6:]
        evs = [f"{e['seq']}:{e['kind']}:{(e.get('data') or {}).get('checkpoint', '')}@{e['ts']:.3f}"
               for e in c.events(since=since, sandbox=box.sid)]
        note += f"; events since the fault: {evs}"
        try:
            import shutil
            shutil.copy(b.state / "daemon.log", f"/tmp/crabd-chain-mismatch-{t.name}-{k}.log")
        except OSError:
            pass
        note += "; head " + head + "; newest: " + ", ".join(
            f"{x['id'].rsplit('-', 1)[-1]}(turn {x['turn']}->{pos_of.get(x['turn'], '?')} {x['plan']} {x['state']}"
            + (" died" if any("died" in y for y in x.get("reasons") or []) else "")
            + f" created {x.get('created_at', 0):.3f} {x.get('durations')})" for x in cks)
    return ChainPoint(k, pos, ok, round(ms, 1), note)


def points_planned(t: Trace, fault: str) -> int:
    return len(t.turns) if fault == "mid-turn" else len(t.turns) - 1


def summarize(records: list[ChainRecord], traces: list[Trace]) -> dict[str, Any]:
    planned = {t.name: t for t in traces}
    out: dict[str, Any] = {}
    for rec in records:
        m = out.setdefault(rec.method, {}).setdefault(rec.fault, {
            "runs": 0, "end_correct": 0, "points": 0, "points_planned": 0, "state_ok": 0,
            "wrong": [], "errors": [], "rollback_ms": [], "seconds": 0.0})
        m["runs"] += 1
        m["end_correct"] += bool(rec.correct)
        m["points"] += len(rec.points)
        m["points_planned"] += points_planned(planned[rec.trace], rec.fault)
        m["state_ok"] += sum(p.state_ok for p in rec.points)
        m["wrong"] += [f"{rec.trace}@{p.k}" for p in rec.points if not p.state_ok]
        if not rec.correct:
            m["wrong"].append(f"{rec.trace}: end state")
        if rec.error:
            m["errors"].append(f"{rec.trace}: {rec.error}")
        m["rollback_ms"] += [p.rollback_ms for p in rec.points]
        m["seconds"] += rec.seconds
    for faults in out.values():
        for m in faults.values():
            xs = m.pop("rollback_ms")
            m["rollback_ms"] = quantiles(xs)
            m["seconds"] = round(m["seconds"], 1)
            m["state_ok_pct"] = round(100 * m["state_ok"] / m["points"], 1) if m["points"] else None
    return out


def records_dict(records: list[ChainRecord]) -> list[dict[str, Any]]:
    return [asdict(r) for r in records]


def report_lines(result: dict[str, Any]) -> list[str]:
    lines = ["", "Chained faults: every fault point of every trace, one run per trace, fault and method "
             "(state checked after each recovery, checks and digest at the end):", "",
             "| method | fault | points (of planned) | state right after recovery | traces right at the end | "
             "recovery p50 / p99 ms | wrong |", "|---|---|---|---|---|---|---|"]
    for method, faults in result["chain"].items():
        for fault, m in faults.items():
            q = m["rollback_ms"]
            rb = "–" if q["p50"] is None else f"{q['p50']:.0f} / {q['p99']:.0f}"
            wrong = ", ".join(m["wrong"][:8]) + (" …" if len(m["wrong"]) > 8 else "") or "–"
            lines.append(f"| {method} | {fault} | {m['points']} ({m['points_planned']}) | "
                         f"{m['state_ok']} ({m['state_ok_pct']} %) | {m['end_correct']} of {m['runs']} | {rb} | "
                         f"{wrong} |")
    errors = [f"- {method} {fault}: {e}" for method, faults in result["chain"].items()
              for fault, m in faults.items() for e in m["errors"]]
    if errors:
        lines += ["", "Errors:", ""] + errors
    return lines


__all__ = ["ChainPoint", "ChainRecord", "reference", "run_chain", "summarize", "report_lines", "records_dict"]
