"""The /proc fallback and the pid-following BPF variant, on real processes."""

from __future__ import annotations

import subprocess

import pytest

from ebpf import BPFUnavailable, Inspector, PlanKind, ProcInspector, classify
from ebpf._bcc import BccLoader
from ebpf.testing import CgroupCell, tree_state

pytestmark = pytest.mark.needs("bpf")


@pytest.fixture
def cell(tmp_path):
    with CgroupCell(tmp_path) as c:
        yield c


def test_proc_fallback_on_real_processes(cell):
    """The change probe here is the scratch-tree oracle: what deltafs's diff gives crabd."""
    last = {"state": tree_state(cell.scratch)}

    def probe(_sid):
        now = tree_state(cell.scratch)
        changed = sorted(k for k in set(now) | set(last["state"]) if now.get(k) != last["state"].get(k))
        last["state"] = now
        return changed

    insp = ProcInspector(probe)
    insp.watch("fb", cell.cgroup)
    plans = []
    for cmd in ["ls", "echo x > f", "python3 -m http.server 0 --bind 127.0.0.1 >/dev/null 2>&1 &", "true"]:
        insp.begin_turn("fb")
        cell.run(cmd)
        if "http.server" in cmd:
            import time
            time.sleep(1.0)  # let it bind: the fallback only sees sockets alive at the end
        e = insp.end_turn("fb")
        plans.append((classify(e).kind, e))
    assert [p for p, _ in plans[:3]] == [PlanKind.SKIP, PlanKind.FS, PlanKind.FS_PROC]
    assert plans[1][1].files["changed"].sample == ["f"]
    srv = plans[2][1]
    assert srv.source == "proc" and srv.external_unknown
    assert any(p.cmdline[:3] == ["python3", "-m", "http.server"] for p in srv.new_processes)
    assert srv.listening and srv.listening[0].address.startswith("127.0.0.1:")


def test_pid_following_variant(cell):
    """Without a unified hierarchy the program follows forks from registered pids."""
    insp = Inspector(BccLoader(follow_pids=True))
    try:
        insp.open()
    except BPFUnavailable as e:
        pytest.fail(f"BPF inspector cannot load on this host: {e}", pytrace=False)
    try:
        # a parked shell in the cell plays the container's init: runs commands on a fifo
        fifo = cell.scratch / "cmd"
        subprocess.run(["mkfifo", str(fifo)], check=True)
        init = subprocess.Popen(
            ["sh", "-c", f'echo $$ > {cell.cgroup}/cgroup.procs; while read c < {fifo}; do sh -c "$c"; done'],
            cwd=cell.scratch,
        )
        import time
        for _ in range(100):
            if cell.pids():
                break
            time.sleep(0.01)
        # the parked shell wakes for every command: it plays a stateless init
        insp.watch("pf", cell.cgroup, init_pid=init.pid, stateless_comms=frozenset({"sh"}))
        assert insp.source == "bpf-pids"

        def turn(cmd):
            insp.begin_turn("pf")
            fifo.write_text(cmd + "\n")
            time.sleep(0.5)
            return insp.end_turn("pf")

        e_skip = turn("ls >/dev/null")
        e_fs = turn("echo y > g")
        assert classify(e_skip).kind is PlanKind.SKIP, classify(e_skip).reasons
        assert classify(e_fs).kind is PlanKind.FS
        assert e_fs.files["write"].sample == ["g"]
    finally:
        init.kill()
        init.wait()
        insp.close()
