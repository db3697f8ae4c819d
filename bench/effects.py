"""Effects ledger benchmark: duplicated external effects under crashes and
rollbacks, with and without the ledger, and what the ledger costs per call.

    crabd bench effects [--sessions N] [--turns T] [--seed S] [--quick] [--json]

A session is a scripted agent (seeded) in a busybox sandbox: every turn is an
exec, and every turn also makes one external call (`pay` or `mail`, to a
counting HTTP service on 127.0.0.1, outside the sandbox) whose request id is
a fresh UUID on every attempt, as an LLM regenerating its tool call would
make it. Two faults per session:
  - crash: at one call, crabd is killed (-9) after the service executed the
    call and before its receipt was recorded; crabd is restarted and the
    agent retries the call (new UUID);
  - rollback: after the last turn the sandbox is rolled back to turn 1 (to
    the oldest committed turn when the crash discarded turn 1's checkpoint,
    whose capture was in flight) and the agent re-runs the later turns,
    regenerating every call (new UUIDs, same arguments).
The `ledger` agent goes through intent / commit / reconcile; the `naive`
agent calls the service on every attempt (same schedule, no ledger). The
service counts executions per intended operation (a bench-only header, which
the ledger never sees). Duplicate-effect rate = extra executions / intended
operations; lost = intended operations never executed (must stay 0 too).

Needs root (runc). The daemon runs with the /proc inspector
(CRABD_INSPECTOR=proc): this bench is about the ledger, not the inspector.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from bench._stats import percentile
from crabd.testing import DaemonHandle, cleanup_state_dir, ensure_busybox_image


class Service:
    """The external system: executes every POST, remembers results by key."""

    def __init__(self) -> None:
        self.by_key: dict[str, dict[str, Any]] = {}
        self.executions: dict[str, int] = {}  # intended operation -> times executed
        lock = threading.Lock()
        svc = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a: Any) -> None:
                pass

            def _reply(self, code: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    logical = self.headers["X-Intended-Op"]
                    svc.executions[logical] = svc.executions.get(logical, 0) + 1
                    r = {"id": f"op-{sum(svc.executions.values())}", "args": body}
                    svc.by_key[self.headers["Idempotency-Key"]] = r
                self._reply(200, r)

            def do_GET(self) -> None:
                got = svc.by_key.get(self.path.rsplit("/", 1)[-1])
                self._reply(200 if got else 404, got or {})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.server.server_port}", trust_env=False, timeout=30)

    def call(self, logical: str, key: str, args: dict[str, Any]) -> dict[str, Any]:
        r = self.http.post("/ops", json=args, headers={"Idempotency-Key": key, "X-Intended-Op": logical})
        r.raise_for_status()
        return r.json()

    def lookup(self, key: str) -> dict[str, Any] | None:
        r = self.http.get(f"/ops/{key}")
        return r.json() if r.status_code == 200 else None


def busybox_state(base: str) -> Path:
    from crabd.runtime import Runtime
    st = Path(tempfile.mkdtemp(prefix="crabd-bench-effects-", dir=base))
    ensure_busybox_image(Runtime(st))
    return st


class Session:
    def __init__(self, n: int, turns: int, rng: random.Random) -> None:
        self.n, self.turns, self.rng = n, turns, rng
        self.crash_turn = rng.randint(1, turns)
        self.calls = {t: ("pay" if t % 2 else "mail",
                          {"amount": rng.randint(1, 500), "to": f"acct-{rng.randint(1, 99)}", "turn": t})
                      for t in range(1, turns + 1)}

    def logical(self, t: int) -> str:
        return f"s{self.n}-t{t}"

    def new_id(self) -> str:
        return str(uuid.UUID(int=self.rng.getrandbits(128)))


def run_naive(s: Session, svc: Service, rerun_from: int) -> None:
    """Same schedule, no ledger: every attempt is executed."""
    def attempt(t: int) -> None:
        op, args = s.calls[t]
        rid = s.new_id()
        svc.call(s.logical(t) + "-naive", rid, dict(args, request_id=rid))
    for t in range(1, s.turns + 1):
        attempt(t)
        if t == s.crash_turn:
            attempt(t)  # the receipt was lost with the crash: the agent retries
    for t in range(rerun_from, s.turns + 1):
        attempt(t)  # after the rollback, regenerated calls


def run_ledger(s: Session, svc: Service, d: DaemonHandle, lat: dict[str, list[float]]) -> tuple[dict[str, int], int]:
    c = d.client()
    sid = c.create_sandbox("busybox")["id"]
    decisions: dict[str, int] = {}
    crashed = False

    def call(t: int) -> None:
        nonlocal c, crashed
        op, args = s.calls[t]
        while True:
            rid = s.new_id()
            t0 = time.perf_counter()
            dec = c.effect_intent(sid, op, key=rid, args=dict(args, request_id=rid))
            lat["intent"].append(time.perf_counter() - t0)
            decisions[dec["decision"]] = decisions.get(dec["decision"], 0) + 1
            if dec["decision"] == "replay":
                return
            if dec["decision"] == "reconcile":  # check the outside world by the matched effect's key
                found = svc.lookup(dec["match"]["key"])
                c.effect_reconcile(dec["matched"], "committed" if found else "failed", receipt=found)
                continue
            assert dec["decision"] == "execute", dec
            r = svc.call(s.logical(t), rid, dict(args, request_id=rid))
            if t == s.crash_turn and not crashed:
                crashed = True
                d.kill9()
                d.start()
                c = d.client()
                continue  # the agent retries the call
            t0 = time.perf_counter()
            c.effect_commit(dec["effect"]["id"], receipt=r, result_digest=r["id"])
            lat["commit"].append(time.perf_counter() - t0)
            return

    for t in range(1, s.turns + 1):
        c.exec(sid, f"echo turn {t} >> /root/log")
        call(t)
    # Back to turn 1's state; when the crash discarded that checkpoint (its
    # capture was in flight), to the oldest committed one.
    cks = [k for k in c.checkpoints(sid) if k["state"] == "committed"]
    target = min((k for k in cks if k["turn"] >= 1), key=lambda k: k["seq"], default=cks[0])
    c.rollback(sid, target["id"])
    for t in range(target["turn"] + 1, s.turns + 1):
        c.exec(sid, f"echo again {t} >> /root/log")
        call(t)
    c.delete_sandbox(sid)
    return decisions, target["turn"] + 1


def turn_overhead(base: str, n: int = 200) -> dict[str, float]:
    """What the budget adds to every exec: Ledger.begin_turn (one synchronous
    SQLite commit) on a store in `base`, n times."""
    from crabd.effects import Ledger
    from crabd.store import Store
    d = tempfile.mkdtemp(prefix="crabd-bench-ledger-", dir=base)
    st = Store(d)
    try:
        lg, xs = Ledger(st), []
        for _ in range(n):
            t0 = time.perf_counter()
            lg.begin_turn("lineage", "sandbox")
            lg.add_wall("lineage", 0.1)
            xs.append(time.perf_counter() - t0)
        return {"p50": pct(xs, 0.5), "p99": pct(xs, 0.99), "mean": round(statistics.mean(xs) * 1000, 2)}
    finally:
        st.close()
        shutil.rmtree(d)


def pct(xs: list[float], q: float) -> float:
    """The nearest-rank percentile of bench/_stats.py (q a fraction) of seconds, in ms (0.0: no samples)."""
    v = percentile(xs, q * 100)
    return round(v * 1000, 2) if v is not None else 0.0


def parser() -> argparse.ArgumentParser:
    """The benchmark's options (also `crabd bench NAME --help`)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=None, help="sessions (default 6; --quick: 2)")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--state-base", default="/var/tmp")
    ap.add_argument("--json", action="store_true")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    if os.geteuid() != 0:
        print("crabd bench effects needs root (it runs crabd and runc sandboxes)", file=sys.stderr)
        return 2
    sessions = a.sessions or (2 if a.quick else 6)
    rng = random.Random(a.seed)
    svc = Service()
    st = busybox_state(a.state_base)
    d = DaemonHandle(st, env={"CRABD_INSPECTOR": "proc"})
    lat: dict[str, list[float]] = {"intent": [], "commit": []}
    decisions: dict[str, int] = {}
    t0 = time.monotonic()
    try:
        d.start()
        for n in range(sessions):
            s = Session(n, a.turns, rng)
            got, rerun_from = run_ledger(s, svc, d, lat)
            run_naive(s, svc, rerun_from)
            for k, v in got.items():
                decisions[k] = decisions.get(k, 0) + v
    finally:
        d.stop()
        cleanup_state_dir(st)
    intended = sessions * a.turns
    per_turn = turn_overhead(a.state_base)
    res: dict[str, Any] = {"sessions": sessions, "turns": a.turns, "seed": a.seed, "intended_ops": intended,
                           "duration_s": round(time.monotonic() - t0, 1), "decisions": decisions,
                           "intent_ms": {"p50": pct(lat["intent"], 0.5), "p99": pct(lat["intent"], 0.99),
                                         "mean": round(statistics.mean(lat["intent"]) * 1000, 2)},
                           "commit_ms": {"p50": pct(lat["commit"], 0.5), "p99": pct(lat["commit"], 0.99)},
                           "per_exec_budget_ms": per_turn}
    for agent, suffix in (("ledger", ""), ("naive", "-naive")):
        ex = [svc.executions.get(f"s{n}-t{t}{suffix}", 0) for n in range(sessions) for t in range(1, a.turns + 1)]
        res[agent] = {"executions": sum(ex), "duplicates": sum(max(0, x - 1) for x in ex),
                      "lost": sum(1 for x in ex if x == 0),
                      "duplicate_rate": round(sum(max(0, x - 1) for x in ex) / intended, 3)}
    if a.json:
        print(json.dumps(res, indent=2))
    else:
        print(f"{sessions} sessions x {a.turns} turns, {intended} intended external operations "
              f"(per session: 1 kill -9 between a call and its receipt, 1 rollback to turn 1), {res['duration_s']} s")
        for agent in ("naive", "ledger"):
            r = res[agent]
            print(f"  {agent:6}  executed {r['executions']:4}  duplicates {r['duplicates']:4}  lost {r['lost']}  "
                  f"duplicate-effect rate {r['duplicate_rate']}")
        print(f"  ledger decisions {decisions}")
        print(f"  intent p50 {res['intent_ms']['p50']} ms  p99 {res['intent_ms']['p99']} ms;  "
              f"commit p50 {res['commit_ms']['p50']} ms  p99 {res['commit_ms']['p99']} ms (unix socket)")
        print(f"  per exec, the budget count: p50 {per_turn['p50']} ms  p99 {per_turn['p99']} ms "
              f"(one synchronous SQLite commit in {a.state_base})")
    return 0 if res["ledger"]["duplicates"] == 0 and res["ledger"]["lost"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
