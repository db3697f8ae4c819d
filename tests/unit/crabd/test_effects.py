"""Effects ledger: fingerprints, matching rules, the ledger and budgets on a
real SQLite store (no root)."""

from __future__ import annotations

import json
import random
import uuid

import pytest

from crabd.effects import (BudgetExceeded, Ledger, Prior, budget_problem, canonical_args, decide, effects_after,
                           fingerprint)
from crabd.errors import FailedPrecondition, InvalidArgument
from crabd.store import IntegrityError, SandboxRow, Store


# --- fingerprints ------------------------------------------------------------------------
def test_volatile_keys_dropped_at_any_depth_and_any_spelling():
    a = {"to": "bob@example.com", "body": "hi", "request_id": str(uuid.UUID(int=1)),
         "meta": {"traceId": "t1", "X-Request-Id": "r1", "timestamp": 1, "msg_uuid": "u1"}}
    b = {"to": "bob@example.com", "body": "hi", "requestId": str(uuid.UUID(int=2)),
         "meta": {"trace_id": "t2", "timestamp": 2, "msg_uuid": "u2"}}
    assert fingerprint(a) == fingerprint(b)
    assert canonical_args(a) == '{"body":"hi","meta":{},"to":"bob@example.com"}'


def test_meaningful_fields_are_kept_even_when_they_hold_uuids():
    acct_a, acct_b = str(uuid.UUID(int=10)), str(uuid.UUID(int=11))
    assert fingerprint({"account": acct_a, "amount": 5}) != fingerprint({"account": acct_b, "amount": 5})
    assert fingerprint({"user_id": "u1"}) != fingerprint({"user_id": "u2"})  # *_id is not volatile


def test_caller_named_volatile_keys():
    assert fingerprint({"x": 1, "attempt": 1}) != fingerprint({"x": 1, "attempt": 2})
    assert fingerprint({"x": 1, "attempt": 1}, ["attempt"]) == fingerprint({"x": 1, "attempt": 2}, ["Attempt"])


def test_canonical_form_rules():
    rng = random.Random(7)
    items = [("a", 1), ("b", "two"), ("c", [3, 4]), ("d", {"e": None})]
    for _ in range(5):
        rng.shuffle(items)
        assert fingerprint(dict(items)) == fingerprint({"a": 1, "b": "two", "c": [3, 4], "d": {}})
    assert fingerprint({"n": 1.0}) == fingerprint({"n": 1})
    assert fingerprint({"s": "  hello \n  world "}) == fingerprint({"s": "hello world"})
    assert fingerprint({"s": "e\u0301"}) == fingerprint({"s": "\u00e9"})       # NFC
    assert fingerprint({"opt": None, "x": 1}) == fingerprint({"x": 1})        # null = omitted
    assert fingerprint({"l": [1, 2]}) != fingerprint({"l": [2, 1]})           # order kept
    assert fingerprint({"s": "Bob"}) != fingerprint({"s": "bob"})             # case kept
    assert fingerprint({"b": True}) != fingerprint({"b": 1})
    assert fingerprint({"s": "Hi Bob"}) != fingerprint({"s": "Hello Bob"})    # no paraphrase matching


def test_bad_arguments_refused():
    with pytest.raises(InvalidArgument):
        fingerprint({"x": float("nan")})
    with pytest.raises(InvalidArgument):
        fingerprint({"x": object()})
    with pytest.raises(InvalidArgument):
        fingerprint({"k": 1, " k": 2})
    with pytest.raises(InvalidArgument):
        fingerprint({"s": "\ud800"})
    deep: list = []
    for _ in range(200):
        deep = [deep]
    with pytest.raises(InvalidArgument):
        fingerprint(deep)


# --- matching -----------------------------------------------------------------------------
def P(i: str, key: str | None, fp: str, state: str) -> Prior:
    return Prior(i, key, fp, state)


def test_decide_rules():
    assert decide([], "k", "f").action == "execute"
    d = decide([P("e1", "k", "f", "committed")], "k", "other")
    assert (d.action, d.match.id, d.by) == ("replay", "e1", "key")
    d = decide([P("e1", "k1", "f", "committed")], "k2", "f")
    assert (d.action, d.by) == ("replay", "fingerprint")
    assert decide([P("e1", "k1", "f", "committed")], "k2", "f", "allow").action == "execute"
    assert decide([P("e1", "k1", "f", "committed")], "k2", "f", "ask").action == "ask"
    assert decide([P("e1", "k1", "f", "committed")], "k2", "f", "ask", force=True).action == "execute"
    for st in ("unknown", "intent"):
        assert decide([P("e1", "k", "f", st)], "k", "f").action == "reconcile"
        assert decide([P("e1", "k", "f", st)], "k", "f", "allow").action == "execute"
    d = decide([P("e1", "k", "f", "failed")], "k", "f")
    assert (d.action, d.retry) == ("execute", True)
    # committed beats unknown beats failed; key beats fingerprint in the same state
    d = decide([P("e1", "k", "f", "failed"), P("e2", "x", "f", "unknown"), P("e3", "y", "f", "committed")], "k", "f")
    assert (d.action, d.match.id) == ("replay", "e3")
    d = decide([P("e1", "x", "f", "committed"), P("e2", "k", "g", "committed")], "k", "f")
    assert (d.match.id, d.by) == ("e2", "key")
    # no key: only the fingerprint can match
    assert decide([P("e1", None, "g", "committed")], None, "f").action == "execute"
    with pytest.raises(InvalidArgument):
        decide([], None, "f", "sometimes")


def test_effects_after_keeps_only_the_abandoned_stretch():
    effs = [{"id": "a", "checkpoint": "s-1", "branch": 0}, {"id": "b", "checkpoint": "s-2", "branch": 0},
            {"id": "c", "checkpoint": "s-1", "branch": 1}, {"id": "d", "checkpoint": "s-3", "branch": 1}]
    # head s-3 on branch 1 (s-2 -> rolled back to s-1 -> s-3), back to s-1
    assert [e["id"] for e in effects_after([("s-3", 1), ("s-1", 1)], effs)] == ["c", "d"]


def test_abandoned_line_stops_where_a_cross_branch_target_meets_the_head():
    from types import SimpleNamespace as C

    from crabd.effects import abandoned_line, seen_not_undone
    # s-0 - s-1 - s-2 - s-3 (branch 0); rolled back to s-1: s-1 - s-4 (branch 1), head s-4.
    out = {"external": False, "external_unknown": True}
    rows = {f"s-{i}": C(id=f"s-{i}", parent=p, branch=b, turn=i, effects=out)
            for i, p, b in ((0, None, 0), (1, "s-0", 0), (2, "s-1", 0), (3, "s-2", 0), (4, "s-1", 1))}
    line = abandoned_line("s-4", 1, "s-3", rows.get)
    assert (line.path, [c.id for c in line.lost], line.meets) == ([("s-4", 1), ("s-1", 1)], ["s-4"], "s-1")
    # Turn 1 (s-1) is the target's own past: not reported; before, the walk ran to the root.
    assert [e["checkpoint"] for e in seen_not_undone(line.lost)] == ["s-4"]
    same = abandoned_line("s-3", 0, "s-1", rows.get)   # the head's own line: back to the target
    assert (same.path, same.meets) == ([("s-3", 0), ("s-2", 0), ("s-1", 0)], "s-1")
    assert [e["turn"] for e in seen_not_undone(same.lost)] == [2, 3]
    gone = abandoned_line("s-9", 2, "s-3", rows.get)   # a head whose row is gone: nothing walked past it
    assert (gone.path, gone.lost, gone.meets) == ([("s-9", 2)], [], None)


def test_budget_problem():
    b = {"limits": {"turns": 2, "wall_s": None, "cost": 10}, "used": {"turns": 1, "wall_s": 9e9, "cost": 3}}
    assert budget_problem(b) is None
    b["used"]["turns"] = 2
    assert budget_problem(b)[0] == "turns"
    b["limits"]["turns"], b["used"]["cost"] = None, 10.0
    assert budget_problem(b)[0] == "cost"


# --- the ledger on a real store -------------------------------------------------------------
@pytest.fixture
def ledger(tmp_path):
    st = Store(tmp_path)
    st.add_sandbox(SandboxRow(id="s1", name="s1", image="busybox", fs_key="k", lineage="s1", head="s1-3",
                              branch=1, turn=3))
    yield Ledger(st), st
    st.close()


def test_intent_commit_replay_across_keys(ledger):
    lg, st = ledger
    sb = st.get_sandbox("s1")
    d = lg.intent(sb, "email.send", key="u1", args={"to": "bob", "request_id": "u1"}, postcondition="sent")
    assert d["decision"] == "execute"
    e = d["effect"]
    assert (e["state"], e["turn"], e["checkpoint"], e["branch"], e["verified"]) == ("intent", 3, "s1-3", 1, True)
    lg.finish(e["id"], "committed", receipt={"message_id": "m1"}, result_digest="r1")
    d2 = lg.intent(sb, "email.send", key="u2", args={"to": "bob", "request_id": "u2"})
    assert (d2["decision"], d2["matched"], d2["matched_by"], d2["receipt"]) == \
        ("replay", e["id"], "fingerprint", {"message_id": "m1"})
    assert lg.get(e["id"])["replays"] == 1
    assert lg.intent(sb, "email.other", key="u3", args={"to": "bob"})["decision"] == "execute"  # op matters
    lg.set_policy("s1", "email.send", "allow")
    assert lg.intent(sb, "email.send", key="u4", args={"to": "bob"})["decision"] == "execute"
    lg.set_policy("s1", "*", "ask")
    assert lg.policies("s1") == {"*": "ask", "email.send": "allow"}


def test_finished_effects_are_final_and_unknown_needs_reconcile(ledger):
    lg, st = ledger
    sb = st.get_sandbox("s1")
    e = lg.intent(sb, "pay", key="k", args={"amount": 5})["effect"]
    lg.finish(e["id"], "unknown", error="timeout")
    assert lg.intent(sb, "pay", key="k", args={"amount": 5})["decision"] == "reconcile"
    with pytest.raises(InvalidArgument):
        lg.finish(e["id"], "unknown", reconciled=True)
    assert lg.finish(e["id"], "failed", error="not found downstream", reconciled=True)["state"] == "failed"
    assert lg.finish(e["id"], "failed")["state"] == "failed"  # idempotent
    with pytest.raises(FailedPrecondition):
        lg.finish(e["id"], "committed")
    d = lg.intent(sb, "pay", key="k", args={"amount": 5})
    assert (d["decision"], d["retry"]) == ("execute", True)
    assert lg.budget("s1")["used"]["retries"] == 1


def test_restart_marks_in_flight_intents_unknown(ledger):
    lg, st = ledger
    e = lg.intent(st.get_sandbox("s1"), "pay", key="k", args={})["effect"]
    assert lg.mark_in_flight_unknown() == [(e["id"], "s1")]
    assert lg.get(e["id"])["state"] == "unknown"


def test_tampered_effect_is_not_replayed(ledger):
    lg, st = ledger
    sb = st.get_sandbox("s1")
    e = lg.intent(sb, "pay", key="k", args={"amount": 5})["effect"]
    lg.finish(e["id"], "committed", receipt={"id": "r"})
    st._db.execute("UPDATE effects SET receipt=? WHERE id=?", ('{"id": "forged"}', e["id"]))
    assert lg.get(e["id"])["verified"] is False
    with pytest.raises(IntegrityError):
        lg.intent(sb, "pay", key="k", args={"amount": 5})
    e2 = lg.intent(sb, "other", key="k", args={})["effect"]
    st._db.execute("UPDATE effects SET op='forged' WHERE id=?", (e2["id"],))
    with pytest.raises(IntegrityError):
        lg.finish(e2["id"], "committed")               # not re-signed, which would launder it
    assert lg.mark_in_flight_unknown() == []           # a restart skips it instead of failing


def test_budgets(ledger):
    lg, st = ledger
    assert lg.budget("s1")["limits"] == {"turns": None, "wall_s": None, "cost": None, "retries": None}
    lg.set_budget("s1", {"turns": 2, "retries": 0})
    lg.begin_turn("s1", "s1")
    lg.begin_turn("s1", "s1")
    with pytest.raises(BudgetExceeded) as ei:
        lg.begin_turn("s1", "s1")
    assert ei.value.code == "budget_exceeded" and "--turns" in ei.value.fix
    assert lg.budget("s1")["used"]["turns"] == 2  # a refused turn is not counted
    lg.set_budget("s1", {"turns": None})
    lg.begin_turn("s1", "s1")
    lg.charge("s1", cost=4.5, wall_s=1.25)
    b = lg.budget("s1")
    assert b["used"] == {"turns": 3, "wall_s": 1.25, "cost": 4.5, "retries": 0}
    assert b["limits"]["retries"] == 0
    e = lg.intent(st.get_sandbox("s1"), "pay", key="k", args={})["effect"]
    lg.finish(e["id"], "failed")
    with pytest.raises(BudgetExceeded):
        lg.intent(st.get_sandbox("s1"), "pay", key="k", args={})
    with pytest.raises(InvalidArgument):
        lg.set_budget("s1", {"tokens": 3})
    st._db.execute("UPDATE budgets SET used_turns=0")
    with pytest.raises(IntegrityError):
        lg.budget("s1")


def test_unmanaged_effects_are_recorded_but_never_matched(ledger):
    lg, st = ledger
    sb = st.get_sandbox("s1")
    ids = lg.record_unmanaged(sb, turn=3, checkpoint="s1-2", reasons=["connect to 10.0.0.1:80 (wget)"], unknown=True)
    rows = lg.list("s1")
    assert [(r["op"], r["kind"], r["state"]) for r in rows] == \
        [("net.connect", "unmanaged", "committed"), ("unseen", "unmanaged", "unknown")]
    assert [r["id"] for r in rows] == ids
    with pytest.raises(FailedPrecondition):
        lg.finish(ids[1], "committed")
    pending = lg.intent(sb, "pay", key="k", args={})["effect"]["id"]
    rep = lg.rollback_report("s1", "s1", [("s1-3", 1), ("s1-2", 1)])
    assert [e["id"] for e in rep["committed_after"]] == ids   # seen, or possibly unseen: not undone
    assert [e["id"] for e in rep["unknown"]] == [pending]     # only managed effects get reconciled
    assert lg.rollback_report("s1", "s1", [("s1-3", 1)])["committed_after"] == []


# --- the API routes, in process (real Ledger and Daemon methods, no runtime) ------------------
def test_api_routes_and_input_errors(tmp_path):
    import asyncio

    import httpx

    from crabd.api import make_app
    from crabd.daemon import Daemon
    from crabd.daemon.events import EventBus

    st = Store(tmp_path)
    st.add_sandbox(SandboxRow(id="sb1", name="sb1", image="busybox", fs_key="k", lineage="sb1", head="sb1-1"))
    d = Daemon.__new__(Daemon)  # the ledger methods only: store, ledger, events
    d.store, d.ledger, d.events = st, Ledger(st), EventBus(st)
    app = make_app(d, token="t0123456789abcdef")

    async def go(*calls: tuple[str, str, dict | bytes | None]) -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://crabd:7411",
                                     headers={"authorization": "Bearer t0123456789abcdef"}) as c:
            return [await (c.request(m, p, content=j, headers={"content-type": "application/json"})
                           if isinstance(j, bytes) else c.request(m, p, json=j)) for m, p, j in calls]

    def one(m: str, p: str, j: dict | bytes | None = None) -> httpx.Response:
        return asyncio.run(go((m, p, j)))[0]

    r = one("POST", "/v1/sandboxes/sb1/effects/intent", {"op": "email.send", "key": "k1", "args": {"to": "bob"}})
    assert r.status_code == 200 and r.json()["decision"] == "execute", r.text
    eid = r.json()["effect"]["id"]
    assert one("POST", f"/v1/effects/{eid}/commit", {"receipt": {"id": "m1"}}).json()["state"] == "committed"
    r = one("POST", "/v1/sandboxes/sb1/effects/intent", {"op": "email.send", "key": "k2", "args": {"to": "bob"}})
    assert (r.json()["decision"], r.json()["receipt"]) == ("replay", {"id": "m1"})
    assert one("PUT", "/v1/sandboxes/sb1/effects/policies/email.send", {"policy": "ask"}).status_code == 200
    r = one("POST", "/v1/sandboxes/sb1/effects/intent", {"op": "email.send", "args": {"to": "bob"}})
    assert r.json()["decision"] == "ask"
    assert one("GET", "/v1/sandboxes/sb1/effects/policies").json()["policies"] == {"email.send": "ask"}
    assert [e["id"] for e in one("GET", "/v1/sandboxes/sb1/effects?state=committed").json()["effects"]] == [eid]
    assert one("PUT", "/v1/sandboxes/sb1/budget", {"turns": 5}).json()["limits"]["turns"] == 5
    assert one("POST", "/v1/sandboxes/sb1/budget/charge", {"cost": 2.5}).json()["used"]["cost"] == 2.5
    assert one("GET", "/v1/sandboxes/sb1/budget").json()["limits"] == {"turns": 5, "wall_s": None, "cost": None,
                                                                         "retries": None}
    kinds = [e.kind for e in st.events_since(0)]
    assert kinds == ["effect.intent", "effect.committed", "effect.replay", "effect.ask"]
    # errors: JSON with the category's status, never a 500
    for (m, p, j), status in [
        (("POST", f"/v1/effects/{eid}/fail", {}), 409),                       # already committed
        (("POST", "/v1/effects/eff-nope/commit", {}), 404),
        (("POST", "/v1/sandboxes/nope/effects/intent", {"op": "x"}), 404),
        (("POST", "/v1/sandboxes/sb1/effects/intent", {"op": ""}), 422),
        (("POST", "/v1/sandboxes/sb1/effects/intent", b'{"op": "x", "args": {"s": "\\ud800"}}'), 422),
        (("POST", "/v1/sandboxes/sb1/effects/intent", {"op": "x", "bogus": 1}), 422),
        (("POST", f"/v1/effects/{eid}/reconcile", {"outcome": "unknown"}), 422),
        (("PUT", "/v1/sandboxes/sb1/effects/policies/email.send", {"policy": "sometimes"}), 422),
        (("PUT", "/v1/sandboxes/sb1/budget", {"turns": -1}), 422),
        (("GET", "/v1/sandboxes/sb1/effects?state=done", None), 422),
    ]:
        r = one(m, p, j)
        assert r.status_code == status and "error" in r.json(), (p, j, r.status_code, r.text)
    st.close()


# --- the CLI, in process (its Client talks to the real routes through Starlette's TestClient) ---
def test_cli_effects_and_budget_commands(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import crabd.cli as cli

    st, client, _ = _in_process_clients(tmp_path)
    monkeypatch.setattr("crabd.client.Client", lambda socket: client)  # what the CLI builds
    run = CliRunner().invoke

    r = run(cli.app, ["effects", "intent", "sb1", "email.send", "--key", "k1", "--args", '{"to": "bob"}', "--json"])
    assert r.exit_code == 0, r.output
    eid = json.loads(r.output)["effect"]["id"]
    r = run(cli.app, ["effects", "commit", eid, "--receipt", '{"id": "m1"}', "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["state"] == "committed", r.output
    r = run(cli.app, ["effects", "intent", "sb1", "email.send", "--key", "k2", "--args", '{"to": "bob"}'])
    assert r.exit_code == 0 and r.output.startswith(f"replay (matches {eid} by fingerprint)"), r.output
    r = run(cli.app, ["effects", "ls", "sb1", "--json"])
    assert [e["id"] for e in json.loads(r.output)] == [eid]
    r = run(cli.app, ["effects", "policy", "sb1", "email.send", "allow", "--json"])
    assert json.loads(r.output) == {"email.send": "allow"}
    r = run(cli.app, ["budget", "set", "sb1", "--turns", "3", "--cost", "none", "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["limits"]["turns"] == 3, r.output
    r = run(cli.app, ["budget", "show", "sb1"])
    assert r.exit_code == 0 and "turns" in r.output
    # bad input: exit 1, the error and its fix, nothing recorded
    r = run(cli.app, ["effects", "intent", "sb1", "x", "--args", "{not json", "--json"])
    assert r.exit_code == 1 and json.loads(r.output)["error"]["code"] == "invalid_argument", r.output
    r = run(cli.app, ["budget", "set", "sb1", "--turns", "many", "--json"])
    assert r.exit_code == 1 and "--turns" in json.loads(r.output)["error"]["message"], r.output
    r = run(cli.app, ["effects", "fail", eid, "--json"])
    assert r.exit_code == 1 and json.loads(r.output)["error"]["code"] == "failed_precondition", r.output
    assert len(Ledger(st).list("sb1")) == 1
    st.close()


def _in_process_clients(tmp_path):
    """A store with sandbox sb1, and a Client and an AsyncClient talking to the real routes in process."""
    import httpx
    from fastapi.testclient import TestClient

    from crabd.api import make_app
    from crabd.client import AsyncClient, Client
    from crabd.daemon import Daemon
    from crabd.daemon.events import EventBus

    st = Store(tmp_path)
    st.add_sandbox(SandboxRow(id="sb1", name="sb1", image="busybox", fs_key="k", lineage="sb1", head="sb1-1"))
    d = Daemon.__new__(Daemon)
    d.store, d.ledger, d.events = st, Ledger(st), EventBus(st)
    app = make_app(d, token="t0123456789abcdef")
    auth = {"authorization": "Bearer t0123456789abcdef"}
    c = Client.__new__(Client)
    c.socket, c._http = "in-process", TestClient(app, base_url="http://crabd", headers=auth)
    ac = AsyncClient.__new__(AsyncClient)
    ac.socket, ac._http = "in-process", httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                                          base_url="http://crabd:7411", headers=auth)
    return st, c, ac


def test_effect_call_helper(tmp_path):
    import asyncio

    st, c, ac = _in_process_clients(tmp_path)
    ran: list[str] = []

    def run(receipt: dict):
        return lambda: ran.append(receipt["id"]) or receipt

    mail = {"to": "bob", "body": "hi"}
    r = c.effect_call("sb1", "email.send", dict(mail, request_id="u1"), run({"id": "m1"}), key="u1")
    assert (r["decision"], r["receipt"], r["effect"]["state"]) == ("execute", {"id": "m1"}, "committed")
    r = c.effect_call("sb1", "email.send", dict(mail, request_id="u2"), run({"id": "m2"}), key="u2")
    assert (r["decision"], r["receipt"]) == ("replay", {"id": "m1"}) and ran == ["m1"]

    def timeout():
        raise TimeoutError("no answer in 30 s")
    with pytest.raises(TimeoutError):
        c.effect_call("sb1", "pay", {"amount": 5}, timeout, key="p1")
    assert c.effects("sb1", op="pay")[0]["state"] == "unknown"          # a timeout is not a failure
    with pytest.raises(FailedPrecondition):                            # unknown outcome, no way to check
        c.effect_call("sb1", "pay", {"amount": 5}, run({"id": "x"}), key="p2")
    seen: list = []
    r = c.effect_call("sb1", "pay", {"amount": 5}, run({"id": "x"}), key="p2",
                      lookup=lambda k: seen.append(k) or {"id": "found"})
    assert (r["decision"], r["receipt"], seen, ran) == ("replay", {"id": "found"}, ["p1"], ["m1"])

    def refused():
        raise ValueError("card declined")
    with pytest.raises(ValueError):
        c.effect_call("sb1", "refund", {"amount": 1}, refused, failed_on=(ValueError,))
    assert c.effects("sb1", op="refund")[0]["state"] == "failed"
    assert c.effect_call("sb1", "refund", {"amount": 1}, run({"id": "r1"}))["decision"] == "execute"

    c.set_effect_policy("sb1", "email.send", "ask")
    with pytest.raises(FailedPrecondition) as ei:
        c.effect_call("sb1", "email.send", mail, run({"id": "m3"}))
    assert "force=True" in (ei.value.fix or "")

    async def arun() -> dict:
        return {"id": "a1"}

    async def go() -> tuple[dict, dict]:
        a = await ac.effect_call("sb1", "chat.post", {"text": "x"}, arun, key="a1")
        b = await ac.effect_call("sb1", "chat.post", {"text": "x"}, arun, key="a2")
        await ac.aclose()
        return a, b
    a, b = asyncio.run(go())
    assert (a["decision"], b["decision"], b["receipt"]) == ("execute", "replay", {"id": "a1"})
    st.close()


def test_wall_time_lands_with_the_next_budget_write(ledger):
    lg, st = ledger
    lg.add_wall("s1", 1.5)
    assert lg.budget("s1")["used"]["wall_s"] == 1.5             # shown at once
    assert Ledger(st).budget("s1")["used"]["wall_s"] == 0        # not written yet (a kill -9 loses it)
    lg.begin_turn("s1", "s1")                                   # written with the next turn's count
    assert Ledger(st).budget("s1")["used"] == {"turns": 1, "wall_s": 1.5, "cost": 0, "retries": 0}
    lg.set_budget("s1", {"wall_s": 2})
    lg.add_wall("s1", 1.0)
    with pytest.raises(BudgetExceeded) as ei:                   # 2.5 s used of 2: refused, not counted
        lg.begin_turn("s1", "s1")
    assert "--wall-s" in ei.value.fix
    assert Ledger(st).budget("s1")["used"]["wall_s"] == 2.5 and Ledger(st).budget("s1")["used"]["turns"] == 1
    lg.add_wall("s1", 0.25)
    lg.flush()
    assert Ledger(st).budget("s1")["used"]["wall_s"] == 2.75


def test_rollback_report_walks_the_abandoned_line(tmp_path):
    """Daemon._ledger_report on a checkpoint tree (the stretch from crabd.effects.abandoned_line): s-0 -> s-1 -> s-2 (branch 0),
    rolled back to s-1, then s-3 (branch 1); the head s-3 is rolled back to s-2,
    on the other line: only what was made on the stretch s-1 (branch 1) -> s-3 is
    reported, not what s-2's own history holds."""
    from crabd.daemon import Daemon
    from crabd.effects import abandoned_line
    from crabd.store import CheckpointRow

    st = Store(tmp_path)
    st.add_sandbox(SandboxRow(id="s", name="s", image="busybox", fs_key="k", lineage="s", head="s-3", branch=1))
    for seq, parent, branch in ((0, None, 0), (1, "s-0", 0), (2, "s-1", 0), (3, "s-1", 1)):
        st.add_checkpoint(CheckpointRow(id=f"s-{seq}", sandbox_id="s", seq=seq, parent=parent, branch=branch,
                                        turn=seq, plan="FS", state="committed"))
    d = Daemon.__new__(Daemon)
    d.store, d.ledger = st, Ledger(st)
    made = {}
    for name, head, branch in (("before_s2", "s-1", 0), ("after_rollback", "s-1", 1), ("after_s3", "s-3", 1),
                               ("old_line", "s-2", 0)):
        sb = SandboxRow(id="s", name="s", image="busybox", fs_key="k", lineage="s", head=head, branch=branch)
        e = d.ledger.intent(sb, "op", key=name, args={"n": name})["effect"]
        d.ledger.finish(e["id"], "committed")
        made[e["id"]] = name
    row = st.get_sandbox("s")

    def report(target: str) -> dict:
        return d._ledger_report("s", row, abandoned_line(row.head, row.branch, target, d._checkpoint_or_none).path)
    rep = report("s-2")
    assert sorted(made[e["id"]] for e in rep["committed_after"]) == ["after_rollback", "after_s3"]
    rep = report("s-0")
    assert sorted(made[e["id"]] for e in rep["committed_after"]) == ["after_rollback", "after_s3"]  # s-1 b0 line was left before
    st.close()
