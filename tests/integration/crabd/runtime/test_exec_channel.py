"""The fast exec path (issue 16 item 4): the sandbox's init spawns commands
over its channel (crabd/runtime/channel.py, init.c mode 3).

Every test here proves the channel ran the command, not the `runc exec`
fallback: the runtime's runner refuses any `capture` (that is how runc exec
runs), so a fallback fails the test. Needs a crabd-init built from this
tree's init.c (CRABD_INIT)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from crabd.errors import CommandNotFound, ExecError, ExecTimeout
from crabd.runner import SubprocessRunner
from crabd.runtime import Runtime
from crabd.runtime import channel
from crabd.testing import wait_until

pytestmark = pytest.mark.needs("runc", "criu", "bpf", "busybox", "debian-py")


class NoRuncExec(SubprocessRunner):
    """runc for everything but exec: a `runc exec` here is a test failure."""

    def capture(self, argv, **kw):  # type: ignore[override]
        raise AssertionError(f"the exec fell back to runc exec: {argv[:6]}")


@pytest.fixture(autouse=True)
def _init_has_the_channel():
    from crabd import config
    if channel.MAGIC.encode() not in config.init_binary().read_bytes():
        pytest.fail(f"{config.init_binary()} predates the exec channel: rebuild it from crabd/runtime/init.c "
                    "(scripts/setup-host) or point CRABD_INIT at such a build", pytrace=False)


@pytest.fixture
def fast(runtime):
    return Runtime(runtime.state_dir, runner=NoRuncExec(), exec_channel=True)


@pytest.fixture
def box(fast, busybox_image):
    sb = fast.create(busybox_image)
    yield sb
    fast.destroy(sb.id)


def test_argv_shell_env_cwd_and_stdin(fast, box):
    r = fast.exec(box.id, "echo out; echo err >&2; cat; pwd; echo $FOO; exit 3", stdin="in\n",
                  env={"FOO": "bar"}, cwd="/tmp")
    assert (r.exit_code, r.stdout, r.stderr) == (3, "out\nin\n/tmp\nbar\n", "err\n")
    assert fast.exec(box.id, ["echo", "a b", "c"]).stdout == "a b c\n"
    big = os.urandom(1 << 20).hex()   # 2 MiB of stdin, more than any pipe buffer
    r = fast.exec(box.id, "wc -c", stdin=big)
    assert r.stdout.strip() == str(len(big))
    assert fast.exec(box.id, "cat").stdout == ""   # no stdin: end of file at once


def test_big_outputs_are_capped_with_a_marker(fast, box):
    r = fast.exec(box.id, "head -c 3000000 /dev/zero | tr '\\0' x", output_limit=1 << 20)
    assert r.stdout_truncated and r.stdout.startswith("x" * (1 << 20))
    assert "more bytes not shown" in r.stdout
    r = fast.exec(box.id, "head -c 200000 /dev/zero | tr '\\0' y; head -c 200000 /dev/zero | tr '\\0' z >&2")
    assert (len(r.stdout), len(r.stderr)) == (200000, 200000) and not r.stdout_truncated


def _pids_of(fast, sid, word):
    out = fast.exec(sid, "ps -o pid,args").stdout
    return [ln for ln in out.splitlines() if word in ln and "ps -o" not in ln]


def test_timeout_kills_the_command_and_its_children(fast, box):
    t0 = time.monotonic()
    with pytest.raises(ExecTimeout):
        fast.exec(box.id, "sleep 997 & sleep 998; echo never", timeout=1)
    assert time.monotonic() - t0 < 30   # a hang guard, not a latency check
    wait_until(lambda: not _pids_of(fast, box.id, "sleep 99"), "the killed tree to be gone", 30)


def test_signals_are_reported_as_128_plus_the_signal(fast, box):
    assert fast.exec(box.id, "kill -TERM $$").exit_code == 128 + signal.SIGTERM
    assert fast.exec(box.id, "kill -KILL $$").exit_code == 128 + signal.SIGKILL
    # the command's signal state is clean: PID 1 blocks everything, its children must not
    assert fast.exec(box.id, "grep SigBlk /proc/self/status").stdout.split()[1].strip("0") == ""


def test_a_background_child_does_not_hold_the_exec(fast, box):
    t0 = time.monotonic()
    r = fast.exec(box.id, "sleep 1000 & echo started", timeout=20)
    assert r.stdout == "started\n" and time.monotonic() - t0 < 10
    assert _pids_of(fast, box.id, "sleep 1000")


def test_missing_command_and_cwd_are_typed_errors(fast, box):
    with pytest.raises(CommandNotFound):
        fast.exec(box.id, ["no-such-program"])
    with pytest.raises(ExecError):
        fast.exec(box.id, ["true"], cwd="/no/such/dir")


def test_same_cgroup_namespaces_and_capabilities_as_runc_exec(runtime, fast, box):
    """The inspector attributes by cgroup: a channel command is in the
    sandbox's cgroups, like a runc exec'd one; same namespaces and caps."""
    probe = "cat /proc/self/cgroup; for n in mnt pid net ipc uts cgroup time; do readlink /proc/self/ns/$n; done; " \
            "grep -E '^Cap(Inh|Prm|Eff|Bnd|Amb)' /proc/self/status"
    fast_out = fast.exec(box.id, probe).stdout
    slow = Runtime(runtime.state_dir, exec_channel=False)
    sb2 = slow.create("busybox")   # no channel in its init: its execs are runc execs
    try:
        slow_out = slow.exec(sb2.id, probe).stdout.replace(sb2.id, box.id)
    finally:
        slow.destroy(sb2.id)
    assert f"0::/crabd/{box.id}" in fast_out
    # namespaces differ between sandboxes; compare the shape, and the caps exactly
    assert [ln for ln in fast_out.splitlines() if ln.startswith("Cap")] == \
           [ln for ln in slow_out.splitlines() if ln.startswith("Cap")]
    assert len(fast_out.splitlines()) == len(slow_out.splitlines())


def test_only_crabd_is_served(fast, runtime, debian_image):
    """A process of the sandbox that connects to the channel is closed
    unanswered, and nothing runs; crabd's own check refuses a listener that
    is not the sandbox's init."""
    sb = fast.create(debian_image)
    try:
        hostile = (
            "import socket, struct\n"
            "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
            "s.connect(b'\\0crabd-exec')\n"
            "body = b'\\0'.join([b'crabd-exec-1', b'/', b'2', b'touch', b'/tmp/pwned']) + b'\\0'\n"
            "r, w = __import__('os').pipe()\n"
            "try:\n"
            "    socket.send_fds(s, [struct.pack('<I', len(body)) + body], [r, w, w])\n"
            "except OSError as e:\n"
            "    print('send', e)\n"
            "s.settimeout(5)\n"
            "try:\n"
            "    print('reply', s.recv(100))\n"
            "except OSError as e:\n"
            "    print('error', e)\n")
        r = fast.exec(sb.id, ["python3", "-c", hostile])
        assert "reply b''" in r.stdout or "error" in r.stdout, r
        assert fast.exec(sb.id, "test -e /tmp/pwned; echo $?").stdout == "1\n"
        # crabd's side: a pid that is not the sandbox's init is never connected to
        with pytest.raises(channel.Unavailable):
            channel.connect(os.getpid(), sb.cgroup_rel)
    finally:
        fast.destroy(sb.id)


def _no_runc_exec_in(state: Path) -> Runtime:
    return Runtime(state, runner=NoRuncExec(), exec_channel=True)


def _settled(c, sid):
    return wait_until(lambda: all(k["state"] != "pending" for k in c.checkpoints(sid, all=True)),
                      f"settled checkpoints of {sid}", 240)


def _recover(c, sid):
    """kill -9 the init; the rollback event of the automatic recovery."""
    since = c.last_event_seq()
    os.kill(c.sandbox(sid)["pid"], signal.SIGKILL)
    return wait_until(lambda: next((e["data"] for e in c.events(since=since, sandbox=sid)
                                    if e["kind"] == "sandbox.rolled_back"), None), "automatic recovery", 120)


def test_channel_after_rollback_restore_and_daemon_restart(start_daemon):
    """The init's channel comes back with a CRIU restore (its network
    namespace is restored with it), in the init's time namespace, and a
    restarted daemon uses it at once."""
    d = start_daemon(env={"CRABD_EXEC_CHANNEL": "1"})
    c = d.client()
    sid = c.create_sandbox("busybox")["id"]
    r1 = c.exec(sid, "sleep 1000 >/dev/null 2>&1 & echo 1 > /root/n")
    assert r1["plan"] == "FS_PROC", r1
    _settled(c, sid)
    c.exec(sid, "echo 2 > /root/n")
    _settled(c, sid)
    rb = c.rollback(sid, r1["checkpoint"])
    assert "proc" in rb["restored"], rb   # CRIU restored the init (with its listener), not a fresh init
    fast = _no_runc_exec_in(d.state)
    r = fast.exec(sid, "cat /root/n; ps -o args; readlink /proc/self/ns/time; readlink /proc/1/ns/time")
    assert r.stdout.startswith("1\n") and "sleep 1000" in r.stdout, r
    own, init = r.stdout.strip().splitlines()[-2:]
    assert own == init   # the command is in the restored init's time namespace

    # automatic recoveries after kills, twice: the second restores a dump of
    # an init that was restored (and promoted from a standby, with its
    # SIGCONT) before; a signal left pending in the init made CRIU fail there
    for n in (1001, 1002):
        _settled(c, sid)
        assert "proc" in _recover(c, sid)["restored"]
        assert "sleep 1000" in fast.exec(sid, "ps -o args").stdout
        r = c.exec(sid, f"sleep {n} >/dev/null 2>&1 & echo {n} > /root/n")
        assert r["exit_code"] == 0 and r["plan"] == "FS_PROC", r
    _settled(c, sid)
    assert "proc" in _recover(c, sid)["restored"]
    ps = fast.exec(sid, "ps -o args").stdout
    assert "sleep 1001" in ps and "sleep 1002" in ps, ps

    # a daemon restart: the channel is the init's, nothing to re-create
    d.kill9()
    d.start()
    c = d.client()
    r = c.exec(sid, "echo after-restart")
    assert r["exit_code"] == 0 and r["stdout"] == "after-restart\n"
    # that turn's capture (everything, after a restart) freezes the sandbox;
    # the runtime's own exec refuses a frozen one, so wait for it
    _settled(c, sid)
    assert fast.exec(sid, "echo direct").stdout == "direct\n"


def test_an_init_binary_without_the_channel_is_started_without_it(runtime, busybox_image, tmp_path):
    """CRABD_EXEC_CHANNEL=1 with a crabd-init built before the channel: the
    sandbox starts as before (no `--channel` the old init would refuse)."""
    old = tmp_path / "crabd-init-old"
    old.write_bytes(runtime.init_binary.read_bytes().replace(channel.MAGIC.encode(), b"x" * len(channel.MAGIC)))
    old.chmod(0o755)
    rt = Runtime(runtime.state_dir, init_binary=old, exec_channel=True)
    sb = rt.create(busybox_image)
    try:
        assert "--channel" not in Path(f"/proc/{sb.pid}/cmdline").read_bytes().decode()
        assert rt.exec(sb.id, ["true"]).exit_code == 0
    finally:
        rt.destroy(sb.id)


def test_a_sandbox_without_the_channel_falls_back_to_runc_exec(runtime, busybox_image):
    slow = Runtime(runtime.state_dir, exec_channel=False)
    sb = slow.create(busybox_image)
    try:
        with pytest.raises(AssertionError, match="fell back to runc exec"):
            Runtime(runtime.state_dir, runner=NoRuncExec(), exec_channel=True).exec(sb.id, ["true"])
        assert slow.exec(sb.id, ["true"]).exit_code == 0
    finally:
        slow.destroy(sb.id)
