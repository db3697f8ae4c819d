"""The exec channel's pure parts (crabd/runtime/channel.py): the request's
bytes as init.c mode 3 parses them, the OCI config's init arguments, and
the setting that turns the channel on."""

from __future__ import annotations

import os
import struct

from crabd import config
from crabd.runtime import build_config, channel
from crabd.runtime.oci import INIT_PATH, Limits


def test_request_is_a_length_then_nul_terminated_words():
    data = channel.request(["sh", "-c", "echo é"], ["A=1", "B="], "/work")
    (n,) = struct.unpack("<I", data[:4])
    body = data[4:]
    assert n == len(body) and body.endswith(b"\0")
    words = body[:-1].split(b"\0")
    assert words == [b"crabd-exec-1", b"/work", b"3", b"sh", b"-c", "echo é".encode(), b"A=1", b"B="]


def test_request_without_env():
    words = channel.request(["true"], [], "/")[4:-1].split(b"\0")
    assert words == [b"crabd-exec-1", b"/", b"1", b"true"]


def _cfg(**kw):
    return build_config(sandbox_id="sb-0123456789", init_source="/x/crabd-init", run_source="/x/run",
                        cgroups_path="/crabd/sb-0123456789", limits=Limits(), **kw)


def test_init_args_only_when_asked():
    assert _cfg()["process"]["args"] == [INIT_PATH]
    assert _cfg(init_args=("--channel", channel.NAME))["process"]["args"] == [INIT_PATH, "--channel", "crabd-exec"]


def test_setting_is_on_by_default(monkeypatch):
    monkeypatch.delenv("CRABD_EXEC_CHANNEL", raising=False)
    assert config.exec_channel() is True
    for v, want in (("1", True), ("yes", True), ("0", False), ("off", False), ("", True)):
        monkeypatch.setenv("CRABD_EXEC_CHANNEL", v)
        assert config.exec_channel() is want


def test_this_process_is_no_sandbox_init():
    assert not channel.is_sandbox_init(os.getpid(), "/crabd/sb-0123456789")


def _fake_init(sock):
    """The init's side of one request (init.c mode 3, reduced): the command
    writes 1 MiB (its pipe widened to hold it all) and exits; then the
    init reports its start and exit 0."""
    import fcntl
    import socket
    _, fds, _, _ = socket.recv_fds(sock, 1 << 16, 3)
    in_r, out_w, err_w = fds
    fcntl.fcntl(out_w, fcntl.F_SETPIPE_SZ, 1 << 20)
    os.write(out_w, b"x" * (1 << 20))
    for fd in fds:
        os.close(fd)
    sock.sendall(b"P 42\nX 0\n")
    sock.close()


def test_all_output_in_the_pipes_at_the_exit_report_is_read(monkeypatch):
    """What the command wrote before the init reported its exit is all read,
    even when crabd's reader comes back after the drain window (slow reads,
    window 0: a thread descheduled on a loaded host)."""
    import socket
    import threading
    import time

    from crabd import runner
    fast = runner.read_ready

    def slow(fd):
        time.sleep(0.02)
        return fast(fd)
    monkeypatch.setattr(runner, "read_ready", slow)  # every read of the channel goes through runner.take
    monkeypatch.setattr(channel, "DRAIN_AFTER_EXIT", 0.0)
    a, b = socket.socketpair()
    t = threading.Thread(target=_fake_init, args=(b,))
    t.start()
    cap = channel.run(a, ["sh"], [], "/", stdin=b"", timeout=30, cap=2 << 20)
    t.join(10)
    assert cap.status == "X 0" and len(cap.stdout) == 1 << 20 and cap.stdout_dropped == 0


def test_an_init_being_killed_is_not_the_channels_init():
    from crabd.runtime.channel import dying
    live = "Name:\t.crabd-init\nState:\tS (sleeping)\nSigPnd:\t0000000000000000\nShdPnd:\t0000000000000000\n"
    assert not dying(live)
    assert dying(live.replace("ShdPnd:\t0000000000000000", "ShdPnd:\t0000000000000100"))  # SIGKILL pending
    assert dying(live.replace("SigPnd:\t0000000000000000", "SigPnd:\t0000000000000100"))
    assert not dying(live.replace("ShdPnd:\t0000000000000000", "ShdPnd:\t0000000000010000"))  # SIGCHLD only
    assert dying(live.replace("S (sleeping)", "Z (zombie)"))
    assert dying(live.replace("S (sleeping)", "X (dead)"))
