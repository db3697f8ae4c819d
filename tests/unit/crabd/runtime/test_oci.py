"""The OCI config of a sandbox: pure, no root."""

from crabd.runtime.oci import DEFAULT_ENV, INIT_PATH, RUN_PATH, Limits, build_config


def cfg(**kw):
    args = dict(sandbox_id="sb-0123456789", init_source="/opt/crabd/bin/crabd-init", run_source="/s/run",
                cgroups_path="/crabd/sb-0123456789", limits=Limits())
    args.update(kw)
    return build_config(**args)


def test_no_rlimits_anywhere():
    # setrlimit is refused on these hosts: runc must never be asked for one.
    c = cfg()
    assert "rlimits" not in c["process"]
    assert "rlimits" not in str(c)


def test_init_is_crabd_own_and_read_only():
    c = cfg()
    assert c["process"]["args"] == [INIT_PATH]
    m = [m for m in c["mounts"] if m["destination"] == INIT_PATH][0]
    assert m["source"] == "/opt/crabd/bin/crabd-init"
    assert "ro" in m["options"] and "bind" in m["options"]
    # /dev is a tmpfs: the init's mount point leaves no trace in the rootfs.
    assert INIT_PATH.startswith("/dev/") and RUN_PATH.startswith("/dev/")
    dev = [i for i, m in enumerate(c["mounts"]) if m["destination"] == "/dev"][0]
    init = [i for i, m in enumerate(c["mounts"]) if m["destination"] == INIT_PATH][0]
    assert dev < init


def test_new_network_namespace_by_default_or_joined():
    ns = {n["type"]: n for n in cfg()["linux"]["namespaces"]}
    assert set(ns) == {"pid", "ipc", "uts", "mount", "network"}
    assert "path" not in ns["network"]
    ns = {n["type"]: n for n in cfg(network_ns_path="/run/netns/x")["linux"]["namespaces"]}
    assert ns["network"]["path"] == "/run/netns/x"


def test_limits_map_to_cgroup_resources():
    r = Limits(memory_bytes=512 * 1024**2, pids=64, cpus=1.5).to_resources()
    assert r["memory"] == {"limit": 512 * 1024**2}
    assert r["pids"] == {"limit": 64}
    assert r["cpu"] == {"quota": 150000, "period": 100000}
    r = Limits(memory_bytes=None, pids=None, cpus=None).to_resources()
    assert set(r) == {"devices"}
    assert r["devices"][0] == {"allow": False, "access": "rwm"}


def test_limits_round_trip():
    lim = Limits(memory_bytes=1, pids=2, cpus=0.5)
    assert Limits.from_dict(lim.to_dict()) == lim


def test_env_and_cgroup_path():
    c = cfg(env=DEFAULT_ENV + ("A=b",), annotations={"org.criu.config": "/x"})
    assert "A=b" in c["process"]["env"]
    assert c["linux"]["cgroupsPath"] == "/crabd/sb-0123456789"
    assert c["annotations"] == {"org.criu.config": "/x"}
    assert c["hostname"] == "sb-0123456789"


def test_loopback_hook_reads_the_pid_from_runc_state():
    import subprocess
    from crabd.runtime.oci import loopback_hook
    h = loopback_hook("/bin/sh", "/bin/echo", "ip")  # echo stands in for nsenter
    state = b'{"ociVersion":"1.0.2","id":"sb-1","status":"creating","pid":4242,"bundle":"/b","annotations":{"x":"1"}}'
    r = subprocess.run(h["args"], executable=h["path"], input=state, capture_output=True, timeout=10)
    assert r.returncode == 0 and r.stdout.split() == [b"-t", b"4242", b"-n", b"ip", b"link", b"set", b"lo", b"up"]
    c = cfg(hooks={"createRuntime": [h]})
    assert c["hooks"]["createRuntime"] == [h] and "hooks" not in cfg()
