"""The operator view's pure parts: the forwarder's request policy
(crabd.ui.forward.rewrite_head), the API guard's cookie and login rules for
/ui, the shipped files, and the store's one-pass host totals. No root, no
browser (tests/integration/test_ui.py drives Chromium)."""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any

import pytest

from crabd.api import _Guard
from crabd.store import CheckpointRow, SandboxRow, Store
from crabd.ui import PUBLIC, _assets
from crabd.ui.forward import Refusal, rewrite_head

KEY = "k" * 32


def head(line: str, *headers: str) -> bytes:
    return ("\r\n".join([line, "Host: 127.0.0.1:1", *headers]) + "\r\n\r\n").encode()


def test_forwarder_swaps_its_key_for_the_daemons_token() -> None:
    out = rewrite_head(head("POST /v1/sandboxes/a/rollback HTTP/1.1", f"Authorization: Bearer {KEY}",
                            "Cookie: crabd_token=zzz; other=1", "Content-Length: 17", "Connection: keep-alive"),
                       KEY, bearer="alice-token-xxxxxxxx")
    assert not isinstance(out, Refusal)
    text, length = out[0].decode(), out[1]
    assert length == 17
    assert text.startswith("POST /v1/sandboxes/a/rollback HTTP/1.1\r\n")
    assert KEY not in text and "Cookie" not in text and "keep-alive" not in text
    assert "Authorization: Bearer alice-token-xxxxxxxx\r\n" in text and text.endswith("Connection: close\r\n\r\n")
    # Without an owner token: no Authorization upstream (the socket's own access).
    out = rewrite_head(head("GET /v1/host HTTP/1.1", f"Authorization: Bearer {KEY}"), KEY)
    assert not isinstance(out, Refusal) and b"Authorization" not in out[0]


@pytest.mark.parametrize("req, status", [
    (head("GET /v1/host HTTP/1.1"), 401),                                        # no key
    (head("GET /v1/host HTTP/1.1", "Authorization: Bearer " + "x" * 32), 401),    # wrong key
    (head("GET /v1/host HTTP/1.1", f"Cookie: crabd_token={KEY}"), 401),           # a cookie is for /ui's files only
    (head("POST /ui/ HTTP/1.1", f"Cookie: crabd_token={KEY}"), 401),              # and only for GET
    (head("GET /ui/ HTTP/1.1"), 303),                                             # a page: to the token form
    (head("GET /ui/static/ui.js HTTP/1.1"), 303),
    (head("POST /v1/x HTTP/1.1", f"Authorization: Bearer {KEY}", "Transfer-Encoding: chunked"), 411),
    (b"GARBAGE\r\n\r\n", 400),
    (head("GET /v1/host HTTP/1.1", "Bad header line"), 400),
])
def test_forwarder_refuses(req: bytes, status: int) -> None:
    out = rewrite_head(req, KEY)
    assert isinstance(out, Refusal) and out.status == status, out
    if status == 303:
        assert out.location == "/ui/login" and b"Location: /ui/login" in out.response()


def test_forwarder_lets_the_token_form_and_cookie_pages_through() -> None:
    for path in PUBLIC:
        assert not isinstance(rewrite_head(head(f"GET {path} HTTP/1.1"), KEY), Refusal), path
    out = rewrite_head(head("GET /ui/ HTTP/1.1", f"Cookie: a=b; crabd_token={KEY}"), KEY)
    assert not isinstance(out, Refusal) and b"crabd_token" not in out[0]


def guard_call(path: str, method: str = "GET", headers: dict[str, str] | None = None,
               over_tcp: bool = True) -> tuple[int, str | None]:
    """(status, owner seen by the app) of one request through _Guard."""
    seen: dict[str, Any] = {}

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen["owner"] = scope["state"]["crabd_owner"]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    sent: list[dict[str, Any]] = []

    async def send(msg: dict[str, Any]) -> None:
        sent.append(msg)

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    g = _Guard(app, token="admin-" + "a" * 26, tokens={"alice-" + "b" * 26: "alice"})
    scope = {"type": "http", "path": path, "method": method,
             "server": ("127.0.0.1", 8080) if over_tcp else ("/run/crabd.sock", None),
             "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]}
    asyncio.run(g(scope, receive, send))
    return sent[0]["status"], seen.get("owner")


def test_guard_takes_the_cookie_only_for_pages() -> None:
    alice = "alice-" + "b" * 26
    assert guard_call("/ui/", headers={"Cookie": f"crabd_token={alice}"}) == (200, "alice")
    assert guard_call("/ui/static/ui.js", headers={"Cookie": f"x=1; crabd_token={alice}"}) == (200, "alice")
    assert guard_call("/v1/host", headers={"Cookie": f"crabd_token={alice}"})[0] == 401
    assert guard_call("/ui/", "POST", headers={"Cookie": f"crabd_token={alice}"})[0] == 401
    assert guard_call("/ui/")[0] == 303                              # no token: the form
    assert guard_call("/ui/", headers={"Cookie": "crabd_token=" + "w" * 32})[0] == 303
    for path in PUBLIC:
        assert guard_call(path) == (200, None), path
    # On the unix socket nothing changes: no token needed, a cookie scopes to its owner.
    assert guard_call("/ui/", over_tcp=False) == (200, None)
    assert guard_call("/ui/", headers={"Cookie": f"crabd_token={alice}"}, over_tcp=False) == (200, "alice")


def test_shipped_files_run_no_inline_script() -> None:
    files = _assets()
    assert {"index.html", "login.html", "ui.js", "login.js", "ui.css"} <= set(files)
    for name in ("index.html", "login.html"):
        html = files[name][0].decode()
        # The CSP allows scripts from /ui/static only: no inline code, no other origin.
        assert re.findall(r"<script(?![^>]*\ssrc=\"/ui/static/)", html) == [], name
        assert "http://" not in html and "https://" not in html, name
    js = files["ui.js"][0].decode()
    assert "innerHTML" not in js and "insertAdjacentHTML" not in js and "eval(" not in js


def test_checkpoint_totals_one_pass(tmp_path: Any) -> None:
    st = Store(tmp_path)
    now = time.time()
    for sid in ("sb-a", "sb-b"):
        st.add_sandbox(SandboxRow(id=sid, name=sid, image="busybox", fs_key="k-" + sid, lineage=sid))
    for seq, plan, state, nbytes, age in ((0, "FS", "committed", 0, 600), (1, "SKIP", "committed", 0, 30),
                                          (2, "FS", "committed", 4096, 10), (3, "FS_PROC", "pending", 0, 1)):
        st.add_checkpoint(CheckpointRow(id=f"sb-a-{seq}", sandbox_id="sb-a", seq=seq, parent=None, branch=0, turn=seq,
                                        plan=plan, bytes=nbytes, state=state, created_at=now - age))
    st.add_checkpoint(CheckpointRow(id="sb-b-0", sandbox_id="sb-b", seq=0, parent=None, branch=0, turn=0, plan="FS",
                                    bytes=100, state="committed", created_at=now - 5))
    per, recent = st.checkpoint_totals(now - 60)
    assert per["sb-a"] == {"checkpoints": 3, "bytes": 4096, "last_plan": "FS_PROC"}   # newest, pending included
    assert per["sb-b"] == {"checkpoints": 1, "bytes": 100, "last_plan": "FS"}
    assert recent == {"checkpoints": 3, "bytes": 4196}
    st.close()


def test_pages_name_their_files_by_version_and_only_those_urls_are_kept() -> None:
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from crabd.ui import asset_version, mount
    files = _assets()
    app = FastAPI()
    mount(app, None)  # type: ignore[arg-type]  # the files need no daemon
    c = TestClient(app)
    for page, code in (("index.html", "ui.js"), ("login.html", "login.js")):
        html = files[page][0].decode()
        for name in (code, "ui.css"):
            v = asset_version(files[name][0])
            assert f'"/ui/static/{name}?v={v}"' in html, (page, name)
            r = c.get(f"/ui/static/{name}?v={v}")
            assert r.status_code == 200 and "immutable" in r.headers["cache-control"], name
            # Another version (an old page's URL) or none: served, never kept.
            assert c.get(f"/ui/static/{name}?v=0000").headers["cache-control"] == "no-store"
            assert c.get(f"/ui/static/{name}").headers["cache-control"] == "no-store"
    assert c.get("/ui/").headers["cache-control"] == "no-store"   # the page itself: always asked for


def test_host_summary_names_fifty_jobs_and_counts_all(tmp_path: Any) -> None:
    from types import SimpleNamespace as NS

    from prometheus_client import CollectorRegistry

    from crabd.ui import JOBS_LISTED, host_summary
    st = Store(tmp_path)
    st.add_sandbox(SandboxRow(id="sb-a", name="a", image="busybox", fs_key="k", lineage="sb-a", owner="alice"))
    daemon = NS(store=st, standbys={}, metrics=NS(registry=CollectorRegistry()),
                scheduler=NS(policy=NS(max_concurrency=2)))
    job = NS(kind="sizing", sandbox_id="sb-other", size_bytes=0)   # another owner's: counted, not named
    out = host_summary(daemon, "alice", ([job] * 5000, [job] * 2))  # type: ignore[arg-type]
    sch = out["scheduler"]
    assert (len(sch["queued"]), sch["queued_total"], len(sch["running"]), sch["running_total"]) == \
        (JOBS_LISTED, 5000, 2, 2)
    assert all(j["sandbox_id"] is None for j in sch["queued"])
    assert [s["id"] for s in out["sandboxes"]] == ["sb-a"]
    st.close()


def test_sandbox_tree_is_one_array_per_checkpoint_with_its_forks(tmp_path: Any) -> None:
    from types import SimpleNamespace as NS

    from crabd.ui import TREE_FIELDS, sandbox_tree
    st = Store(tmp_path)
    st.add_sandbox(SandboxRow(id="sb-a", name="a", image="busybox", fs_key="k", lineage="sb-a", head="sb-a-1"))
    st.add_sandbox(SandboxRow(id="sb-f", name="f", image="busybox", fs_key="k2", lineage="sb-a", forked_from="sb-a-0"))
    cks = [{"id": f"sb-a-{i}", "seq": i, "parent": f"sb-a-{i - 1}" if i else None, "branch": 0, "turn": i,
            "plan": "FS", "state": "committed", "bytes": 10 * i, "durations": {"pause": 0.01}, "kept": ["head"],
            "reasons": ["r"]} for i in range(2)]
    daemon = NS(store=st, _own=lambda row, owner: row, list_checkpoints=lambda sid, owner, all_states: cks)
    out = sandbox_tree(daemon, "sb-a", None)  # type: ignore[arg-type]
    rows = [dict(zip(out["fields"], r)) for r in out["checkpoints"]]
    assert out["fields"] == list(TREE_FIELDS) and [r["id"] for r in rows] == ["sb-a-0", "sb-a-1"]
    assert rows[1] == {"id": "sb-a-1", "seq": 1, "parent": "sb-a-0", "branch": 0, "turn": 1, "plan": "FS",
                       "state": "committed", "bytes": 10, "pause": 0.01, "kept": ["head"], "reasons": ["r"]}
    assert out["forks"] == [{"id": "sb-f", "name": "f", "forked_from": "sb-a-0"}]
    st.close()


def test_sandbox_view_is_the_first_paint_in_one_reply(tmp_path: Any) -> None:
    """GET /v1/sandboxes/{sid}/view's data: the sandbox's newest `turns`
    events oldest first (with `more`), and the events the owner may see
    with the seq the page's stream starts from: another owner's never."""
    from types import SimpleNamespace as NS

    from crabd.ui import sandbox_view
    st = Store(tmp_path)
    st.add_sandbox(SandboxRow(id="sb-a", name="a", image="busybox", fs_key="k", lineage="sb-a", owner="alice"))
    st.add_sandbox(SandboxRow(id="sb-b", name="b", image="busybox", fs_key="k2", lineage="sb-b", owner="bob"))
    for i in range(5):
        st.add_event("turn.ended", "sb-a", turn=i)
    st.add_event("turn.ended", "sb-b", turn=0)   # bob's, the newest of the host
    daemon = NS(store=st, _own=lambda row, owner: row, list_checkpoints=lambda sid, owner, all_states: [],
                sandbox_info=lambda sid, owner: {"id": sid},
                ledger=NS(budget=lambda lin: {"limits": {}, "used": {}}, list=lambda lin: [{"op": "mail.send"}]))
    out = sandbox_view(daemon, "sb-a", "alice", 3)  # type: ignore[arg-type]
    assert [e["data"]["turn"] for e in out["events"]["events"]] == [2, 3, 4] and out["events"]["more"] is True
    recent = out["recent"]["events"]
    assert [e["sandbox_id"] for e in recent] == ["sb-a"] * 5
    assert out["recent"]["last_seq"] == recent[-1]["seq"]
    assert out["info"] == {"id": "sb-a"} and out["effects"] == [{"op": "mail.send"}] and out["tree"]["sandbox"] == "sb-a"
    st.close()
