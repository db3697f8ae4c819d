"""Live migration between two daemons through a real registry, and pulls cut
short (issue 18).

Two `crabd serve` on separate state directories and sockets stand for two
hosts; Debian's docker-registry runs on 127.0.0.1 (`LocalRegistry`). A kill
of either daemon mid-migration must leave the sandbox running on exactly one
of them, with nothing lost; a daemon killed mid-pull shows nothing
half-imported after its restart.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from typing import Any

import pytest

from crabd.errors import CrabdError
from crabd.remote.testing import LocalRegistry
from crabd.testing import CRABD, settled_checkpoint, wait_until

pytestmark = pytest.mark.needs("runc", "criu", "bpf", "busybox", "registry")

# A server with state only in memory (the shell's counter) and a listening socket.
SERVER = ("mkdir -p /srv; echo v1 > /srv/index.html; (httpd -f -p 8000 -h /srv >/dev/null 2>&1 &); "
          "(i=0; while true; do i=$((i+1)); echo $i > /tmp/count; sleep 0.1; done >/dev/null 2>&1 &); sleep 0.5")
CHAOS = {"CRABD_CHAOS_SLEEP": "60"}


@pytest.fixture
def registry(tmp_path):
    with LocalRegistry(tmp_path / "registry") as reg:
        yield reg


def _serving(c: Any, sid: str) -> int:
    """The sandbox answers on its server's socket; returns its counter."""
    assert c.exec(sid, "wget -q -O - http://127.0.0.1:8000/index.html")["stdout"] == "v2\n"
    return int(c.exec(sid, "cat /tmp/count")["stdout"])


def _server_sandbox(c: Any) -> tuple[str, int]:
    sid = c.create_sandbox("busybox", name="mover")["id"]
    r = c.exec(sid, SERVER)
    assert r["plan"] == "FS_PROC", r
    settled_checkpoint(c, r["checkpoint"])
    r = c.exec(sid, "echo v2 > /srv/index.html; mkdir -p /data; echo kept > /data/f")
    settled_checkpoint(c, r["checkpoint"])
    time.sleep(0.5)
    return sid, _serving(c, sid)


def _in_thread(fn: Any) -> tuple[threading.Thread, dict[str, Any]]:
    res: dict[str, Any] = {}

    def run() -> None:
        try:
            res["ok"] = fn()
        except Exception as e:  # noqa: BLE001 - the test inspects it
            res["error"] = e

    t = threading.Thread(target=run)
    t.start()
    return t, res


def _kill_mid_migration(ca: Any, sid: str, ref: str, target: Any, victim: Any, point: str) -> None:
    """Migrate in a thread, SIGKILL `victim` at chaos point `point`, restart
    it without chaos; the migration call fails."""
    t, res = _in_thread(lambda: ca.migrate_sandbox(sid, ref, target.socket))
    wait_until(lambda: f"crabd-chaos: {point}" in victim.log.read_text(), f"the migration at {point}", timeout=300)
    victim.kill9()
    t.join(300)
    assert isinstance(res.get("error"), CrabdError), res
    victim.env = None
    victim.start()


def _runs_on_the_source_only(ca: Any, cb: Any, sid: str, before: int, data: str = "kept\n") -> None:
    """Thawed and running on A, its memory and files intact; B holds nothing of it."""
    (sb,) = ca.sandboxes()
    assert sb["id"] == sid and sb["status"] == "running", sb
    assert _serving(ca, sid) > before
    assert ca.exec(sid, "cat /data/f")["stdout"] == data
    assert cb.sandboxes() == []


def _migrate_cli(a: Any, b: Any, sid: str, ref: str) -> dict[str, Any]:
    out = subprocess.run([CRABD, "sandbox", "migrate", sid, "--to", ref, "--target-socket", str(b.socket),
                          "--socket", str(a.socket), "--json"], capture_output=True, timeout=600)
    assert out.returncode == 0, out.stderr
    r: dict[str, Any] = json.loads(out.stdout)
    return r


def test_target_killed_then_migrated_then_source_killed_runs_on_exactly_one_host(start_daemon, registry):
    # Killed in the pull after the freeze: the delta imported, the sandbox not yet started.
    a, b = start_daemon(), start_daemon(env={"CRABD_CHAOS": "remote_restore", **CHAOS})
    ca, cb = a.client(), b.client()
    sid, before = _server_sandbox(ca)
    _kill_mid_migration(ca, sid, f"{registry.host}/crabd/mig:2", b, b, "remote_restore")
    _runs_on_the_source_only(ca, cb, sid, before)
    assert not any((b.state / "remote" / "tmp").glob("*"))
    # A second migration (the CLI, to a repository that has nothing yet)
    # goes through; its prefetch imports the whole chain again (nothing of
    # the half-imported one was kept).
    r = _migrate_cli(a, b, sid, f"{registry.host}/crabd/mig-again:1")
    assert r["status"] == "running" and r["restored"] == "fs+proc", r
    assert isinstance(r["downtime_ms"], (int, float)) and set(r["phases_ms"]) >= {"freeze", "capture", "push", "pull"}, r
    assert set(r["push_timing_ms"]) >= {"verify", "fs_diff", "fs_layer", "proc", "manifest"}, r
    # The target prefetched the chain while the source ran: after the freeze
    # it imported only the migration checkpoint's layer.
    assert r["prefetch"]["fs_layers_reused"] == 0 and r["prefetch"]["fs_layers_imported"] >= 2, r
    assert r["pull"]["fs_layers_imported"] == 1 and r["pull"]["fs_layers_reused"] >= 2, r
    # Pre-copy sent the chain; the frozen push only the delta.
    assert r["precopy"]["blobs_pushed"] >= 3 and r["push"]["blobs_skipped"] >= 2, r
    assert r["push"]["bytes_pushed"] < r["precopy"]["bytes_pushed"], r
    # Exactly one host runs it: B, under its name; A has nothing left.
    assert ca.sandboxes() == []
    (sb,) = cb.sandboxes()
    assert sb["id"] == r["target_sandbox"] and sb["name"] == "mover" and sb["status"] == "running", sb
    nid = r["target_sandbox"]
    after = _serving(cb, nid)
    assert after > before, (before, after)  # went on from its memory (a new process starts at 1)
    assert cb.exec(nid, "cat /data/f")["stdout"] == "kept\n"
    # It goes on taking turns on B.
    r2 = cb.exec(nid, "echo more >> /data/f")
    settled_checkpoint(cb, r2["checkpoint"])
    assert cb.exec(nid, "cat /data/f")["stdout"] == "kept\nmore\n"
    # Back the other way, B the source now (restarted with a chaos point; its
    # sandbox re-adopted): B killed frozen, its migration checkpoint taken,
    # before the delta push. Restarted, it finds the sandbox frozen and thaws
    # it; A holds nothing of it.
    b.stop()
    b.env = {"CRABD_CHAOS": "migrate_frozen", **CHAOS}
    b.start()
    _kill_mid_migration(cb, nid, f"{registry.host}/crabd/mig:3", a, b, "migrate_frozen")
    _runs_on_the_source_only(cb, ca, nid, after, "kept\nmore\n")


def test_killed_mid_pull_nothing_half_imported_and_imported_layers_collected(start_daemon, registry):
    a, b = start_daemon(), start_daemon(env={"CRABD_CHAOS": "remote_import", **CHAOS})
    ca, cb = a.client(), b.client()
    sid = ca.create_sandbox("busybox")["id"]
    r = ca.exec(sid, "echo precious > /root/f")
    settled_checkpoint(ca, r["checkpoint"])
    ref = ca.push_checkpoint(r["checkpoint"], f"{registry.host}/crabd/pull:1")["pinned"]
    t, res = _in_thread(lambda: cb.pull_sandbox(ref))
    wait_until(lambda: "crabd-chaos: remote_import" in b.log.read_text(), "the pull mid-import", timeout=300)
    b.kill9()
    t.join(120)
    assert "error" in res, res
    b.env = None
    b.start()
    assert cb.sandboxes() == []
    assert not any((b.state / "remote" / "tmp").glob("*"))
    # The layer committed before the kill was collected at the start: the
    # second pull imports the whole chain.
    got = cb.pull_sandbox(ref)
    assert got["fs_layers_reused"] == 0 and got["fs_layers_imported"] == 2, got
    assert cb.exec(got["sandbox"], "cat /root/f")["stdout"] == "precious\n"
    # With two sandboxes on the chain, one destroyed: the layers stay for the other.
    other = cb.pull_sandbox(ref, processes=False)
    assert other["fs_layers_reused"] == 2, other
    cb.delete_sandbox(got["sandbox"])
    assert cb.exec(other["sandbox"], "cat /root/f")["stdout"] == "precious\n"
    # The last one gone, nothing refers to them: collected, a pull imports them again.
    cb.delete_sandbox(other["sandbox"])
    again = cb.pull_sandbox(ref, processes=False)
    assert again["fs_layers_reused"] == 0 and again["fs_layers_imported"] == 2, again
