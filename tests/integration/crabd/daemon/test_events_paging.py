"""Events a client can page and tail, through a real daemon: the API's
cursor, `latest`, `order=desc`, and the CLI's `crabd events --latest N
--json` and `--follow` (which goes on from the cursor)."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import threading
import time

from crabd.testing import CRABD

import pytest

pytestmark = pytest.mark.needs("runc", "criu", "bpf", "busybox")


def test_page_tail_and_follow_the_events(start_daemon):
    d = start_daemon(env={"CRABD_INSPECTOR": "proc"})
    c = d.client()
    for _ in range(3):
        c.delete_sandbox(c.create_sandbox("busybox")["id"])
    every = c.events()
    assert len(every) >= 6
    # Forward, two at a time, with the cursor the daemon returns.
    got, page = [], c.events_page(limit=2)
    assert page["limit"] == 2 and page["max_limit"] == 1000 and page["more"]
    got += page["events"]
    while page["more"]:
        page = c.events_page(page["next"], limit=2)
        got += page["events"]
    assert [e["seq"] for e in got] == [e["seq"] for e in every]
    # The newest, either way round.
    assert c.events(latest=2) == every[-2:]
    desc = c.events_page(order="desc", limit=3)
    assert desc["events"] == every[::-1][:3] and desc["next"] == every[-3]["seq"]
    assert c.last_event_seq() == every[-1]["seq"]

    env = {**os.environ, "CRABD_SOCKET": str(d.socket)}
    r = subprocess.run([CRABD, "events", "--latest", "3", "--json"], capture_output=True, text=True, env=env,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert [json.loads(x)["seq"] for x in r.stdout.splitlines()] == [e["seq"] for e in every[-3:]]

    # --follow: the newest one, then what happens from now on (nothing twice).
    p = subprocess.Popen([CRABD, "events", "--latest", "1", "--follow", "--json"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in p.stdout], daemon=True).start()  # type: ignore[union-attr]
    try:
        def line(timeout: float = 30) -> dict:
            try:
                return json.loads(lines.get(timeout=timeout))
            except queue.Empty:
                raise AssertionError("crabd events --follow printed nothing") from None

        assert line()["seq"] == every[-1]["seq"]
        sid = c.create_sandbox("busybox")["id"]
        new = line()
        assert new["kind"] == "sandbox.created" and new["sandbox_id"] == sid and new["seq"] > every[-1]["seq"]
        c.delete_sandbox(sid)
        deadline = time.monotonic() + 30
        while (e := line())["kind"] != "sandbox.destroyed":
            assert time.monotonic() < deadline
        assert e["sandbox_id"] == sid
    finally:
        p.kill()
        p.wait(10)
