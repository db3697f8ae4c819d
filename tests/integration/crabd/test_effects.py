"""Effects ledger and budgets against a real daemon (busybox image).

The external system is a tiny HTTP service in its own network namespace
(`ip netns` + a veth pair, removed after the module) that counts the
operations it executed per idempotency key; the test calls it from the host
side, through the ledger, the way an agent's tool runner would.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import httpx
import pytest

from crabd.client import AsyncClient
from crabd.effects import BudgetExceeded
from crabd.errors import FailedPrecondition

pytestmark = pytest.mark.needs("runc", "criu", "bpf", "busybox", "netns")

_SERVICE = textwrap.dedent('''
    import json, sys, threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    done, counts, lock = {}, {}, threading.Lock()

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a): pass
        def reply(self, code, body):
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        def do_POST(self):  # execute an operation (every POST counts: a duplicate is visible)
            key = self.headers["Idempotency-Key"]
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                counts[key] = counts.get(key, 0) + 1
                done[key] = {"id": "op-%d" % (sum(counts.values())), "op": self.path.strip("/"), "args": body}
                self.reply(200, done[key])
        def do_GET(self):
            if self.path == "/stats":
                return self.reply(200, {"counts": counts})
            got = done.get(self.path.rsplit("/", 1)[-1])  # /ops/<key>: reconcile by key
            self.reply(200 if got else 404, got or {"error": "no such operation"})

    ThreadingHTTPServer((sys.argv[1], int(sys.argv[2])), H).serve_forever()
''')


class Service:
    def __init__(self, url: str) -> None:
        self.url = url
        self.http = httpx.Client(base_url=url, timeout=10, trust_env=False)

    def call(self, op: str, key: str, args: dict) -> dict:
        r = self.http.post(f"/{op}", json=args, headers={"Idempotency-Key": key})
        r.raise_for_status()
        return r.json()

    def lookup(self, key: str) -> dict | None:
        r = self.http.get(f"/ops/{key}")
        return r.json() if r.status_code == 200 else None

    def counts(self) -> dict[str, int]:
        return self.http.get("/stats").json()["counts"]


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise AssertionError(f"ip {' '.join(args)} failed: {r.stderr.strip()} (needs root and iproute2: "
                             "run scripts/setup-host)")


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    pid = os.getpid()
    ns, host_if, ns_if = f"crabd-eff-{pid}", f"ceh{pid}", f"cen{pid}"
    net = f"10.213.{pid % 250}"
    script = tmp_path_factory.mktemp("svc") / "service.py"
    script.write_text(_SERVICE)
    proc = None
    for leftover in (["netns", "del", ns], ["link", "del", host_if]):  # of a run killed with this pid
        subprocess.run(["ip", *leftover], capture_output=True, timeout=30)
    try:
        _ip("netns", "add", ns)
        _ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        _ip("link", "set", ns_if, "netns", ns)
        _ip("addr", "add", f"{net}.1/30", "dev", host_if)
        _ip("link", "set", host_if, "up")
        _ip("-n", ns, "addr", "add", f"{net}.2/30", "dev", ns_if)
        _ip("-n", ns, "link", "set", ns_if, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, str(script), f"{net}.2", "8080"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        svc = Service(f"http://{net}.2:8080")
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"the test service exited: {proc.stderr.read().decode()[-1000:]}")
            try:
                svc.counts()
                break
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise AssertionError("the test service in its netns did not answer in 60 s") from None
                time.sleep(0.1)
        yield svc
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)  # takes the veth pair along
        subprocess.run(["ip", "link", "del", host_if], capture_output=True, timeout=30)


def _events(c, sid: str, kind: str) -> list[dict]:
    return [e for e in c.events(sandbox=sid) if e["kind"] == kind]


def test_crash_between_call_and_receipt_reconciles_by_key_and_keeps_the_budget(start_daemon, service):
    """kill -9 of crabd between an external call and its receipt: the retry
    reconciles by key, the service saw the operation once. The same crash
    does not reset the lineage's used-up turn budget, nor do a rollback and a
    fork after it. (The /proc inspector: this test needs no BPF, and the
    daemon starts twice.)"""
    rng = random.Random(9)
    d = start_daemon(env={"CRABD_INSPECTOR": "proc"})
    c = d.client()
    sid = c.create_sandbox("busybox")["id"]
    c.set_budget(sid, turns=2)
    t1 = c.exec(sid, "echo a > /root/f")
    c.exec(sid, "echo b >> /root/f")
    with pytest.raises(BudgetExceeded) as ei:
        c.exec(sid, "true")
    assert ei.value.code == "budget_exceeded" and "crabd budget set" in (ei.value.fix or "")

    key = f"order-{uuid.UUID(int=rng.getrandbits(128))}"
    args = {"amount": 42, "currency": "EUR", "request_id": str(uuid.UUID(int=rng.getrandbits(128)))}
    dec = c.effect_intent(sid, "payments.charge", key=key, args=args, postcondition="a charge exists for the key")
    assert dec["decision"] == "execute", dec
    eid = dec["effect"]["id"]
    receipt = service.call("charge", key, args)          # the external call happens ...
    d.kill9()                                            # ... and crabd dies before its receipt is recorded
    with pytest.raises(FailedPrecondition):
        c.effect_commit(eid, receipt=receipt)

    d.start()
    c = d.client()
    assert c.effect(eid)["state"] == "unknown"           # in flight across the crash: unknown, never failed
    assert any(e["data"]["effect"] == eid for e in _events(c, sid, "effect.unknown"))
    # Resume: the agent retries the call with a fresh request id; the ledger says reconcile first.
    retry = dict(args, request_id=str(uuid.UUID(int=rng.getrandbits(128))))
    dec = c.effect_intent(sid, "payments.charge", key=key, args=retry)
    assert (dec["decision"], dec["matched"], dec["matched_by"]) == ("reconcile", eid, "key"), dec
    found = service.lookup(key)                          # check the outside world by key
    assert found == receipt
    assert c.effect_reconcile(eid, "committed", receipt=found)["state"] == "committed"
    dec = c.effect_intent(sid, "payments.charge", key=key, args=retry)
    assert (dec["decision"], dec["receipt"]) == ("replay", receipt), dec
    assert service.counts()[key] == 1                    # the service saw the operation once

    # The budget: not reset by the crash, a rollback, or a fork (same lineage).
    with pytest.raises(BudgetExceeded):
        c.exec(sid, "true")
    rb = c.rollback(sid, t1["checkpoint"])
    assert eid in {e["id"] for e in rb["ledger"]["committed_after"]}  # made after turn 2's state
    with pytest.raises(BudgetExceeded):
        c.exec(sid, "true")
    fork = c.fork(t1["checkpoint"])["sandboxes"][0]
    with pytest.raises(BudgetExceeded):
        c.exec(fork, "true")
    r = subprocess.run([str(Path(sys.executable).parent / "crabd"), "budget", "show", sid, "--json",
                        "--socket", str(d.socket)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    shown = json.loads(r.stdout)
    assert shown["limits"]["turns"] == 2 and shown["used"]["turns"] == 2 and shown["used"]["wall_s"] > 0
    c.set_budget(sid, turns=3)                           # the fix the error names
    assert c.exec(sid, "cat /root/f")["stdout"] == "a\n"


def test_regenerated_call_after_rollback_is_replayed(start_daemon, service):
    """A regenerated call (new UUID, same op and arguments) after a rollback is
    replayed; under policy allow it executes. A network tool the inspector
    flags is an unmanaged effect of its turn. (The /proc inspector, which
    flags network tools alive at a turn's end: compiling the BPF one would
    be most of this test's time; what it flags is tested in tests/*/test_ebpf*.)"""
    rng = random.Random(11)
    d = start_daemon(env={"CRABD_INSPECTOR": "proc"})
    c = d.client()
    sid = c.create_sandbox("busybox")["id"]
    t1 = c.exec(sid, "echo draft > /root/mail.txt")
    mail = {"to": "bob@example.com", "subject": "report", "body": "the numbers are in"}

    def send(expect: str) -> tuple[dict, str, dict | None]:
        call_id = str(uuid.UUID(int=rng.getrandbits(128)))   # a regenerated tool call: new UUID every time
        dec = c.effect_intent(sid, "email.send", key=call_id, args=dict(mail, request_id=call_id))
        assert dec["decision"] == expect, dec
        r = None
        if dec["decision"] == "execute":
            r = service.call("send", call_id, mail)
            c.effect_commit(dec["effect"]["id"], receipt=r, result_digest=r["id"])
        return dec, call_id, r

    first, key1, receipt1 = send("execute")
    eid = first["effect"]["id"]
    # A turn that leaves a network tool running: recorded as an unmanaged effect.
    # (It waits until the tool has exec'd, so the turn's end sees it.)
    t2 = c.exec(sid, "nc -l -p 7000 </dev/null >/dev/null 2>&1 & pid=$!; i=0; "
                     "until grep -qx nc /proc/$pid/comm 2>/dev/null || [ $i -ge 1000 ]; do usleep 10000; i=$((i+1)); done; "
                     "grep -qx nc /proc/$pid/comm && echo sent >> /root/mail.txt", timeout=120)
    assert t2["exit_code"] == 0, t2
    unmanaged = [e for e in c.effects(sid) if e["kind"] == "unmanaged"]
    assert unmanaged and {e["turn"] for e in unmanaged} == {t2["turn"]}, unmanaged
    assert any(e["op"] == "exec.tool" and "nc -l" in (e["postcondition"] or "") for e in unmanaged), unmanaged

    async def async_view() -> list[dict]:
        async with AsyncClient(d.socket) as ac:
            return await ac.effects(sid)
    assert [e["id"] for e in asyncio.run(async_view())] == [e["id"] for e in c.effects(sid)]

    rb = c.rollback(sid, t1["checkpoint"])
    after = {e["id"] for e in rb["ledger"]["committed_after"]}
    assert after == {eid} | {e["id"] for e in unmanaged}, rb["ledger"]
    ev = _events(c, sid, "effects.not_undone")
    assert ev and {e["id"] for e in ev[-1]["data"]["committed_after"]} == after

    again, key2, _ = send("replay")                      # same op and arguments, new UUID: not re-executed
    assert (again["matched"], again["matched_by"], again["receipt"]) == (eid, "fingerprint", receipt1), again
    counts = service.counts()
    assert counts[key1] == 1 and key2 not in counts

    c.set_effect_policy(sid, "email.send", "allow")      # an operation that may repeat: executes
    _, key3, _ = send("execute")
    assert service.counts()[key3] == 1
