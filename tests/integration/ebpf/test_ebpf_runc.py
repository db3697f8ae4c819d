"""The inspector on a real runc sandbox: attribution by the container's
unified-hierarchy cgroup covers `runc exec`'d processes (not descendants of
the container's init), and crabd's own exec plumbing does not count."""

from __future__ import annotations

import pytest

from ebpf import BPFUnavailable, Inspector, classify

pytestmark = pytest.mark.needs("runc", "bpf", "busybox", "debian-py")

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


def test_runc_sandbox_turns(insp, runtime, busybox_image, sandbox_factory, monkeypatch):
    from crabd.runtime.oci import RUN_PATH as runtime_run_path

    assert runtime_run_path == RUN_PATH
    # `runc exec` itself (its wrapper's status fifo is checked below): with
    # the exec channel, the default, the init spawns the commands and runc
    # exec is only the fallback (test_exec_channel.py checks its attribution).
    monkeypatch.setattr(runtime, "exec_channel", False)
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


GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.invalid",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.invalid",
           "PIP_DISABLE_PIP_VERSION_CHECK": "1", "HOME": "/root"}


def test_labelled_turns_in_a_debian_sandbox(insp, runtime, debian_image, sandbox_factory):
    """The labelled set, in a real runc sandbox of the Debian image: every turn
    in its own directory of one sandbox; background processes a turn leaves
    are killed between turns (in a turn that is not scored). Turns needing
    the test peer or the project's pytest run in cells (test_ebpf_turns)."""
    from ebpf.testing import LABELLED_TURNS, make_wheel, tree_state

    sb = sandbox_factory(debian_image)
    insp.watch(sb.id, runtime.cgroup_v2_dir(sb.id), outside_paths=(RUN_PATH,))
    turns = [t for t in LABELLED_TURNS if not t.peer and "{venv_python}" not in t.cmd + t.setup]
    turns.append(type(turns[0])(
        "unittest (read-only)", "python3 -B -m unittest -q test_x 2>/dev/null", "SKIP",
        "printf 'import unittest\\nclass T(unittest.TestCase):\\n    def test_a(self):\\n"
        "        self.assertEqual(1, 1)\\n' > test_x.py"))
    results = {}
    try:
        for n, turn in enumerate(turns):
            d = f"/work/t{n}"
            runtime.exec(sb.id, f"mkdir -p {d}")
            if turn.setup == "make-wheel":
                make_wheel(sb.rootfs / d.lstrip("/"))
            elif turn.setup:
                r = runtime.exec(sb.id, turn.setup, cwd=d, env=GIT_ENV, timeout=120)
                assert r.exit_code == 0, (turn.name, r.stderr)
            insp.end_turn(sb.id)  # setup is no turn of ours
            host_dir = sb.rootfs / d.lstrip("/")
            before = tree_state(host_dir)
            insp.begin_turn(sb.id)
            r = runtime.exec(sb.id, turn.cmd, cwd=d, env=GIT_ENV, timeout=120)
            e = insp.end_turn(sb.id)
            changed = before != tree_state(host_dir)
            assert r.exit_code == 0, (turn.name, r.stderr)
            assert changed == (turn.label == "FS"), f"label of {turn.name!r} disagrees with the file tree"
            plan = classify(e)
            results[turn.name] = (turn.label, plan.kind.value, plan.reasons)
            # leave no background process to the next turn
            init = runtime.get(sb.id).pid  # the container's init: never killed
            for pid in runtime.pids(sb.id):
                if pid != init:
                    try:
                        __import__("os").kill(pid, 9)
                    except ProcessLookupError:
                        pass
            insp.end_turn(sb.id)
    finally:
        insp.unwatch(sb.id)
    rank = {"SKIP": 0, "FS": 1, "FS_PROC": 2}
    fn = {k: v for k, v in results.items() if rank[v[1]] < rank[v[0]]}
    fp = {k: v for k, v in results.items() if rank[v[1]] > rank[v[0]]}
    assert not fn, f"FALSE NEGATIVES: {fn}"
    assert not fp, f"false positives: {fp}"
    assert len(results) == len(turns) >= 20
