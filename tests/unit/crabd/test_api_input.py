"""The API's input guard, in process (no root): ids that look like paths,
oversized and chunked bodies, invalid JSON, NUL bytes, lone surrogates,
booleans for numbers and huge numbers are all 4xx with the error JSON, and
never reach the daemon; bearer tokens and owners reach it as `owner=`.

The daemon is a recording fake: these are the API layer's rules only (the
live-daemon versions are tests/integration/crabd/test_api_fuzz.py and
test_access.py)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from crabd.api import MAX_BODY, make_app
from crabd.daemon import Daemon
from crabd.errors import FailedPrecondition, NotFound
from crabd.serve import load_tokens

TOKEN = "admin-token-0123456789"
ALICE = "alice-token-0123456789"
BOB = "bob-token-0123456789abc"


class _Store:
    def __init__(self, calls: list[tuple[str, Any]]) -> None:
        self.calls = calls

    def list_sandboxes(self, owner: str | None = None) -> list[Any]:
        self.calls.append(("list_sandboxes", owner))
        return []

    def get_sandbox(self, ref: str) -> Any:
        if ref != "sb-0123456789":
            raise NotFound(f"no sandbox {ref!r}")
        return SimpleNamespace(id=ref, owner="bob")

    def get_checkpoint(self, cid: str) -> Any:
        if not cid.startswith("sb-0123456789-"):
            raise NotFound(f"no checkpoint {cid!r}")
        return SimpleNamespace(id=cid, sandbox_id="sb-0123456789")

    def events_page(self, *, since: int, **kw: Any) -> tuple[list[Any], bool]:
        self.calls.append(("events_page", since))
        return [], False

    def last_event_seq(self, *a: Any) -> int:
        return 0


class FakeDaemon:
    _own = staticmethod(Daemon._own)

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.store = _Store(self.calls)
        self.ledger = None  # the effects router's; not used here

    def sandbox_info(self, sid: str, owner: str | None = None) -> dict[str, Any]:
        self.calls.append(("sandbox_info", (sid, owner)))
        raise NotFound(f"no sandbox {sid!r}")

    async def exec(self, sid: str, cmd: Any, **kw: Any) -> dict[str, Any]:
        self.calls.append(("exec", (sid, cmd, kw)))
        return {"exit_code": 0}

    async def rollback(self, sid: str, ck: Any, owner: str | None = None) -> dict[str, Any]:
        self.calls.append(("rollback", (sid, ck, owner)))
        return {"sandbox": sid}

    async def fork(self, cid: str, count: int, owner: str | None = None) -> dict[str, Any]:
        self.calls.append(("fork", (cid, count, owner)))
        return {"sandboxes": []}

    def health(self) -> dict[str, Any]:
        return {"ok": True}


_APP: Any = None


def request(method: str, path: str, *, token: str | None = TOKEN, **kw: Any) -> tuple[httpx.Response, FakeDaemon]:
    global _APP
    if _APP is None:  # one app for the module: building it is most of a request's cost
        _APP = (FakeDaemon(),)
        _APP += (make_app(_APP[0], token=TOKEN, tokens={ALICE: "alice", BOB: "bob"}),)  # type: ignore[arg-type]
    d, app = _APP
    d.calls.clear()
    headers = kw.pop("headers", {})
    if token is not None:
        headers["authorization"] = f"Bearer {token}"

    async def go() -> httpx.Response:
        # ASGITransport reports a (host, port) server: the request counts as TCP.
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://crabd:7411") as c:
            return await c.request(method, path, headers=headers, **kw)

    return asyncio.run(go()), d


def assert_error(r: httpx.Response, status: int, code: str | None = None) -> None:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"} and body["error"]["message"], body
    if code:
        assert body["error"]["code"] == code, body


@pytest.mark.parametrize("path", ["/v1/sandboxes/..", "/v1/sandboxes/%2e%2e", "/v1/sandboxes/%2E%2E%2Fetc",
                                  "/v1/sandboxes/a%00b", "/v1/checkpoints/..%2f..%2fsecret",
                                  "/v1/checkpoints/.hidden", "/v1/sandboxes/" + "a" * 129,
                                  "/v1/checkpoints/x/diff/%2e%2e"])
def test_path_like_ids_are_4xx_and_never_reach_the_daemon(path: str) -> None:
    r, d = request("GET", path)
    assert 400 <= r.status_code < 500, (path, r.status_code, r.text)
    assert "error" in r.json()
    assert not [c for c in d.calls if c[0] == "sandbox_info"], d.calls


def test_events_filter_with_a_path_like_id_is_refused() -> None:
    r, _ = request("GET", "/v1/events", params={"follow": "false", "sandbox": "../x"})
    assert_error(r, 422, "invalid_argument")


def test_oversized_body_by_content_length_is_413() -> None:
    r, d = request("POST", "/v1/sandboxes/sb-0123456789/exec", content=b"x" * (MAX_BODY + 1),
                   headers={"content-type": "application/json"})
    assert_error(r, 413, "too_large")
    assert not d.calls


def test_oversized_chunked_body_is_413_without_reading_it_whole() -> None:
    sent = 0

    async def chunks():  # no Content-Length: chunked transfer
        nonlocal sent
        for _ in range(64):
            sent += 1 << 20
            yield b"y" * (1 << 20)

    r, d = request("POST", "/v1/sandboxes/sb-0123456789/exec", content=chunks(),
                   headers={"content-type": "application/json"})
    assert_error(r, 413, "too_large")
    assert not d.calls
    # The guard answered at the first chunk over the limit, not after 64 MiB.
    assert sent <= MAX_BODY + (2 << 20), sent


def test_chunked_body_within_the_limit_is_accepted() -> None:
    async def chunks():
        yield b'{"cmd": ["tr'
        yield b'ue"]}'

    r, d = request("POST", "/v1/sandboxes/sb-0123456789/exec", content=chunks(),
                   headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    assert d.calls[0][1][1] == ["true"]


@pytest.mark.parametrize("body", [b"{", b"not json", b'{"cmd": ["a"]', b"\xff\xfe{}", b"[]", b"null"])
def test_invalid_json_is_422(body: bytes) -> None:
    r, d = request("POST", "/v1/sandboxes/sb-0123456789/exec", content=body,
                   headers={"content-type": "application/json"})
    assert_error(r, 422, "invalid_argument")
    assert not d.calls


@pytest.mark.parametrize("body", [
    {"cmd": ["echo", "a\x00b"]},
    {"cmd": "echo a\x00b"},
    {"cmd": []},
    {"cmd": ["true"], "env": {"A": "x\x00y"}},
    {"cmd": ["true"], "env": {"A\x00": "x"}},
    {"cmd": ["true"], "env": {"A=B": "x"}},
    {"cmd": ["true"], "env": {"": "x"}},
    {"cmd": ["true"], "cwd": "/tmp\x00/x"},
    {"cmd": ["true"], "cwd": ""},
    {"cmd": ["true"], "timeout": True},
    {"cmd": ["true"], "timeout": 1e308},
    {"cmd": ["true"], "timeout": "5"},
    {"cmd": [1, 2]},
    {"cmd": ["true"], "extra": 1},
])
def test_exec_bodies_that_would_fail_deep_are_422(body: dict[str, Any]) -> None:
    r, d = request("POST", "/v1/sandboxes/sb-0123456789/exec", json=body)
    assert_error(r, 422, "invalid_argument")
    assert not d.calls


def test_lone_surrogates_are_422() -> None:
    # Valid JSON, not valid UTF-8 once decoded: would fail in subprocess/sqlite.
    for raw in (b'{"cmd": ["echo", "\\ud800"]}', b'{"cmd": ["true"], "stdin": "\\udfff"}'):
        r, d = request("POST", "/v1/sandboxes/sb-0123456789/exec", content=raw,
                       headers={"content-type": "application/json"})
        assert_error(r, 422, "invalid_argument")
        assert not d.calls


@pytest.mark.parametrize("body", [{"checkpoint": True}, {"checkpoint": -1}, {"checkpoint": 2**64},
                                  {"checkpoint": "../x"}, {"checkpoint": 1.5}])
def test_rollback_refuses_booleans_negative_huge_and_path_like(body: dict[str, Any]) -> None:
    r, d = request("POST", "/v1/sandboxes/sb-0123456789/rollback", json=body)
    assert_error(r, 422, "invalid_argument")
    assert not d.calls


@pytest.mark.parametrize("body", [{"count": True}, {"count": 0}, {"count": 10**30}, {"count": "2"}])
def test_fork_count_is_a_strict_bounded_int(body: dict[str, Any]) -> None:
    r, d = request("POST", "/v1/checkpoints/sb-0123456789-1/fork", json=body)
    assert_error(r, 422, "invalid_argument")
    assert not d.calls


def test_huge_event_cursor_is_422_not_a_sqlite_overflow() -> None:
    r, _ = request("GET", "/v1/events", params={"follow": "false", "since": str(2**64)})
    assert_error(r, 422, "invalid_argument")


@pytest.mark.parametrize("header", [None, "Bearer wrong-token-0123456789", f"Basic {TOKEN}", f"Bearer {TOKEN}x", ""])
def test_tcp_requests_without_the_right_token_are_401(header: str | None) -> None:
    hdrs = {} if header is None else {"authorization": header}
    r, d = request("GET", "/v1/sandboxes", token=None, headers=hdrs)
    assert_error(r, 401, "unauthenticated")
    assert not d.calls


def test_token_owner_reaches_the_daemon() -> None:
    r, d = request("GET", "/v1/sandboxes", token=ALICE)
    assert r.status_code == 200 and d.calls == [("list_sandboxes", "alice")]
    r, d = request("GET", "/v1/sandboxes", token=TOKEN)
    assert r.status_code == 200 and d.calls == [("list_sandboxes", None)]
    r, d = request("POST", "/v1/sandboxes/sb-0123456789/rollback", token=BOB, json={"checkpoint": 3})
    assert r.status_code == 200 and d.calls == [("rollback", ("sb-0123456789", 3, "bob"))]
    r, d = request("POST", "/v1/checkpoints/sb-0123456789-1/fork", token=BOB, json={"count": 2})
    assert d.calls == [("fork", ("sb-0123456789-1", 2, "bob"))]
    r, d = request("GET", "/v1/sandboxes/sb-0123456789", token=BOB)
    assert_error(r, 404, "not_found")  # (the fake's sandbox_info always says so)
    assert d.calls == [("sandbox_info", ("sb-0123456789", "bob"))]


@pytest.mark.parametrize("method,path,body", [
    ("GET", "/v1/sandboxes/sb-0123456789", None),
    ("POST", "/v1/sandboxes/sb-0123456789/exec", {"cmd": ["true"]}),
    ("POST", "/v1/sandboxes/sb-0123456789/rollback", {}),
    ("POST", "/v1/checkpoints/sb-0123456789-1/fork", {"count": 1}),
    ("GET", "/v1/checkpoints/sb-0123456789-1", None),
    ("GET", "/v1/checkpoints/sb-0123456789-1/diff/sb-0123456789-2", None),
    ("GET", "/v1/sandboxes/sb-0123456789/effects", None),
])
def test_another_owners_ids_are_404_before_any_route_runs(method: str, path: str, body: Any) -> None:
    r, d = request(method, path, token=ALICE, json=body)
    assert_error(r, 404, "not_found")
    assert "bob" not in r.text
    assert not [c for c in d.calls if c[0] != "list_sandboxes"], d.calls


def test_openapi_declares_the_error_responses() -> None:
    r, _ = request("GET", "/openapi.json")
    spec = r.json()
    ops = [op for path in spec["paths"].values() for op in path.values()]
    for op in ops:
        for status in ("401", "404", "413", "422"):
            assert status in op["responses"], (op["operationId"], status)


# --- tokens file ------------------------------------------------------------------------------

def _tokens(tmp_path: Path, text: str, mode: int = 0o600) -> Path:
    p = tmp_path / "tokens"
    p.write_text(text)
    os.chmod(p, mode)
    return p


def test_tokens_file_format(tmp_path: Path) -> None:
    p = _tokens(tmp_path, f"# owners\nalice:{ALICE}\n\n bob : {BOB} \n")
    assert load_tokens(p) == {ALICE: "alice", BOB: "bob"}


@pytest.mark.parametrize("text,mode,words", [
    (f"alice:{ALICE}\n", 0o644, "chmod 600"),
    ("alice:short\n", 0o600, "shorter than 16"),
    (f"Alice:{ALICE}\n", 0o600, "owner:token"),
    (f"{ALICE}\n", 0o600, "owner:token"),
    (f"alice:{ALICE}\nbob:{ALICE}\n", 0o600, "every owner its own token"),
])
def test_tokens_file_mistakes_are_refused_with_the_fix(tmp_path: Path, text: str, mode: int, words: str) -> None:
    with pytest.raises(FailedPrecondition) as e:
        load_tokens(_tokens(tmp_path, text, mode))
    assert words in str(e.value)
