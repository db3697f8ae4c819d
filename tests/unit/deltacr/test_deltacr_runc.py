import os
import subprocess
import time

import pytest

import deltacr.runc as runc_mod
from deltacr import (CommandFailed, CriuFailed, CriuUnavailable, DumpOptions, Runc, check_criu, criu_errors,
                     needs_sockopt_shim, skipped_in_flight)
from deltacr.compat import has_cap_sys_resource
from deltacr.runc import StallGuard, SubprocessCommandRunner, tree_activity
from deltacr.testing import FakeCommandRunner

DUMP_LOG = b"""(00.040) Error (criu/util.c:1533): rlimit: Can't setup RLIMIT_NOFILE for self: Operation not permitted
(00.050) Dumping path for 0 fd via self 17 [/dev/null]
(00.051) 3 fdinfo 1: pos: 0 flags: 2/0
(00.052) Error (criu/sk-unix.c:351): unix: Unix socket 212287 not found
(00.053) Error (criu/cr-dump.c:1681): Dump files (pid: 3) failed with -1
(00.060) Error (criu/cr-dump.c:2111): Dumping FAILED.
"""


@pytest.fixture(autouse=True)
def _fresh_cache():
    runc_mod._criu_cache.clear()
    yield
    runc_mod._criu_cache.clear()


def test_criu_errors_drop_the_rlimit_noise_and_keep_context():
    errors, context = criu_errors(DUMP_LOG.decode())
    assert len(errors) == 3 and "Unix socket 212287 not found" in errors[0]
    assert not any("RLIMIT" in e for e in errors)
    assert context[-1].endswith("flags: 2/0") and not any("RLIMIT" in c for c in context)


def test_skipped_in_flight_lists_the_listening_sockets_from_criu_info_lines():
    log = ("(00.081) Dumping inet socket at 5\n"
           "(00.081) Skipping in-flight connection (l) for 57de2f\n"
           "(00.090) Skipping in-flight connection (l) for a1\n")
    assert skipped_in_flight(log) == ["57de2f", "a1"]
    assert skipped_in_flight(DUMP_LOG.decode()) == []


def test_check_criu_lists_everything_missing():
    fake = FakeCommandRunner()
    fake.on("--version", output=b"Version: 3.16\n")
    fake.on("check", returncode=1, output=b"Error (criu/cr-check.c:1): vDSO layout\nDoes not look good.\n")
    fake.on("--feature", output=b"feature is supported\n")
    fake.on("--feature", "tcp_half_closed", returncode=1, output=b"not supported\n")
    with pytest.raises(CriuUnavailable) as ei:
        check_criu(fake, "criu", ["tcp_half_closed", "mnt_id"])
    missing = " ".join(ei.value.missing)
    assert "CRIU >= 3.17 (found 3.16)" in missing and "criu check" in missing and "tcp_half_closed" in missing
    assert "mnt_id" not in missing
    assert ei.value.fix


def test_check_criu_is_cached():
    fake = FakeCommandRunner()
    fake.on("check", output=b"Looks good.\n")
    fake.on("--feature", output=b"mnt_id is supported\n")
    a = check_criu(fake, "criu", ["mnt_id"])
    n = len(fake.calls)
    b = check_criu(fake, "criu", ["mnt_id"])
    assert a is b and len(fake.calls) == n
    assert a.version == (4, 1, 1) and "mnt_id" in a.features


def test_missing_criu_binary():
    with pytest.raises(CriuUnavailable, match="not installed"):
        check_criu(SubprocessCommandRunner(), "/nonexistent/criu")


def test_failed_dump_raises_criu_errors_and_keeps_the_log(tmp_path):
    fake = FakeCommandRunner()
    fake.on("checkpoint", returncode=1, output=b'level=error msg="criu failed: type NOTIFY errno 0"',
            writes={"dump.log": DUMP_LOG})
    r = Runc("/run/r", runner=fake)
    with pytest.raises(CriuFailed) as ei:
        r.checkpoint("sb-1", tmp_path / "img", tmp_path / "work", DumpOptions())
    e = ei.value
    assert "Unix socket 212287 not found" in str(e) and "dump of container sb-1" in str(e)
    assert "RLIMIT" not in str(e)
    assert e.log_path == str(tmp_path / "work" / "dump.log") and os.path.exists(e.log_path)
    # network-lock skip went to CRIU through CRIU_CONFIG_FILE
    env = fake.envs[-1]
    assert env and open(env["CRIU_CONFIG_FILE"]).read() == "network-lock skip\n"


def test_failure_before_criu_logged_anything_is_a_command_failure(tmp_path):
    fake = FakeCommandRunner()
    fake.on("checkpoint", returncode=1, output=b"container sb-1 does not exist")
    with pytest.raises(CommandFailed, match="does not exist"):
        Runc("/run/r", runner=fake).checkpoint("sb-1", tmp_path / "i", tmp_path / "w")


def test_restore_returns_the_pid(tmp_path):
    fake = FakeCommandRunner()
    fake.on("restore", writes={"restore.pid": b"4242\n"})
    pid = Runc("/run/r", runner=fake, loopback=False).restore("sb-1", tmp_path / "b", tmp_path / "i", tmp_path / "w")
    assert pid == 4242
    argv = fake.calls[-1]
    assert argv[argv.index("--pid-file") + 1] == str(tmp_path / "w" / "restore.pid")


def test_subprocess_runner_does_not_wait_for_inherited_pipes():
    # A child left holding the output pipe (as a restored init does) must
    # not keep the runner waiting for end of file.
    res = SubprocessCommandRunner().run(["/bin/sh", "-c", "echo hi; sleep 5 & echo $!; exit 3"], timeout=10)
    assert res.returncode == 3 and res.output.startswith(b"hi")
    child = int(res.output.split()[1])
    os.kill(child, 0)  # still holding the pipe: the runner did not wait for it
    os.kill(child, 9)


def test_subprocess_runner_timeout():
    res = SubprocessCommandRunner().run(["/bin/sleep", "5"], timeout=0.2)
    assert res.returncode is None


@pytest.mark.parametrize("version,kernel,need", [((4, 1, 1), "6.18.44-fc", True), ((4, 2), "6.18.0", False),
                                                 ((4, 1), "6.12.1", False), ((3, 17), "6.16.0", True)])
def test_sockopt_shim_needed_only_for_old_criu_on_new_kernels(version, kernel, need):
    assert needs_sockopt_shim(version, kernel) is need


def test_subprocess_runner_kills_a_stalled_command_and_its_whole_session():
    # runc's child (CRIU) is in runc's session: a stall kills both, not only runc.
    res = SubprocessCommandRunner().run(["/bin/sh", "-c", "sleep 30 & echo $!; wait"], timeout=30,
                                        progress=lambda: 0, stall=0.3)
    assert res.returncode is None and res.killed == "stalled"
    child = int(res.output.split()[0])
    for _ in range(500):
        try:
            with open(f"/proc/{child}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    break
        except FileNotFoundError:
            break
        time.sleep(0.01)
    else:
        raise AssertionError(f"the command's child {child} outlived the kill")


def test_subprocess_runner_progress_keeps_a_command_alive():
    ticks = iter(range(10**6))
    res = SubprocessCommandRunner().run(["/bin/sleep", "1"], timeout=30, progress=lambda: next(ticks), stall=0.3)
    assert res.returncode == 0 and not res.killed


def test_stall_guard_fires_only_after_stall_seconds_without_a_change():
    g = StallGuard(10.0, now=0.0)
    assert not g.stalled((100, 5), False, 0.5)
    assert not g.stalled((100, 5), False, 10.0)   # 9.5 s unchanged: not yet
    assert g.stalled((100, 5), False, 10.6)       # 10.1 s unchanged: a hung CRIU


def test_stall_guard_counts_work_without_log_growth_as_progress():
    # zdtm maps04 at load 20: a restore's log quiet for 10 s after "Restored"
    # while CRIU and its tasks still worked; the log bytes alone killed it.
    g = StallGuard(10.0, now=0.0)
    for i in range(1, 60):
        assert not g.stalled((4096, 1000 + i), False, i * 0.5)
    # and a task waiting for a CPU (runnable, nothing counted yet) is no hang either
    for i in range(60, 120):
        assert not g.stalled((4096, 1059), True, i * 0.5)
    assert g.stalled((4096, 1059), False, 120 * 0.5 + 10.5)


def _wait_state(pid, comm, state="S"):
    for _ in range(1000):
        try:
            with open(f"/proc/{pid}/stat") as f:
                data = f.read()
        except FileNotFoundError:
            data = ""
        if f"({comm})" in data and data.rsplit(")", 1)[1].split()[0] == state:
            return
        time.sleep(0.01)
    raise AssertionError(f"{pid} never became {comm} in state {state}")


def _children(pid):
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(x) for x in f.read().split()]


def test_tree_activity_sees_a_busy_descendant_and_not_a_blocked_one(tmp_path):
    busy = subprocess.Popen(["/bin/sh", "-c", "yes > /dev/null & wait"])
    idle = subprocess.Popen(["/bin/sh", "-c", "sleep 30 & wait"])
    try:
        for _ in range(500):
            if _children(busy.pid):
                break
            time.sleep(0.01)
        first = tree_activity(busy.pid)
        for _ in range(500):   # CPU time and bytes written grow, or it is runnable
            second = tree_activity(busy.pid)
            if second != first or second[1]:
                break
            time.sleep(0.01)
        else:
            raise AssertionError(f"a running `yes` showed no activity: {first} {second}")
        for _ in range(500):
            if _children(idle.pid):
                break
            time.sleep(0.01)
        _wait_state(_children(idle.pid)[0], "sleep")
        a = tree_activity(idle.pid)
        time.sleep(0.2)
        assert tree_activity(idle.pid) == a and not a[1]
    finally:
        for p in (busy, idle):
            subprocess.run(["pkill", "-KILL", "-P", str(p.pid)], check=False, timeout=10)
            p.kill()
            p.wait()


def test_tree_activity_leaves_runc_out(tmp_path):
    # runc's Go runtime wakes up while it only waits for CRIU: a process named
    # runc (here a busy `yes` under that name) must not count as progress.
    fake_runc = tmp_path / "runc"
    fake_runc.write_bytes(open("/usr/bin/yes", "rb").read())
    fake_runc.chmod(0o755)
    p = subprocess.Popen(["/bin/sh", "-c", f"{fake_runc} > /dev/null & wait"])
    try:
        for _ in range(500):
            if _children(p.pid):
                break
            time.sleep(0.01)
        child = _children(p.pid)[0]
        for _ in range(500):
            with open(f"/proc/{child}/comm") as f:
                if f.read().strip() == "runc":
                    break
            time.sleep(0.01)
        assert tree_activity(p.pid) == (0, False)
    finally:
        subprocess.run(["pkill", "-KILL", "-P", str(p.pid)], check=False, timeout=10)
        p.kill()
        p.wait()


def test_subprocess_runner_keeps_a_busy_command_whose_log_is_quiet():
    # the caller's progress (a log's bytes) never changes, but CRIU's tree works
    res = SubprocessCommandRunner().run(["/bin/sh", "-c", "timeout 1.5 sh -c 'while :; do :; done'; exit 0"],
                                        timeout=60, progress=lambda: 0, stall=0.3)
    assert not res.killed and res.returncode == 0, res


def test_a_killed_dump_says_so_with_crius_last_log_line(tmp_path):
    fake = FakeCommandRunner()
    fake.on("checkpoint", returncode=None, writes={"dump.log": b"(00.01) freezing\n(00.02) SEIZE 7 (comm sh): success\n"})
    with pytest.raises(CriuFailed) as ei:
        Runc("/r", runner=fake).checkpoint("sb-1", tmp_path / "img", tmp_path / "work")
    assert "killed with CRIU" in str(ei.value) and "SEIZE 7" in str(ei.value)


@pytest.mark.parametrize("cap_eff,has", [("000001fffeffffff", False), ("000001ffffffffff", True), ("0", False)])
def test_cap_sys_resource_from_status(cap_eff, has):
    assert has_cap_sys_resource(f"Name:\tx\nCapEff:\t{cap_eff}\n") is has


def test_tar_shim_adds_xattrs_to_criu_create_and_extract_only(tmp_path):
    from deltacr.compat import tar_shim_text
    echo = tmp_path / "real-tar"
    echo.write_text('#!/bin/sh\nprintf "%s|" "$@"\n')
    echo.chmod(0o755)
    shim = tmp_path / "tar"
    shim.write_text(tar_shim_text(str(echo)))
    shim.chmod(0o755)

    def run(*args: str) -> str:
        return subprocess.run([str(shim), *args], capture_output=True, text=True, check=True).stdout

    assert run("--create", "--gzip", "a b") == "--xattrs|--xattrs-include=*|--create|--gzip|a b|"
    assert run("--extract", "--directory", "/x") == "--xattrs|--xattrs-include=*|--extract|--directory|/x|"
    assert run("--version") == "--version|"
