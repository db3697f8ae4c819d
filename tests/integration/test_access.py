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
    assert bob(f"GET", f"/v1/sandboxes/{forked[0]}").status_code == 404
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
