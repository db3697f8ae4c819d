"""Pure parts of the Docker API subset (crabd.dockerapi.shapes)."""

from __future__ import annotations

import stat
import struct

import pytest

from crabd.dockerapi import shapes

# What the docker CLI (28.x, API 1.41) sends for `docker run -d --name x busybox sleep 1000`.
CLI_DEFAULTS = {
    "Hostname": "", "User": "", "Env": None, "Cmd": ["sleep", "1000"], "Image": "busybox", "Volumes": None,
    "HostConfig": {"Binds": None, "LogConfig": {"Type": "", "Config": {}}, "NetworkMode": "default",
                   "PortBindings": {}, "RestartPolicy": {"Name": "no", "MaximumRetryCount": 0}, "AutoRemove": False,
                   "CapAdd": None, "CapDrop": None, "Dns": [], "ExtraHosts": None, "IpcMode": "", "PidMode": "",
                   "Privileged": False, "PublishAllPorts": False, "SecurityOpt": None, "UTSMode": "",
                   "UsernsMode": "", "Runtime": "", "Memory": 0, "NanoCpus": 0, "PidsLimit": None,
                   "Devices": [], "Ulimits": None, "Mounts": None, "CgroupParent": ""},
    "NetworkingConfig": {"EndpointsConfig": {}},
}


def test_cli_defaults_are_accepted():
    assert shapes.refusals(CLI_DEFAULTS) == []


@pytest.mark.parametrize("key,value,words", [
    ("PortBindings", {"80/tcp": [{"HostPort": "8080"}]}, "published ports"),
    ("Binds", ["/tmp:/x"], "host bind mounts"),
    ("Privileged", True, "Privileged"),
    ("NetworkMode", "host", "NetworkMode='host'"),
    ("Ulimits", [{"Name": "nofile", "Soft": 1, "Hard": 1}], "setrlimit"),
])
def test_refused_options_say_why(key, value, words):
    body = {**CLI_DEFAULTS, "HostConfig": {**CLI_DEFAULTS["HostConfig"], key: value}}
    out = shapes.refusals(body)
    assert len(out) == 1 and words in out[0]


def test_limits_from_host_config():
    lim = shapes.limits_of({"Memory": 256 << 20, "NanoCpus": 1_500_000_000, "PidsLimit": 100})
    assert (lim.memory_bytes, lim.cpus, lim.pids) == (256 << 20, 1.5, 100)
    d = shapes.limits_of({})
    assert d == shapes.Limits()
    assert shapes.limits_of({"PidsLimit": -1}).pids is None
    with pytest.raises(ValueError):
        shapes.limits_of({"Memory": 1024})


@pytest.mark.parametrize("ref,name", [("busybox", "busybox"), ("busybox:latest", "busybox"),
                                      ("docker.io/library/busybox", "busybox"), ("python:3.11-slim", "python-3.11-slim"),
                                      ("ghcr.io/org/img:v1", "ghcr.io-org-img-v1"), ("localhost:5000/x", "localhost-5000-x")])
def test_image_names(ref, name):
    assert shapes.image_name(ref) == name


def test_frames_split_at_one_mib():
    data = b"x" * ((1 << 20) + 5)
    out = shapes.frame(2, data)
    assert struct.unpack(">BxxxL", out[:8]) == (2, 1 << 20)
    assert struct.unpack(">BxxxL", out[8 + (1 << 20):16 + (1 << 20)]) == (2, 5)


@pytest.mark.parametrize("argv,kw,idle", [
    (["sleep", "2h"], {}, 7200.0), (["sleep", "infinity"], {}, float("inf")), (["tail", "-f", "/dev/null"], {}, float("inf")),
    (["/bin/sh", "-c", "sleep 100"], {}, 100.0), (["bash"], {"tty": True}, float("inf")), (["bash"], {}, None),
    (["sh", "-c", "echo hi; sleep 5"], {}, None), (["python", "-m", "http.server"], {}, None), ([], {}, None),
])
def test_idle_main_commands(argv, kw, idle):
    assert shapes.idle_seconds(argv, **kw) == idle


def test_go_file_mode():
    assert shapes.go_file_mode(stat.S_IFDIR | 0o755) == (1 << 31) | 0o755
    assert shapes.go_file_mode(stat.S_IFREG | 0o644) == 0o644
    assert shapes.go_file_mode(stat.S_IFLNK | 0o777) == (1 << 27) | 0o777


def test_filters_and_labels():
    assert shapes.parse_filters('{"name": {"web": true}, "label": ["a=1"]}') == {"name": ["web"], "label": ["a=1"]}
    assert shapes.name_matches("web", ["^/web$"]) and not shapes.name_matches("web2", ["^/web$"])
    assert shapes.labels_match({"a": "1", "b": "2"}, ["a=1", "b"]) and not shapes.labels_match({"a": "1"}, ["a=2"])


def test_user_argv():
    assert shapes.user_argv("root", ["id"]) == ["id"]
    argv = shapes.user_argv("1000:1000", ["id"])
    assert argv[0] == "/bin/sh" and argv[-5:] == ["--reuid=1000", "--regid=1000", "--clear-groups", "--", "id"]


def test_crabd_docker_command_line():
    from crabd.dockerapi.command import argv
    assert argv(["ps", "-a"], "/run/crabd/docker.sock", "/usr/bin/docker") == [
        "/usr/bin/docker", "-H", "unix:///run/crabd/docker.sock", "ps", "-a"]
