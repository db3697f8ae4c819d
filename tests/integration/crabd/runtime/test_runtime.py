"""Sandboxes under real runc: lifecycle, exec, limits, isolation, cleanup."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from crabd.errors import CommandNotFound, ExecTimeout, FailedPrecondition, NotFound, SandboxNotRunning
from crabd.runtime import Limits
from crabd.testing import wait_until

pytestmark = pytest.mark.needs("runc", "criu", "busybox", "debian-py")


def mounted(path: str) -> bool:
    return any(line.split()[4] == path for line in open("/proc/self/mountinfo"))


def cgroup_dirs(sid: str) -> list[str]:
    out = []
    for root, dirs, _ in os.walk("/sys/fs/cgroup"):
        if sid in dirs:
            out.append(os.path.join(root, sid))
        if root.count("/") > 5:
            dirs[:] = []
    return out


def test_debian_sandbox_runs_python_and_git(runtime, debian_image, sandbox_factory):
    sb = sandbox_factory(debian_image)
    r = runtime.exec(sb.id, ["python3", "-c", "print(1)"])
    assert (r.exit_code, r.stdout) == (0, "1\n")
    r = runtime.exec(sb.id, ["git", "--version"])
    assert r.exit_code == 0 and r.stdout.startswith("git version 2.")


def test_busybox_image_works_without_an_init_of_its_own(runtime, busybox_image, sandbox_factory):
    sb = sandbox_factory(busybox_image)
    assert sb.status == "running"
    # PID 1 is crabd's init, mounted from the host, not anything in the image.
    assert runtime.exec(sb.id, "cat /proc/1/cmdline").stdout.startswith("/dev/.crabd-init")
    assert not Path(runtime.images.get(busybox_image).path, "dev", ".crabd-init").exists()


def test_exec_argv_shell_env_cwd_stdin(runtime, busybox_image, sandbox_factory):
    sb = sandbox_factory(busybox_image)
    assert runtime.exec(sb.id, ["echo", "a b"]).stdout == "a b\n"
    r = runtime.exec(sb.id, "echo $GREETING from $(pwd); echo oops >&2; exit 7", env={"GREETING": "hi"}, cwd="/tmp")
    assert (r.exit_code, r.stdout, r.stderr) == (7, "hi from /tmp\n", "oops\n")
    assert runtime.exec(sb.id, ["cat"], stdin="fed\n").stdout == "fed\n"
    assert runtime.exec(sb.id, "kill -9 $$").exit_code == 137


def test_output_is_capped_with_a_marker(runtime, busybox_image, sandbox_factory):
    sb = sandbox_factory(busybox_image)
    r = runtime.exec(sb.id, "head -c 5000000 /dev/zero | tr '\\0' x", output_limit=4096)
    assert r.stdout_truncated
    assert r.stdout.startswith("x" * 4096)
    assert "[crabd: output truncated: 4995904 more bytes not shown]" in r.stdout


def test_background_process_does_not_hold_the_exec(runtime, busybox_image, sandbox_factory):
    sb = sandbox_factory(busybox_image)
    r = runtime.exec(sb.id, "sleep 300 & echo started")
    assert r.stdout == "started\n"
    assert "sleep 300" in runtime.exec(sb.id, "ps").stdout  # it outlives the turn


def test_exec_timeout_kills_the_command(runtime, busybox_image, sandbox_factory):
    sb = sandbox_factory(busybox_image)
    with pytest.raises(ExecTimeout) as ei:
        runtime.exec(sb.id, "echo before; sleep 77", timeout=1)
    assert ei.value.stdout == "before\n"
    time.sleep(0.2)
    assert "sleep 77" not in runtime.exec(sb.id, "ps").stdout


def test_missing_command_is_a_typed_error(runtime, busybox_image, sandbox_factory):
    sb = sandbox_factory(busybox_image)
    with pytest.raises(CommandNotFound, match="no-such-program"):
        runtime.exec(sb.id, ["no-such-program"])
    # Through a shell it is the shell's answer, as a user would expect.
    assert runtime.exec(sb.id, "no-such-program").exit_code == 127


def test_unknown_sandbox(runtime):
    with pytest.raises(NotFound):
        runtime.exec("sb-0000000000", "true")
    with pytest.raises(NotFound):
        runtime.destroy("../../../etc")


def test_dead_sandbox_is_reported_and_can_be_destroyed(runtime, busybox_image, sandbox_factory):
    sb = sandbox_factory(busybox_image)
    os.kill(sb.pid, signal.SIGKILL)  # the init dies, as in an OOM kill
    time.sleep(0.2)
    assert runtime.get(sb.id).status == "stopped"
    with pytest.raises(SandboxNotRunning):
        runtime.exec(sb.id, "true")
    runtime.start(sb.id)  # a fresh init on the same root
    assert runtime.exec(sb.id, "echo back").stdout == "back\n"


def test_loopback_only_network(runtime, busybox_image, sandbox_factory):
    sb = sandbox_factory(busybox_image)
    links = runtime.exec(sb.id, "ls /sys/class/net").stdout.split()
    assert links == ["lo"]
    r = runtime.exec(sb.id, "nc -l -p 8080 -e echo served & sleep 0.3; nc 127.0.0.1 8080 </dev/null")
    assert "served" in r.stdout


def test_limits_are_enforced(runtime, busybox_image, sandbox_factory):
    sb = sandbox_factory(busybox_image, limits=Limits(memory_bytes=64 * 1024**2, pids=32, cpus=0.5))
    mem = Path("/sys/fs/cgroup/memory/crabd", sb.id, "memory.limit_in_bytes")
    assert int(mem.read_text()) == 64 * 1024**2
    # A fork bomb stops at the pids limit and the sandbox survives it.
    r = runtime.exec(sb.id, "for i in $(seq 60); do sleep 20 & done 2>&1", timeout=30)
    assert "can't fork" in r.stdout
    assert len(runtime.pids(sb.id)) <= 32
    for pid in runtime.pids(sb.id):
        if pid != sb.pid:
            os.kill(pid, signal.SIGKILL)
    time.sleep(0.2)
    assert runtime.exec(sb.id, "echo alive").stdout == "alive\n"


def test_freeze_and_thaw(runtime, busybox_image, sandbox_factory):
    sb = sandbox_factory(busybox_image)
    runtime.exec(sb.id, "(i=0; while true; do i=$((i+1)); echo $i > /tmp/tick; usleep 1000; done) >/dev/null 2>&1 &")
    tick = Path(sb.rootfs, "tmp", "tick")
    # the loop runs before the freeze (a fast exec returns before its
    # background child got the CPU on a loaded host)
    wait_until(lambda: tick.exists() and tick.read_text().strip(), "the loop's first tick", 30)
    runtime.freeze(sb.id)
    try:
        state = Path("/sys/fs/cgroup/freezer/crabd", sb.id, "freezer.state").read_text().strip()
        assert state == "FROZEN"
        before = tick.read_text()
        time.sleep(0.2)
        assert tick.read_text() == before  # nothing runs while frozen
        with pytest.raises(FailedPrecondition, match="frozen"):
            runtime.exec(sb.id, "true")
    finally:
        runtime.thaw(sb.id)
    wait_until(lambda: tick.read_text() != before, "a tick after the thaw", 30)


def test_destroy_leaves_no_mounts_cgroups_or_files(runtime, busybox_image):
    sb = runtime.create(busybox_image)
    runtime.exec(sb.id, "sleep 100 & echo x > /tmp/f")
    rootfs = str(sb.rootfs)
    assert mounted(rootfs) and cgroup_dirs(sb.id)
    runtime.destroy(sb.id)
    assert not mounted(rootfs)
    assert cgroup_dirs(sb.id) == []
    assert not sb.dir.exists()
    with pytest.raises(NotFound):
        runtime.get(sb.id)


def test_writes_stay_in_the_sandbox(runtime, busybox_image, sandbox_factory):
    """A symlink in the sandbox pointing at a host path stays inside it."""
    sb = sandbox_factory(busybox_image)
    host = Path("/tmp/crabd-host-canary")
    host.write_text("host")
    runtime.exec(sb.id, f"ln -s {host} /tmp/link; echo sandbox > /tmp/link; mkdir -p /tmp && cat {host}")
    assert host.read_text() == "host"
    assert runtime.exec(sb.id, f"cat {host}").stdout == "sandbox\n"
    img = Path(runtime.images.get(busybox_image).path)
    assert not (img / "tmp" / "crabd-host-canary").exists()  # the image is untouched
    host.unlink()


def test_image_in_use_cannot_be_removed(runtime, busybox_image, sandbox_factory):
    sandbox_factory(busybox_image)
    with pytest.raises(FailedPrecondition, match="in use"):
        runtime.images.remove(busybox_image)
