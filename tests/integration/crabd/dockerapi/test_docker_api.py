"""The Docker API subset (crabd.dockerapi) driven by real clients: the docker
CLI on this host (`docker -H unix://...`) and the docker Python SDK (pinned
in pyproject.toml). No hand-written HTTP: what a harness does is what runs.

Every exec through Docker is a crabd turn: the tests check the sandbox's
checkpoints through crabd's own client too. The /proc inspector is used
(CRABD_INSPECTOR=proc): these tests are about the API layer, and the BPF one
takes seconds of clang to start.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from crabd.runtime import Runtime
from crabd.testing import wait_until

pytestmark = pytest.mark.needs("runc", "criu", "bpf", "busybox", "docker")

DOCKER = shutil.which("docker")


@pytest.fixture
def dk(start_daemon):
    if DOCKER is None:
        pytest.fail("the docker CLI is missing: run scripts/setup-host (docker.io)", pytrace=False)
    d = start_daemon(env={"CRABD_INSPECTOR": "proc"})
    sock = d.state / "docker.sock"
    assert sock.is_socket(), "crabd serve did not make its Docker API socket"
    assert sock.stat().st_mode & 0o077 == 0 or sock.stat().st_gid != 0, "the Docker socket is world-accessible"

    def docker(*args: str, input: bytes | None = None, check: bool = False) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DOCKER_")}
        r = subprocess.run([DOCKER, "-H", f"unix://{sock}", *args], input=input, capture_output=True,
                           timeout=180, env=env)
        if check and r.returncode != 0:
            raise AssertionError(f"docker {' '.join(args)} -> {r.returncode}: {r.stderr.decode()[-800:]}")
        return r

    d.docker = docker
    d.docker_sock = sock
    return d


def _out(r: subprocess.CompletedProcess) -> str:
    return r.stdout.decode()


def _leaks(d, sids: list[str]) -> list[str]:
    """Mounts of this daemon's sandboxes and cgroups of `sids` left behind."""
    out = []
    real = str(d.state.resolve())
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mp = line.split()[4]
            if mp.startswith(real + "/sandboxes/"):
                out.append(mp)
    for base in Path("/sys/fs/cgroup").glob("*/crabd"):
        out += [str(base / s) for s in sids if (base / s).is_dir()]
    return out


def test_cli_run_exec_cp_rm(dk, tmp_path):
    docker = dk.docker
    assert "1.41" in _out(docker("version", "--format", "{{.Server.APIVersion}}", check=True))
    assert "busybox" in _out(docker("images", check=True))
    cid = _out(docker("run", "-d", "--name", "web", "--label", "team=crab", "-e", "A=1", "-w", "/work",
                      "busybox", "sleep", "1000", check=True)).strip()
    assert len(cid) == 64
    ps = _out(docker("ps", "--filter", "name=web", "--filter", "label=team=crab", "--format", "{{.Names}} {{.Status}}",
                     check=True))
    assert ps.startswith("web Up"), ps
    assert _out(docker("ps", "--filter", "label=team=other", "-q", check=True)).strip() == ""

    # stdout and stderr apart, the exit code, container env and working dir
    r = docker("exec", "web", "sh", "-c", 'echo "out $A $(pwd)"; echo err >&2; exit 3')
    assert r.returncode == 3
    assert _out(r) == "out 1 /work\n" and r.stderr.decode() == "err\n"
    # -w, -e honoured; stdin with -i; a big output; an exec that runs a while
    assert _out(docker("exec", "-w", "/tmp", "-e", "B=2", "web", "sh", "-c", "echo $B $(pwd)", check=True)) == "2 /tmp\n"
    data = b"".join(b"line %d\n" % i for i in range(5000))
    assert docker("exec", "-i", "web", "sh", "-c", "cat > /work/in.txt", input=data, check=True).returncode == 0
    assert docker("exec", "web", "md5sum", "/work/in.txt", check=True).stdout.split()[0].decode() == \
        __import__("hashlib").md5(data).hexdigest()
    big = docker("exec", "web", "sh", "-c", "head -c 600000 /dev/zero | tr '\\0' x", check=True).stdout
    assert big == b"x" * 600000
    assert docker("exec", "web", "sleep", "3", check=True).returncode == 0
    r = docker("exec", "web", "no-such-program")
    assert r.returncode == 127 and b"not found" in r.stderr

    # docker cp both ways (a file and a directory)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("hello\n")
    docker("cp", str(tmp_path / "src"), "web:/work/", check=True)
    assert _out(docker("exec", "web", "cat", "/work/src/a.txt", check=True)) == "hello\n"
    docker("cp", "web:/work/in.txt", str(tmp_path / "back.txt"), check=True)
    assert (tmp_path / "back.txt").read_bytes() == data
    r = docker("cp", "web:/nope", str(tmp_path / "x"))
    assert r.returncode != 0 and b"Could not find the file /nope" in r.stderr

    # every exec was a crabd turn, checkpointed, visible to crabd's own client
    c = dk.client()
    sb = c.sandbox("web")
    assert sb["name"] == "web" and sb["turn"] >= 6
    cks = c.checkpoints("web")
    assert len(cks) >= 2 and all(k["plan"] in ("SKIP", "FS", "FS_PROC") for k in cks)

    insp = __import__("json").loads(_out(docker("inspect", "web", check=True)))[0]
    assert insp["State"]["Running"] is True and insp["Config"]["Labels"] == {"team": "crab"}
    assert insp["Name"] == "/web" and insp["Crabd"]["sandbox"] == sb["id"]

    docker("stop", "-t", "1", "web", check=True)
    assert _out(docker("ps", "-a", "--filter", "name=web", "--format", "{{.Status}}", check=True)).startswith("Exited")
    r = docker("exec", "web", "true")
    assert r.returncode != 0 and b"is not running" in r.stderr
    docker("start", "web", check=True)
    assert _out(docker("exec", "web", "cat", "/work/src/a.txt", check=True)) == "hello\n"
    docker("rm", "-f", "web", check=True)
    assert docker("inspect", "web").returncode != 0
    assert c.sandboxes() == []
    assert _leaks(dk, [sb["id"]]) == []


def test_cli_errors_and_own_exit(dk):
    docker = dk.docker
    r = docker("run", "-d", "--name", "p", "-p", "8080:80", "busybox", "sleep", "10")
    assert r.returncode != 0 and b"published ports" in r.stderr, r.stderr
    r = docker("run", "-d", "-v", "/tmp:/host", "busybox", "sleep", "10")
    assert r.returncode != 0 and b"host bind mounts" in r.stderr, r.stderr
    r = docker("run", "-d", "--privileged", "busybox", "sleep", "10")
    assert r.returncode != 0 and b"Privileged" in r.stderr
    r = docker("run", "-d", "no-such-image-here", "sleep", "10")
    assert r.returncode != 0 and b"no-such-image-here" in r.stderr
    r = docker("exec", "nobody", "true")
    assert r.returncode != 0 and b"No such container: nobody" in r.stderr
    assert dk.client().sandboxes() == [], "a refused create left a sandbox"

    docker("run", "-d", "--name", "twin", "busybox", "sleep", "100", check=True)
    sids = [dk.client().sandbox("twin")["id"]]
    r = docker("run", "-d", "--name", "twin", "busybox", "sleep", "100")
    assert r.returncode != 0 and b"is already in use" in r.stderr
    r = docker("rm", "twin")
    assert r.returncode != 0 and b"cannot remove a running container" in r.stderr

    # a container whose command ends on its own: attached run, exit status, logs, wait
    r = docker("run", "--name", "once", "busybox", "sh", "-c", "echo hi; echo oops >&2; exit 7")
    assert r.returncode == 7 and _out(r) == "hi\n" and r.stderr.decode() == "oops\n", r
    assert _out(docker("wait", "once", check=True)).strip() == "7"
    lg = docker("logs", "once", check=True)
    assert _out(lg) == "hi\n" and lg.stderr.decode() == "oops\n"
    assert _out(docker("ps", "-a", "--filter", "name=once", "--format", "{{.Status}}")).startswith("Exited (7)")
    # an attached run of a command that only waits: it ends when its sleep would
    r = docker("run", "--rm", "busybox", "sleep", "2")
    assert r.returncode == 0, r
    # --rm: removed once it exits
    r = docker("run", "--rm", "--name", "gone", "busybox", "sh", "-c", "echo bye")
    assert r.returncode == 0 and _out(r) == "bye\n"
    assert docker("inspect", "gone").returncode != 0
    # mini-swe-agent's pattern: run -d --rm ... sleep 2h, exec -w, then stop removes it
    docker("run", "-d", "--rm", "--name", "msa", "-w", "/testbed", "busybox", "sleep", "2h", check=True)
    assert _out(docker("exec", "-w", "/testbed", "msa", "sh", "-c", "pwd", check=True)) == "/testbed\n"
    sids.append(dk.client().sandbox("msa")["id"])
    docker("stop", "msa", check=True)
    assert docker("inspect", "msa").returncode != 0
    # crabd-docker: the docker CLI with -H of crabd's socket
    r = subprocess.run([sys.executable, "-c", "from crabd.dockerapi.command import main; main()", "ps", "-a",
                        "--format", "{{.Names}}"], capture_output=True, timeout=120,
                       env={**os.environ, "CRABD_DOCKER_SOCKET": str(dk.docker_sock)})
    assert r.returncode == 0 and sorted(r.stdout.decode().split()) == ["once", "twin"], r
    sids.append(dk.client().sandbox("once")["id"])
    docker("rm", "-f", "twin", "once", check=True)
    assert dk.client().sandboxes() == [] and _leaks(dk, sids) == []


def test_sdk(dk):
    import docker
    import docker.errors

    cl = docker.DockerClient(base_url=f"unix://{dk.docker_sock}", version="auto", timeout=180)
    assert cl.ping() is True
    assert cl.version()["ApiVersion"] == "1.41"
    assert any("busybox:latest" in i.tags for i in cl.images.list())
    ct = cl.containers.run("busybox", "sleep 1000", detach=True, name="sdk", labels={"run": "7"},
                           environment={"K": "v"}, working_dir="/w", mem_limit="256m", pids_limit=100)
    ct.reload()
    assert ct.status == "running" and ct.name == "sdk" and ct.labels == {"run": "7"}
    assert [c.name for c in cl.containers.list(filters={"label": "run=7"})] == ["sdk"]

    res = ct.exec_run(["sh", "-c", "echo $K; pwd; echo e >&2; exit 4"], demux=True)
    assert res.exit_code == 4 and res.output == (b"v\n/w\n", b"e\n")
    res = ct.exec_run("sh -c 'seq 1 100000'")
    assert res.exit_code == 0 and res.output.decode().split() == [str(i) for i in range(1, 100001)]
    assert ct.exec_run("id -u", user="root").output == b"0\n"
    res = ct.exec_run("id -u", user="nobody")  # busybox has no setpriv that changes user: refused, not run as root
    assert res.exit_code == 126 and b"needs util-linux setpriv" in res.output

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        info = tarfile.TarInfo("f.txt")
        payload = bytes(range(256)) * 8  # binary, not UTF-8
        info.size = len(payload)
        tf.addfile(info, io.BytesIO(payload))
    assert ct.put_archive("/w", buf.getvalue()) is True
    stream, st = ct.get_archive("/w/f.txt")
    got = tarfile.open(fileobj=io.BytesIO(b"".join(stream))).extractfile("f.txt").read()
    assert got == payload and st["name"] == "f.txt" and st["size"] == len(payload)

    with pytest.raises(docker.errors.ImageNotFound):
        cl.containers.create("no-such-image-here", "true")
    with pytest.raises(docker.errors.NotFound):
        cl.containers.get("nobody")
    with pytest.raises(docker.errors.APIError) as e:
        cl.containers.run("busybox", "sleep 1", detach=True, ports={"80/tcp": 8080})
    assert e.value.status_code == 400 and "published ports" in str(e.value)

    once = cl.containers.run("busybox", "sh -c 'echo done; exit 2'", detach=True)
    assert once.wait(timeout=120)["StatusCode"] == 2
    assert once.logs() == b"done\n"
    once.remove()
    sid = dk.client().sandbox("sdk")["id"]
    ct.remove(force=True)
    assert dk.client().sandboxes() == [] and _leaks(dk, [sid]) == []


def test_checkpoints_and_crabd_control(dk):
    """Docker's checkpoint commands map onto crabd checkpoints and rollback;
    a container is a sandbox crabd's own client controls, and a sandbox made
    through crabd's API is a container."""
    docker = dk.docker
    c = dk.client()
    docker("run", "-d", "--name", "ck", "busybox", "sleep", "1000", check=True)
    docker("exec", "ck", "sh", "-c", "echo one > /f", check=True)
    docker("checkpoint", "create", "--leave-running", "ck", "c1", check=True)
    docker("exec", "ck", "sh", "-c", "echo two > /f", check=True)
    assert "c1" in _out(docker("checkpoint", "ls", "ck", check=True)).split()
    docker("stop", "ck", check=True)
    docker("start", "--checkpoint", "c1", "ck", check=True)
    assert _out(docker("exec", "ck", "cat", "/f", check=True)) == "one\n"

    # crabd's own rollback, by the Docker name, to the turn that wrote "two"
    two = [k for k in c.checkpoints("ck") if k["turn"] == 2][0]
    c.rollback("ck", two["id"])
    assert _out(docker("exec", "ck", "cat", "/f", check=True)) == "two\n"
    docker("checkpoint", "rm", "ck", "c1", check=True)
    assert "c1" not in _out(docker("checkpoint", "ls", "ck", check=True)).split()

    native = c.create_sandbox("busybox", name="native")
    assert "native" in _out(docker("ps", "--format", "{{.Names}}", check=True)).split()
    assert _out(docker("exec", "native", "echo", "hi", check=True)) == "hi\n"
    sids = [native["id"], c.sandbox("ck")["id"]]
    docker("rm", "-f", "native", "ck", check=True)
    assert c.sandboxes() == [] and _leaks(dk, sids) == []


def test_docker_api_off(start_daemon):
    d = start_daemon(args=["--no-docker"], env={"CRABD_INSPECTOR": "proc"})
    assert not (d.state / "docker.sock").exists()


def _two_steps(dk, name: str) -> None:
    """A busybox container NAME whose two steps wrote /work.txt ("step1",
    then "step2"), both steps' checkpoints captured."""
    dk.docker("run", "-d", "--name", name, "busybox", "sleep", "1000", check=True)
    dk.docker("exec", name, "sh", "-c", "echo step1 > /work.txt", check=True)
    dk.docker("exec", name, "sh", "-c", "echo step2 >> /work.txt", check=True)
    c = dk.client()
    wait_until(lambda: all(k["state"] == "committed" for k in c.checkpoints(name, all=True)), "checkpoints committed")


def test_recovery_and_fork_of_a_docker_container(dk):
    """A harness on the docker CLI gains crabd's recovery and fork: the
    sandbox's processes are killed (kill -9 of its init) between two steps;
    crabd rolls it back to its last checkpoint and the next `docker exec`
    finds the work done so far. Then best-of-N: fork the checkpoint of step
    1 into two branches, run a different continuation in each through
    docker exec, keep the one that passes."""
    import signal

    docker = dk.docker
    c = dk.client()
    _two_steps(dk, "agent")
    since = max([e["seq"] for e in c.events()] or [0])
    os.kill(c.sandbox("agent")["pid"], signal.SIGKILL)
    wait_until(lambda: "sandbox.rolled_back" in [e["kind"] for e in c.events(since=since, sandbox=c.sandbox("agent")["id"])],
               "crabd's automatic rollback", timeout=60)
    assert _out(docker("exec", "agent", "cat", "/work.txt", check=True)) == "step1\nstep2\n"
    assert __import__("json").loads(_out(docker("inspect", "agent", check=True)))[0]["State"]["Running"] is True

    step1 = [k for k in c.checkpoints("agent") if k["turn"] == 1][0]
    forks = c.fork(step1["id"], 2)["sandboxes"]
    names = _out(docker("ps", "--format", "{{.Names}}", check=True)).split()
    assert set(forks) <= set(names)
    results = {}
    for sid, cont in zip(forks, ["echo good >> /work.txt", "echo bad >> /work.txt"]):
        assert _out(docker("exec", sid, "cat", "/work.txt", check=True)) == "step1\n"  # the branch starts at step 1
        docker("exec", sid, "sh", "-c", cont, check=True)
        results[sid] = docker("exec", sid, "grep", "-q", "good", "/work.txt").returncode
    keep = [s for s, rc in results.items() if rc == 0]
    assert len(keep) == 1
    sids = [c.sandbox("agent")["id"], *forks]
    docker("rm", "-f", "agent", *forks, check=True)
    assert c.sandboxes() == [] and _leaks(dk, sids) == []


def test_run_as_fork_of_a_checkpoint(dk):
    """`docker run --label crabd.fork-from=CHECKPOINT` makes the container a
    crabd fork of that checkpoint, named by --name: how a harness that only
    knows `docker run` (mini-swe-agent's environment, through its run_args)
    starts best-of-N branches. Bad references are refused, not ignored."""
    docker = dk.docker
    c = dk.client()
    _two_steps(dk, "src")
    step1 = [k for k in c.checkpoints("src") if k["turn"] == 1][0]
    label = f"crabd.fork-from={step1['id']}"
    docker("run", "-d", "--rm", "--name", "branch", "--label", label, "busybox", "sleep", "1000", check=True)
    assert _out(docker("exec", "branch", "cat", "/work.txt", check=True)) == "step1\n"
    assert c.sandbox("branch")["forked_from"] == step1["id"]  # crabd's name is the Docker name
    assert _out(docker("exec", "src", "cat", "/work.txt", check=True)) == "step1\nstep2\n"

    r = docker("run", "-d", "--name", "nope", "--label", "crabd.fork-from=sb-none-1", "busybox", "sleep", "1")
    assert r.returncode != 0 and b"No such crabd checkpoint: sb-none-1" in r.stderr, r.stderr
    r = docker("run", "-d", "--name", "nope", "--memory", "64m", "--label", label, "busybox", "sleep", "1")
    assert r.returncode != 0 and b"keeps the limits of its checkpoint's sandbox" in r.stderr, r.stderr
    Runtime(dk.state).images.import_path(str(Runtime(dk.state).images.get("busybox").path), "other")
    r = docker("run", "-d", "--name", "nope", "--label", label, "other", "sleep", "1")
    assert r.returncode != 0 and b"is of a sandbox of image 'busybox', not 'other'" in r.stderr, r.stderr
    sids = [c.sandbox("src")["id"], c.sandbox("branch")["id"]]
    docker("rm", "-f", "src", "branch", check=True)
    assert c.sandboxes() == [] and _leaks(dk, sids) == []


def _cgroup_value(sid: str, controller: str, name: str) -> str:
    hits = list(Path("/sys/fs/cgroup", controller).glob(f"**/{sid}/{name}"))
    assert len(hits) == 1, (controller, name, hits)
    return hits[0].read_text().strip()


def test_cli_kill_detached_exec_entrypoint_limits_and_big_output(dk):
    """What the other tests leave out, through the real CLI: HostConfig limits
    land in the sandbox's cgroups; `docker exec -d` runs as a turn in the
    background; `docker kill` (and a signal crabd refuses); `--entrypoint`;
    `docker image inspect`; an output over crabd's 1 MiB per stream is cut
    with its marker, not lost silently."""
    docker = dk.docker
    c = dk.client()
    docker("run", "-d", "--name", "lim", "--memory", "96m", "--pids-limit", "64", "--cpus", "0.5",
           "busybox", "sleep", "1000", check=True)
    sid = c.sandbox("lim")["id"]
    assert int(_cgroup_value(sid, "memory", "memory.limit_in_bytes")) == 96 << 20
    assert _cgroup_value(sid, "pids", "pids.max") == "64"
    quota = int(_cgroup_value(sid, "cpu", "cpu.cfs_quota_us"))
    assert quota == int(_cgroup_value(sid, "cpu", "cpu.cfs_period_us")) // 2

    turn = c.sandbox("lim")["turn"]
    r = docker("exec", "-d", "lim", "sh", "-c", "sleep 1; echo late > /late")
    assert r.returncode == 0 and _out(r) == "", r
    # The next exec waits for the detached one (one turn at a time per sandbox).
    assert _out(docker("exec", "lim", "cat", "/late", check=True)) == "late\n"
    assert c.sandbox("lim")["turn"] == turn + 2

    big = docker("exec", "lim", "sh", "-c", "head -c 1100000 /dev/zero | tr '\\0' y", check=True).stdout
    assert big.startswith(b"y" * (1 << 20)) and b"[crabd: output truncated: 51424 more bytes not shown]" in big, big[-200:]

    r = docker("kill", "-s", "USR1", "lim")
    assert r.returncode != 0 and b"USR1" in r.stderr, r.stderr
    docker("kill", "lim", check=True)
    assert _out(docker("ps", "-a", "--filter", "name=lim", "--format", "{{.Status}}", check=True)).startswith("Exited (137)")
    docker("start", "lim", check=True)
    assert _out(docker("exec", "lim", "cat", "/late", check=True)) == "late\n"

    r = docker("run", "--rm", "--entrypoint", "sh", "busybox", "-c", "echo ep $0; exit 5")
    assert r.returncode == 5 and _out(r) == "ep sh\n", r
    img = __import__("json").loads(_out(docker("image", "inspect", "busybox", check=True)))[0]
    assert img["RepoTags"] == ["busybox:latest"] and img["Id"].startswith("sha256:")
    docker("rm", "-f", "lim", check=True)
    assert c.sandboxes() == [] and _leaks(dk, [sid]) == []


def test_pull_imports_from_the_local_docker_engine(start_daemon, plain_dockerd, runtime, busybox_image):
    """An image crabd lacks but the local Docker engine has is imported by
    `docker pull` (then runs as a crabd image); one neither has is a 404
    that names the fix."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DOCKER_")}
    engine = [DOCKER, "-H", f"unix://{plain_dockerd}"]
    if subprocess.run([*engine, "image", "inspect", "crabd-pull-test"], capture_output=True, timeout=60).returncode:
        tar = subprocess.run(["tar", "-C", str(runtime.images.get(busybox_image).path), "-c", "."],
                             capture_output=True, timeout=120, check=True).stdout
        subprocess.run([*engine, "import", "-", "crabd-pull-test"], input=tar, capture_output=True, timeout=120,
                       check=True, env=env)
    d = start_daemon(env={"CRABD_INSPECTOR": "proc", "DOCKER_HOST": f"unix://{plain_dockerd}"})

    def docker(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([DOCKER, "-H", f"unix://{d.state / 'docker.sock'}", *args], capture_output=True,
                              timeout=300, env=env)
    assert "crabd-pull-test" not in _out(docker("images", "--format", "{{.Repository}}"))
    r = docker("pull", "crabd-pull-test")
    assert r.returncode == 0 and b"from the local Docker engine as crabd image crabd-pull-test" in r.stdout, r
    assert "crabd-pull-test" in _out(docker("images", "--format", "{{.Repository}}"))
    r = docker("run", "--rm", "crabd-pull-test", "sh", "-c", "echo from-the-engine")
    assert r.returncode == 0 and _out(r) == "from-the-engine\n", r
    r = docker("pull", "crabd-nowhere-image")
    assert r.returncode != 0 and b"could not import" in r.stderr and b"crabd image import docker://" in r.stderr, r
    assert d.client().sandboxes() == []
