"""Checkpoints through a real OCI registry between two daemons (issue 18).

Two `crabd serve` on separate state directories and sockets stand for two
hosts; Debian's docker-registry runs on 127.0.0.1 with its own storage
(`crabd.remote.testing.LocalRegistry`), without and with htpasswd auth.
"""

from __future__ import annotations

import base64
import json
import subprocess
import threading
import time

import pytest

from crabd.errors import IntegrityError, RegistryError
from crabd.remote.testing import LocalRegistry
from crabd.testing import CRABD, settled_checkpoint, wait_until

pytestmark = pytest.mark.needs("runc", "criu", "bpf", "busybox", "registry")


@pytest.fixture
def registry(tmp_path):
    with LocalRegistry(tmp_path / "registry") as reg:
        yield reg


@pytest.fixture
def auth_registry(tmp_path):
    with LocalRegistry(tmp_path / "registry-auth", user="crab", password="s3cret") as reg:
        yield reg


SERVER = ("mkdir -p /srv; echo v1 > /srv/index.html; (httpd -f -p 8000 -h /srv >/dev/null 2>&1 &); "
          "(i=0; while true; do i=$((i+1)); echo $i > /tmp/count; sleep 0.1; done >/dev/null 2>&1 &); sleep 0.5")


def test_push_then_create_from_on_another_daemon_keeps_files_and_processes(start_daemon, registry):
    a, b = start_daemon(), start_daemon()
    ca, cb = a.client(), b.client()
    sid = ca.create_sandbox("busybox")["id"]
    r1 = ca.exec(sid, SERVER)
    assert r1["plan"] == "FS_PROC", r1
    settled_checkpoint(ca, r1["checkpoint"])
    p1 = ca.push_checkpoint(r1["checkpoint"], f"{registry.host}/crabd/demo:turn1")
    assert p1["blobs_pushed"] >= 3 and p1["proc_packs"] >= 1, p1  # image layer, turn layer, pack(s), config
    # Turn 2 changes a little: its push sends only that.
    r2 = ca.exec(sid, "mkdir -p /data; echo two > /data/f2; ln /data/f2 /data/f2-link; rm /srv/index.html; "
                      "echo v2 > /srv/index.html; ln -s /data/f2 /data/sym; mkfifo /data/fifo")
    settled_checkpoint(ca, r2["checkpoint"])
    p2 = ca.push_checkpoint(r2["checkpoint"], f"{registry.host}/crabd/demo:turn2")
    assert p2["blobs_skipped"] >= 2, p2
    assert p2["bytes_pushed"] < p1["bytes_pushed"] / 5, (p1, p2)

    got = cb.pull_sandbox(f"{registry.host}/crabd/demo:turn2")
    assert got["status"] == "running" and got["restored"] == "fs+proc", got
    nid = got["sandbox"]
    assert cb.exec(nid, "wget -q -O - http://127.0.0.1:8000/index.html")["stdout"] == "v2\n"
    out = cb.exec(nid, "cat /data/f2; stat -c '%h %F' /data/f2; readlink /data/sym; stat -c %F /data/fifo")["stdout"]
    assert out.split("\n")[:4] == ["two", "2 regular file", "/data/f2", "fifo"], out
    # The counter goes on from its value in memory (a fresh process would start at 1).
    first = int(cb.exec(nid, "cat /tmp/count")["stdout"])
    time.sleep(0.5)
    later = int(cb.exec(nid, "cat /tmp/count")["stdout"])
    assert later > first > 5, (first, later)
    # Pulling turn 1 now reuses the image layer and the chunks B has.
    again = cb.pull_sandbox(f"{registry.host}/crabd/demo:turn1", processes=False)
    assert again["fs_layers_reused"] >= 1 and again["restored"] == "fs", again
    assert cb.exec(again["sandbox"], "cat /srv/index.html")["stdout"] == "v1\n"
    # The source keeps running.
    assert ca.exec(sid, "wget -q -O - http://127.0.0.1:8000/index.html")["stdout"] == "v2\n"


def test_a_tampered_blob_is_refused_and_nothing_is_imported(start_daemon, registry):
    a, b = start_daemon(), start_daemon()
    ca, cb = a.client(), b.client()
    sid = ca.create_sandbox("busybox")["id"]
    r = ca.exec(sid, "echo precious > /root/f")
    settled_checkpoint(ca, r["checkpoint"])
    ref = f"{registry.host}/crabd/tamper:1"
    ca.push_checkpoint(r["checkpoint"], ref)
    manifest = json.loads(subprocess.run(
        ["curl", "-sf", "-H", "Accept: application/vnd.oci.image.manifest.v1+json",
         f"http://{registry.host}/v2/crabd/tamper/manifests/1"], capture_output=True, timeout=30, check=True).stdout)
    top = manifest["layers"][-1]["digest"]  # the turn's layer (busybox holds no process image here)
    blob = registry.blob_path(top)
    good = blob.read_bytes()
    data = bytearray(good)
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    with pytest.raises(IntegrityError) as e:
        cb.pull_sandbox(ref)
    assert "does not match its digest" in e.value.message
    assert cb.sandboxes() == []
    assert not any((b.state / "remote" / "tmp").iterdir())
    # Nothing was imported: with the blob repaired, the pull finds no layer of
    # the chain already here (the image layer, good all along, was not kept either).
    blob.write_bytes(good)
    got = cb.pull_sandbox(ref)
    assert got["fs_layers_reused"] == 0 and got["fs_layers_imported"] == 2, got
    assert cb.exec(got["sandbox"], "cat /root/f")["stdout"] == "precious\n"


def test_basic_auth_explicit_and_from_docker_config(start_daemon, auth_registry, tmp_path):
    cfg_dir = tmp_path / "docker"
    cfg_dir.mkdir()
    token = base64.b64encode(b"crab:s3cret").decode()
    (cfg_dir / "config.json").write_text(json.dumps({"auths": {auth_registry.host: {"auth": token}}}))
    a, b = start_daemon(), start_daemon(env={"DOCKER_CONFIG": str(cfg_dir)})
    ca, cb = a.client(), b.client()
    sid = ca.create_sandbox("busybox")["id"]
    r = ca.exec(sid, "echo hi > /root/f")
    settled_checkpoint(ca, r["checkpoint"])
    ref = f"{auth_registry.host}/crabd/auth:1"
    with pytest.raises(RegistryError) as e:
        ca.push_checkpoint(r["checkpoint"], ref)
    assert "credentials" in str(e.value)
    with pytest.raises(RegistryError):
        ca.push_checkpoint(r["checkpoint"], ref, registry_auth="crab:wrong")
    # The CLI, with --json, as a script would call it.
    out = subprocess.run([CRABD, "checkpoint", "push", r["checkpoint"], ref, "--registry-auth", "crab:s3cret",
                          "--socket", str(a.socket), "--json"], capture_output=True, timeout=300)
    assert out.returncode == 0, out.stderr
    pushed = json.loads(out.stdout)
    assert pushed["digest"].startswith("sha256:")
    # B's credentials come from its Docker config; the reference is pinned by digest.
    got = cb.pull_sandbox(pushed["pinned"])
    assert cb.exec(got["sandbox"], "cat /root/f")["stdout"] == "hi\n"
    out = subprocess.run([CRABD, "sandbox", "create", "--from", pushed["pinned"], "--socket", str(b.socket),
                          "--json"], capture_output=True, timeout=300)
    assert out.returncode == 0 and json.loads(out.stdout)["status"] == "running", out.stderr
    # fork --to: the source sandbox keeps running, the fork runs on B.
    out = subprocess.run([CRABD, "fork", r["checkpoint"], "--to", f"{auth_registry.host}/crabd/auth:fork",
                          "--target-socket", str(b.socket), "--registry-auth", "crab:s3cret",
                          "--socket", str(a.socket), "--json"], capture_output=True, timeout=300)
    assert out.returncode == 0, out.stderr
    fork = json.loads(out.stdout)
    assert len(fork["sandboxes"]) == 1 and fork["push"]["blobs_skipped"] >= 2, fork  # A's blobs were there
    assert cb.exec(fork["sandboxes"][0], "cat /root/f")["stdout"] == "hi\n"
    assert ca.exec(sid, "cat /root/f")["stdout"] == "hi\n"


def test_registry_gone_mid_push_is_a_clear_error_and_nothing_is_lost(start_daemon, tmp_path):
    reg = LocalRegistry(tmp_path / "registry").start()
    try:
        a = start_daemon(env={"CRABD_CHAOS": "remote_push", "CRABD_CHAOS_SLEEP": "3"})
        ca = a.client()
        sid = ca.create_sandbox("busybox")["id"]
        r = ca.exec(sid, "echo keep > /root/f")
        settled_checkpoint(ca, r["checkpoint"])
        ref = f"{reg.host}/crabd/gone:1"
        res: dict[str, object] = {}

        def push() -> None:
            try:
                res["ok"] = ca.push_checkpoint(r["checkpoint"], ref)
            except Exception as e:  # noqa: BLE001 - the test inspects it
                res["error"] = e

        t = threading.Thread(target=push)
        t.start()
        wait_until(lambda: "crabd-chaos: remote_push" in a.log.read_text(), "the push between blobs and manifest",
                   timeout=120)
        reg.kill()
        t.join(60)
        err = res.get("error")
        assert isinstance(err, RegistryError), res
        assert "unreachable" in err.message and err.fix, err
        # Nothing lost here: the checkpoint and the sandbox are as they were.
        assert ca.checkpoint(r["checkpoint"])["state"] == "committed"
        assert ca.exec(sid, "cat /root/f")["stdout"] == "keep\n"
        # The registry back (same storage): the retry skips the blobs it got.
        reg = LocalRegistry(tmp_path / "registry", port=reg.port).start()
        again = ca.push_checkpoint(r["checkpoint"], ref)
        assert again["blobs_skipped"] >= 2, again
    finally:
        reg.stop()
