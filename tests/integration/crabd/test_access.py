"""Access control of a live daemon: the unix socket's mode, the TCP
listener's bearer tokens, and owners (one token per owner, tokens_file):
one owner cannot see, read or change another's sandboxes, checkpoints or
events -- every such request is 404, exactly as for an id that does not
exist, so ids do not leak."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from security_daemon import ADMIN, ALICE, BOB, As, security_daemon  # noqa: E402

pytestmark = pytest.mark.needs("runc", "criu", "bpf", "busybox")


@pytest.fixture(scope="module")
def live(runtime, busybox_image):
    with security_daemon(runtime) as (d, base):
        yield d, base


def test_unix_socket_is_not_world_accessible(live: Any) -> None:
    d, _ = live
    mode = stat.S_IMODE(os.stat(d.socket).st_mode)
    assert mode & 0o007 == 0, f"socket {d.socket} mode {mode:o} is world-accessible"
    assert mode in (0o600, 0o660), f"{mode:o}"
    assert stat.S_ISSOCK(os.stat(d.socket).st_mode)
    # And it works for its owner (root).
    assert d.client().health()["ok"] is True


def test_tcp_needs_a_valid_token(live: Any) -> None:
    _, base = live
    for token in (None, "wrong-" + "x" * 26, ADMIN[:-1], ADMIN + "x"):
        r = As(base, token)("GET", "/v1/sandboxes")
        assert r.status_code == 401, (token, r.status_code, r.text)
        assert r.json()["error"]["code"] == "unauthenticated" and r.json()["error"]["fix"]
    r = httpx.get(base + "/v1/health", headers={"authorization": f"Basic {ADMIN}"})
    assert r.status_code == 401
    for token in (ADMIN, ALICE, BOB):
        assert As(base, token).ok("GET", "/v1/health")["ok"] is True


def test_owners_cannot_see_or_touch_each_others_sandboxes(live: Any) -> None:
    d, base = live
    alice, bob, admin = As(base, ALICE), As(base, BOB), As(base, ADMIN)

    a = alice.ok("POST", "/v1/sandboxes", json={"image": "busybox"})
    sid = a["id"]
    assert a["owner"] == "alice"
    alice.ok("POST", f"/v1/sandboxes/{sid}/exec", json={"cmd": "echo alice-secret > /root/f"})
    ck = alice.ok("POST", f"/v1/sandboxes/{sid}/checkpoints")["id"]
    alice.ok("POST", f"/v1/sandboxes/{sid}/exec", json={"cmd": "echo later > /root/f"})
    b = bob.ok("POST", "/v1/sandboxes", json={"image": "busybox"})
    assert b["owner"] == "bob"

    # Lists are owner-scoped; the admin token (and the unix socket) see all.
    assert [s["id"] for s in alice.ok("GET", "/v1/sandboxes")["sandboxes"]] == [sid]
    assert [s["id"] for s in bob.ok("GET", "/v1/sandboxes")["sandboxes"]] == [b["id"]]
    assert {s["id"] for s in admin.ok("GET", "/v1/sandboxes")["sandboxes"]} == {sid, b["id"]}
    assert {s["id"] for s in d.client().sandboxes()} == {sid, b["id"]}

    # Every way bob could reach alice's sandbox or checkpoint: 404, like an unknown id.
    attempts = [
        ("GET", f"/v1/sandboxes/{sid}", None),
        ("POST", f"/v1/sandboxes/{sid}/exec", {"cmd": "echo bob > /root/f"}),
        ("POST", f"/v1/sandboxes/{sid}/turns/end", None),
        ("GET", f"/v1/sandboxes/{sid}/checkpoints", None),
        ("POST", f"/v1/sandboxes/{sid}/checkpoints", None),
        ("POST", f"/v1/sandboxes/{sid}/rollback", {"checkpoint": ck}),
        ("GET", f"/v1/checkpoints/{ck}", None),
        ("GET", f"/v1/checkpoints/{ck}/diff/{sid}-0", None),
        ("POST", f"/v1/checkpoints/{ck}/fork", {"count": 1}),
        ("DELETE", f"/v1/checkpoints/{ck}", None),
        ("GET", f"/v1/sandboxes/{sid}/effects", None),
        ("GET", f"/v1/sandboxes/{sid}/budget", None),
        # the operator view's reads (crabd.ui)
        ("GET", f"/v1/sandboxes/{sid}/view", None),
        ("GET", f"/v1/sandboxes/{sid}/tree", None),
        ("GET", f"/v1/sandboxes/{sid}/rollback/preview?checkpoint={ck}", None),
        ("DELETE", f"/v1/sandboxes/{sid}", None),
        # bob's own sandbox rolled back to alice's checkpoint: not a 409 that names her sandbox
        ("POST", f"/v1/sandboxes/{b['id']}/rollback", {"checkpoint": ck}),
    ]
    for method, path, body in attempts:
        r = bob(method, path, json=body) if body is not None else bob(method, path)
        assert r.status_code == 404, (method, path, r.status_code, r.text)
        assert r.json()["error"]["code"] == "not_found"
        # Only the id bob sent is echoed: nothing about whose it is or where it belongs.
        assert "belongs" not in r.text and "alice" not in r.text, r.text
        unknown = path.replace(sid, "sb-ffffffffff")
        r2 = bob(method, unknown, json=body) if body is not None else bob(method, unknown)
        assert r2.status_code == r.status_code, (unknown, r2.status_code)

    # Events: bob sees his sandbox's, none of alice's.
    evs = bob.ok("GET", "/v1/events", params={"follow": "false"})["events"]
    assert evs and all(e["sandbox_id"] == b["id"] for e in evs), evs
    assert not bob.ok("GET", "/v1/events", params={"follow": "false", "sandbox": sid})["events"]
    mine = alice.ok("GET", "/v1/events", params={"follow": "false"})["events"]
    assert mine and all(e["sandbox_id"] == sid for e in mine)

    # Alice's sandbox is untouched by all of the above, and still hers to use.
    out = alice.ok("POST", f"/v1/sandboxes/{sid}/exec", json={"cmd": ["cat", "/root/f"]})
    assert out["stdout"] == "later\n"
    alice.ok("POST", f"/v1/sandboxes/{sid}/rollback", json={"checkpoint": ck})
    out = alice.ok("POST", f"/v1/sandboxes/{sid}/exec", json={"cmd": ["cat", "/root/f"]})
    assert out["stdout"] == "alice-secret\n"
    forked = alice.ok("POST", f"/v1/checkpoints/{ck}/fork", json={"count": 1})["sandboxes"]
    assert alice.ok("GET", f"/v1/sandboxes/{forked[0]}")["owner"] == "alice"
    assert bob("GET", f"/v1/sandboxes/{forked[0]}").status_code == 404
    for s in [sid, *forked]:
        alice.ok("DELETE", f"/v1/sandboxes/{s}")
    bob.ok("DELETE", f"/v1/sandboxes/{b['id']}")


@pytest.mark.parametrize("text,words", [("alice:short\n", "shorter than 16"), ("nocolon\n", "owner:token")])
def test_a_bad_tokens_file_stops_the_daemon_with_the_fix(tmp_path: Path, text: str, words: str) -> None:
    from crabd.testing import DaemonHandle, cleanup_state_dir
    tokens_file = tmp_path / "tokens"
    tokens_file.write_text(text)
    os.chmod(tokens_file, 0o600)
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'tokens_file = "{tokens_file}"\n')
    state = tmp_path / "state"
    state.mkdir()
    h = DaemonHandle(state, args=["--config", str(cfg)], env={"CRABD_INSPECTOR": "proc"})
    try:
        with pytest.raises(AssertionError, match=words):
            h.start()
    finally:
        h.stop()
        cleanup_state_dir(state)


def raw(base: str, request: bytes) -> tuple[int, bytes]:
    """One HTTP/1.1 request sent byte for byte (no client-side path normalization)."""
    import socket as socketlib
    host, port = base.removeprefix("http://").split(":")
    with socketlib.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data or len(data) < data.index(b"\r\n\r\n") + 4 + _length(data):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    return int(data.split(b" ", 2)[1]), data.split(b"\r\n\r\n", 1)[1]


def _length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 0


@pytest.mark.parametrize("path", ["/v1/sandboxes/..", "/v1/sandboxes/%2e%2e", "/v1/sandboxes/..%2F..%2Fetc",
                                  "/v1/sandboxes/a%00b/checkpoints", "/v1/checkpoints/../../etc/passwd",
                                  "/v1/checkpoints/%2e%2e%2f%2e%2e/diff/x"])
def test_path_like_ids_are_4xx_on_the_wire(live: Any, path: str) -> None:
    _, base = live
    status, body = raw(base, f"GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ALICE}\r\n"
                             f"Connection: close\r\n\r\n".encode())
    assert 400 <= status < 500, (path, status, body)
    assert b'"error"' in body


def test_oversized_chunked_body_and_invalid_json_are_4xx_on_the_wire(live: Any) -> None:
    import json
    from crabd.api import MAX_BODY
    _, base = live
    alice = As(base, ALICE)
    sid = alice.ok("POST", "/v1/sandboxes", json={"image": "busybox"})["id"]
    sent = 0

    def chunks():  # no Content-Length: chunked, 32 MiB offered
        nonlocal sent
        for _ in range(32):
            sent += 1 << 20
            yield b"x" * (1 << 20)

    try:
        r = alice("POST", f"/v1/sandboxes/{sid}/exec", content=chunks(), headers={"content-type": "application/json"})
        status = r.status_code
        assert r.json()["error"]["code"] == "too_large"
    except httpx.HTTPError:
        status = 413  # the server may answer and close before the client finished sending
    assert status == 413
    for body in (b"{", b'{"cmd": ["echo", "a\\u0000b"]}', b'{"cmd": ["x"], "timeout": true}', b"\xff\xfe"):
        r = alice("POST", f"/v1/sandboxes/{sid}/exec", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_argument", (body, r.text)
    r = alice("POST", f"/v1/sandboxes/{sid}/exec", content=json.dumps({"cmd": ["true"], "stdin": "x" * MAX_BODY}),
              headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text
    # The sandbox is fine after all of it.
    assert alice.ok("POST", f"/v1/sandboxes/{sid}/exec", json={"cmd": ["echo", "ok"]})["stdout"] == "ok\n"
    alice.ok("DELETE", f"/v1/sandboxes/{sid}")
