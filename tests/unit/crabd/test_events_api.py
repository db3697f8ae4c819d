"""GET /v1/events as a client pages and tails it, in process (no root): a
real Store behind the API, a fake for the rest of the daemon. The cap is in
the reply, `next` is the cursor, `latest=N` and `order=desc` give the newest.
(test_api_fuzz.py runs the live-daemon version of the input rules.)"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from crabd.api import make_app
from crabd.store import EVENTS_MAX_PAGE, SandboxRow, Store

TOKEN = "admin-token-0123456789"
ALICE = "alice-token-0123456789"


class FakeDaemon:
    def __init__(self, store: Store) -> None:
        self.store = store
        self.ledger = None

    async def wait_event(self, timeout: float) -> None:
        await asyncio.sleep(min(timeout, 0.01))


@pytest.fixture
def api(tmp_path):
    store = Store(tmp_path)
    app = make_app(FakeDaemon(store), token=TOKEN, tokens={ALICE: "alice"})  # type: ignore[arg-type]

    def get(token: str = TOKEN, **params: Any) -> httpx.Response:
        async def go() -> httpx.Response:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://crabd:7411") as c:
                return await c.get("/v1/events", params={"follow": "false", **params},
                                   headers={"authorization": f"Bearer {token}"})
        return asyncio.run(go())

    yield store, get
    store.close()


def ok(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 200, r.text
    return r.json()


def test_pages_forward_with_next_and_echoes_the_cap(api):
    store, get = api
    seqs = [store.add_event("k", "sb-1", i=i).seq for i in range(5)]
    p = ok(get(limit=2))
    assert [e["seq"] for e in p["events"]] == seqs[:2]
    assert p["limit"] == 2 and p["max_limit"] == EVENTS_MAX_PAGE and p["more"] and p["order"] == "asc"
    assert p["next"] == seqs[1] and p["last_seq"] == seqs[-1]
    got = [e["seq"] for e in p["events"]]
    while p["more"]:
        p = ok(get(since=p["next"], limit=2))
        got += [e["seq"] for e in p["events"]]
    assert got == seqs
    # Caught up: an empty page whose cursor still points at the end (a tail).
    tail = ok(get(since=p["next"]))
    assert tail["events"] == [] and not tail["more"] and tail["next"] == seqs[-1]
    assert ok(get())["limit"] == EVENTS_MAX_PAGE  # the default is the cap, and says so


def test_latest_gives_the_newest_oldest_first(api):
    store, get = api
    seqs = [store.add_event("k", None).seq for i in range(6)]
    p = ok(get(latest=3))
    assert [e["seq"] for e in p["events"]] == seqs[3:]
    assert p["more"] and p["next"] == seqs[-1] and p["limit"] == 3


def test_order_desc_pages_backward_with_before(api):
    store, get = api
    seqs = [store.add_event("k", None).seq for i in range(5)]
    p = ok(get(order="desc", limit=2))
    assert [e["seq"] for e in p["events"]] == [seqs[4], seqs[3]] and p["order"] == "desc"
    got = [e["seq"] for e in p["events"]]
    while p["next"] is not None:
        p = ok(get(order="desc", limit=2, before=p["next"]))
        got += [e["seq"] for e in p["events"]]
    assert got == seqs[::-1] and not p["more"]


def test_an_owner_pages_through_its_own_events_only(api):
    store, get = api
    store.add_sandbox(SandboxRow(id="sb-a", name="a", image="i", fs_key="k", lineage="sb-a", owner="alice"))
    mine = []
    for i in range(6):
        e = store.add_event("k", "sb-a" if i % 3 == 0 else "sb-other")
        if e.sandbox_id == "sb-a":
            mine.append(e.seq)
    p = ok(get(ALICE, limit=1))
    assert [e["seq"] for e in p["events"]] == mine[:1] and p["more"]
    p = ok(get(ALICE, limit=1, since=p["next"]))
    assert [e["seq"] for e in p["events"]] == mine[1:] and not p["more"]
    assert p["last_seq"] == mine[-1]  # not the newest of all: others' events are not counted either


@pytest.mark.parametrize("params", [{"limit": 0}, {"limit": EVENTS_MAX_PAGE + 1}, {"latest": 0},
                                    {"order": "sideways"}, {"before": 0}, {"latest": 2, "order": "desc"},
                                    {"limit": "true"}])
def test_bad_paging_parameters_are_4xx(api, params):
    _, get = api
    r = get(**params)
    assert 400 <= r.status_code < 500 and r.json()["error"]["code"] == "invalid_argument", r.text
