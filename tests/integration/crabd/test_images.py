"""Image imports from a directory, a tarball and a Docker engine; removal."""

from __future__ import annotations

import io
import json
import subprocess
import tarfile
from pathlib import Path

import pytest

from crabd.errors import AlreadyExists, InvalidArgument, NotFound

pytestmark = pytest.mark.needs("runc", "busybox")


def test_import_tarball_preserves_special_files(runtime, tmp_path, sandbox_factory, make_busybox_rootfs):
    src = make_busybox_rootfs(tmp_path / "src")
    (src / "etc" / "hostile").symlink_to("/etc/shadow")
    subprocess.run(["mkfifo", str(src / "tmp" / "fifo")], check=True)
    subprocess.run(["mknod", str(src / "tmp" / "null"), "c", "1", "3"], check=True)
    tar = tmp_path / "img.tar.zst"
    subprocess.run(["tar", "--zstd", "-cf", str(tar), "-C", str(src), "."], check=True)
    name = "t-tarball"
    if runtime.images.exists(name):
        runtime.images.remove(name)
    img = runtime.images.import_path(str(tar), name)
    try:
        p = Path(img.path)
        assert (p / "etc" / "hostile").is_symlink() and str((p / "etc" / "hostile").readlink()) == "/etc/shadow"
        assert (p / "tmp" / "fifo").is_fifo() and (p / "tmp" / "null").is_char_device()
        sb = sandbox_factory(name)
        assert runtime.exec(sb.id, "readlink /etc/hostile").stdout == "/etc/shadow\n"
        with pytest.raises(AlreadyExists):
            runtime.images.import_path(str(tar), name)
    finally:
        for s in runtime.list():
            if s.image == name:
                runtime.destroy(s.id)
        runtime.images.remove(name)
    with pytest.raises(NotFound):
        runtime.images.get(name)


def test_bad_sources_and_names(runtime, tmp_path):
    with pytest.raises(NotFound):
        runtime.images.import_path(str(tmp_path / "missing"), "x")
    with pytest.raises(InvalidArgument):
        runtime.images.import_path(str(tmp_path), "../evil")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(InvalidArgument, match="empty"):
        runtime.images.import_path(str(empty), "t-empty")
    assert not runtime.images.exists("t-empty")
    assert not any(p.name.startswith(".tmp-t-empty") for p in runtime.images.root.iterdir())


@pytest.mark.needs("docker")
def test_import_from_docker_engine(runtime, tmp_path, sandbox_factory, make_busybox_rootfs):
    import docker
    client = docker.from_env(timeout=60)
    src = make_busybox_rootfs(tmp_path / "src")
    (src / "etc" / "from-docker").write_text("yes\n")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        tf.add(src, arcname=".")
    # No registry is reachable here: put the image into the engine by import.
    client.api.import_image_from_data(buf.getvalue(), repository="crabd-test-busybox", tag="v1",
                                      changes=["ENV CRABD_FROM=docker", "WORKDIR /etc"])
    name = "t-docker"
    if runtime.images.exists(name):
        runtime.images.remove(name)
    img = runtime.images.import_path("docker://crabd-test-busybox:v1", name)
    try:
        assert img.source.startswith("docker:crabd-test-busybox:v1@sha256:")
        assert "CRABD_FROM=docker" in img.env and img.workdir == "/etc"
        sb = sandbox_factory(name)
        r = runtime.exec(sb.id, "cat from-docker; echo $CRABD_FROM")
        assert r.stdout == "yes\ndocker\n"
    finally:
        for s in runtime.list():
            if s.image == name:
                runtime.destroy(s.id)
        runtime.images.remove(name)
    with pytest.raises(NotFound, match="docker pull"):
        runtime.images.import_path("docker://crabd-no-such-image:latest", "t-none")


def test_cli_image_commands(runtime, busybox_image, sandbox_factory):
    def cli(*args):
        return subprocess.run([*_bin(), *args, "--state-dir", str(runtime.state_dir)],
                              capture_output=True, text=True, timeout=120)

    r = cli("image", "ls", "--json")
    assert r.returncode == 0, r.stderr
    assert busybox_image in [i["name"] for i in json.loads(r.stdout)["images"]]
    sandbox_factory(busybox_image)
    r = cli("image", "rm", busybox_image, "--json")
    assert r.returncode == 1 and json.loads(r.stdout)["error"]["code"] == "failed_precondition"
    r = cli("image", "rm", "no-such-image")
    assert r.returncode == 1 and "no image named 'no-such-image'" in r.stderr and "fix:" in r.stderr


def _bin():
    import sys
    return [str(Path(sys.executable).parent / "crabd")]
