"""The inspector on a real runc sandbox: attribution by the container's
unified-hierarchy cgroup covers `runc exec`'d processes (not descendants of
the container's init), and crabd's own exec plumbing does not count."""

from __future__ import annotations

import pytest

from ebpf import BPFUnavailable, Inspector, PlanKind, classify

pytestmark = pytest.mark.integration

# crabd's exec wrapper reports through a fifo under this bind-mounted
# directory (crabd.runtime.oci.RUN_PATH): not the sandbox's file system.
RUN_PATH = "/dev/.crabd"


@pytest.fixture(scope="module")
def insp():
    i = Inspector()
    try:
        i.open()
    except BPFUnavailable as e:
        pytest.fail(f"BPF inspector cannot load on this host: {e}", pytrace=False)
    yield i
    i.close()


def test_runc_sandbox_turns(insp, runtime, busybox_image, sandbox_factory):
    from crabd.runtime.oci import RUN_PATH as runtime_run_path

    assert runtime_run_path == RUN_PATH
    sb = sandbox_factory(busybox_image)
    cg = runtime.cgroup_v2_dir(sb.id)
    assert cg is not None and cg.is_dir(), "the runtime gave no unified-hierarchy cgroup"
    insp.watch(sb.id, cg, outside_paths=(RUN_PATH,))
    try:
        plans = {}
        for name, cmd in [
            ("ls", "ls -la / >/dev/null"),
            ("cat", "cat /etc/passwd"),
            ("write", "echo hi > /root/f"),
            ("rm", "rm /root/f"),
            ("tmp", "echo x > /tmp/x"),
            ("bg", "sleep 1000 >/dev/null 2>&1 &"),
            ("idle", "true"),
            ("kill", "kill $(pidof sleep)"),
            ("short", "sleep 0.1 & wait"),
        ]:
            insp.begin_turn(sb.id)
            r = runtime.exec(sb.id, cmd)
            assert r.exit_code == 0, (name, r.stderr)
            e = insp.end_turn(sb.id)
            plans[name] = (classify(e), e)
        got = {n: p.kind.value for n, (p, _e) in plans.items()}
        assert got == {
            "ls": "SKIP", "cat": "SKIP", "write": "FS", "rm": "FS", "tmp": "FS", "bg": "FS_PROC",
            "idle": "SKIP", "kill": "FS_PROC", "short": "SKIP",
        }, {n: p.reasons for n, (p, _e) in plans.items()}
        # runc exec'd processes were attributed: their execs were seen
        ls_effects = plans["ls"][1]
        assert any(x.argv[-1:] == ["ls -la / >/dev/null"] for x in ls_effects.execs), ls_effects.execs
        assert ls_effects.special_writes["outside"].count >= 1  # the status fifo
        assert plans["write"][1].files["write"].sample == ["/root/f"]
    finally:
        insp.unwatch(sb.id)
