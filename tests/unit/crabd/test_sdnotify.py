"""sd_notify against a real AF_UNIX datagram socket standing in for systemd."""

from __future__ import annotations

import asyncio
import os
import socket
import uuid

import pytest

from crabd import sdnotify
from crabd.sdnotify import Notifier, watchdog_interval


@pytest.fixture
def listener(tmp_path):
    path = tmp_path / "notify.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(str(path))
    s.settimeout(2)
    yield str(path), s
    s.close()


def recv(s: socket.socket) -> list[str]:
    return s.recv(4096).decode().split("\n")


def test_messages_reach_the_socket(listener, monkeypatch):
    path, s = listener
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    assert sdnotify.ready("serving on /run/crabd/crabd.sock")
    assert recv(s) == ["READY=1", "STATUS=serving on /run/crabd/crabd.sock"]
    assert sdnotify.status("3 sandboxes,\n2 checkpoints queued")
    assert recv(s) == ["STATUS=3 sandboxes, 2 checkpoints queued"]  # one line, always
    assert sdnotify.watchdog()
    assert recv(s) == ["WATCHDOG=1"]
    assert sdnotify.stopping()
    assert recv(s) == ["STOPPING=1"]
    assert sdnotify.notify("EXTEND_TIMEOUT_USEC=5000000")
    assert recv(s) == ["EXTEND_TIMEOUT_USEC=5000000"]


def test_abstract_socket(monkeypatch):
    name = f"crabd-test-{uuid.uuid4().hex}"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(b"\0" + name.encode())
    s.settimeout(2)
    try:
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert sdnotify.ready()
        assert recv(s) == ["READY=1"]
    finally:
        s.close()


def test_no_op_without_notify_socket(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert not Notifier.from_env().enabled
    assert sdnotify.ready() is False
    assert sdnotify.status("x") is False
    assert sdnotify.watchdog() is False
    assert sdnotify.stopping() is False


def test_a_vanished_socket_is_logged_not_raised(tmp_path, caplog):
    n = Notifier(str(tmp_path / "gone.sock"))
    assert n.ready() is False
    assert "sd_notify" in caplog.text


def test_fields_with_newlines_are_refused(listener):
    with pytest.raises(ValueError):
        Notifier(listener[0]).notify("STATUS=a\nREADY=1")


def test_watchdog_interval():
    me = str(os.getpid())
    assert watchdog_interval({}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "30000000"}) == 30.0
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": me}) == 30.0
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}) is None  # meant for another process
    assert watchdog_interval({"WATCHDOG_USEC": "0"}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "soon"}) is None


def test_keep_alive_pings_at_half_the_interval(listener):
    path, s = listener
    n = Notifier(path)

    async def main():
        task = asyncio.ensure_future(n.keep_alive(0.1))
        await asyncio.sleep(0.12)  # pings at ~0, ~0.05, ~0.1
        task.cancel()

    asyncio.run(main())
    s.settimeout(0.2)
    got = []
    try:
        while True:
            got.append(s.recv(100))
    except socket.timeout:
        pass
    assert len(got) >= 2 and set(got) == {b"WATCHDOG=1"}
