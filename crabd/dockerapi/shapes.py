"""Pure translation between Docker's API shapes and crabd's terms.

Nothing here does I/O: the routes (`engine`) call these, and unit tests
check them without root. The rules that matter:

- A container create that asks for something crabd cannot honour is
  refused (`refusals`), never silently ignored: a harness that publishes a
  port and gets a container without it would fail later, far from the cause.
- Docker ids are 64 hex digits; a crabd sandbox id (`sb-0123456789`) would
  be cut to 12 characters by `docker ps` and then not resolve. The Docker id
  of a sandbox is sha256 of its crabd id: stable, and any unique prefix of
  it resolves, as in Docker.
"""

from __future__ import annotations

import hashlib
import re
import shlex
import stat
import struct
import time
from datetime import datetime, timezone
from typing import Any, Iterable

from ..runtime import Limits

__all__ = ["API_VERSION", "MIN_API_VERSION", "refusals", "limits_of", "docker_id", "image_name", "image_id",
           "frame", "idle_seconds", "go_file_mode", "rfc3339", "parse_filters", "name_matches", "labels_match",
           "status_text", "main_argv", "user_argv", "FORK_LABEL"]

API_VERSION = "1.41"
MIN_API_VERSION = "1.24"
STDOUT, STDERR = 1, 2

# HostConfig keys crabd cannot honour, with why. Each is refused when it is
# set to anything but its empty/default value (the docker CLI sends most of
# them empty on every create).
_REFUSED_HOST: dict[str, str] = {
    "Binds": "host bind mounts: a sandbox's files are its own copy-on-write snapshot, checkpointed and rolled "
             "back with it; a host directory would be neither (copy files in with docker cp instead)",
    "Mounts": "mounts of host paths or volumes: same reason as bind mounts (use docker cp)",
    "VolumesFrom": "volumes of other containers: sandboxes share no files",
    "PortBindings": "published ports: crabd sandboxes have no network (loopback only)",
    "PublishAllPorts": "published ports: crabd sandboxes have no network (loopback only)",
    "Links": "container links: crabd sandboxes have no network",
    "Privileged": "privileged containers: a sandbox holds untrusted agent code",
    "CapAdd": "added capabilities: a sandbox holds untrusted agent code",
    "Devices": "host devices: CRIU cannot checkpoint them",
    "DeviceRequests": "GPUs and other device requests: CRIU cannot checkpoint them",
    "Ulimits": "ulimits: setrlimit is refused on these hosts (DESIGN.md); crabd sets cgroup limits only",
    "Sysctls": "sysctls: not supported by crabd",
    "Tmpfs": "tmpfs mounts: not supported through the Docker API",
    "Dns": "DNS settings: crabd sandboxes have no network",
    "ExtraHosts": "extra hosts: crabd sandboxes have no network",
    "SecurityOpt": "security options: crabd's sandbox profile is fixed",
    "Runtime": "another OCI runtime: crabd runs runc itself",
}
_REFUSED_MODES = {  # key -> values that are fine (the rest is refused)
    "NetworkMode": ({"", "default", "bridge", "none"}, "networks: crabd sandboxes have no network (loopback only)"),
    "PidMode": ({"", "private"}, "sharing another namespace's pids"),
    "IpcMode": ({"", "private", "shareable", "none"}, "sharing another namespace's IPC"),
    "UTSMode": ({""}, "sharing the host's UTS namespace"),
    "UsernsMode": ({""}, "user namespace modes"),
    "CgroupParent": ({""}, "another cgroup parent: crabd places sandboxes itself"),
}


def _set(v: Any) -> bool:
    return v not in (None, "", [], {}, False, 0)


def refusals(body: dict[str, Any]) -> list[str]:
    """Why crabd cannot create this container as asked ([] = it can)."""
    out: list[str] = []
    host = body.get("HostConfig") or {}
    for key, why in _REFUSED_HOST.items():
        if _set(host.get(key)):
            out.append(f"HostConfig.{key} ({why})")
    for key, (ok, why) in _REFUSED_MODES.items():
        v = host.get(key) or ""
        if v not in ok:
            out.append(f"HostConfig.{key}={v!r} ({why})")
    rp = (host.get("RestartPolicy") or {}).get("Name") or ""
    if rp not in ("", "no"):
        out.append(f"HostConfig.RestartPolicy={rp!r} (crabd recovers a sandbox that dies by rolling it back to its "
                   "last checkpoint: auto_rollback)")
    if _set(body.get("Volumes")):
        out.append("Volumes (volumes: a sandbox's files are its own snapshot; use docker cp)")
    nets = ((body.get("NetworkingConfig") or {}).get("EndpointsConfig") or {})
    if any(n not in ("default", "bridge", "none") for n in nets):
        out.append(f"NetworkingConfig ({', '.join(sorted(nets))}: crabd sandboxes have no network)")
    if (body.get("Healthcheck") or {}).get("Test") not in (None, [], ["NONE"]):
        out.append("Healthcheck (not supported by crabd)")
    return out


#: A container label that makes `docker run`/`create` a crabd fork of the
#: checkpoint it names (the image must be that checkpoint's sandbox's image).
FORK_LABEL = "crabd.fork-from"


def limits_of(host: dict[str, Any]) -> Limits:
    """crabd's cgroup limits from HostConfig: Memory, PidsLimit, NanoCpus
    (docker --cpus) or CpuQuota/CpuPeriod. Unset ones keep crabd's defaults."""
    d = Limits()
    mem = host.get("Memory") or d.memory_bytes
    pids = host.get("PidsLimit")
    pids = d.pids if pids in (None, 0) else (None if pids < 0 else pids)
    cpus: float | None = d.cpus
    if host.get("NanoCpus"):
        cpus = host["NanoCpus"] / 1e9
    elif host.get("CpuQuota") and host["CpuQuota"] > 0:
        cpus = host["CpuQuota"] / (host.get("CpuPeriod") or 100_000)
    if mem is not None and mem < 16 * 1024**2:
        raise ValueError(f"HostConfig.Memory {mem} is below crabd's minimum of 16 MiB")
    return Limits(memory_bytes=mem, pids=pids, cpus=cpus)


def docker_id(sandbox_id: str) -> str:
    return hashlib.sha256(sandbox_id.encode()).hexdigest()


def image_name(ref: str) -> str:
    """A Docker image reference -> a crabd image name: `busybox`,
    `busybox:latest` and `docker.io/library/busybox` are crabd's `busybox`;
    other tags and paths keep their parts, joined by '-' (crabd names are
    [a-z0-9._-])."""
    ref = ref.strip()
    if "@" in ref:
        ref = ref.split("@", 1)[0]
    for p in ("docker.io/library/", "docker.io/", "index.docker.io/library/", "library/"):
        if ref.startswith(p):
            ref = ref[len(p):]
            break
    name, _, tag = ref.rpartition(":") if ":" in ref.rsplit("/", 1)[-1] else (ref, "", "")
    if tag == "latest":
        tag = ""
    out = name.replace("/", "-").replace(":", "-") + (f"-{tag}" if tag else "")
    return out.lower()


def image_id(name: str) -> str:
    return "sha256:" + hashlib.sha256(f"crabd-image:{name}".encode()).hexdigest()


def frame(stream: int, data: bytes) -> bytes:
    """Docker's multiplexed stream frame: [stream, 0, 0, 0, size (BE u32)] + data
    (frames of at most 1 MiB each; joined once: the output is copied once)."""
    step = 1 << 20
    parts: list[bytes] = []
    for i in range(0, len(data), step):
        part = data[i:i + step] if len(data) > step else data
        parts += (struct.pack(">BxxxL", stream, len(part)), part)
    return b"".join(parts)


_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd]?)$")


def _sleep_arg(args: list[str]) -> float | None:
    if not args:
        return None
    total = 0.0
    for a in args:
        if a in ("inf", "infinity"):
            return float("inf")
        m = _DURATION.match(a)
        if not m:
            return None
        total += float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]
    return total


_SHELLS = {"sh", "bash", "ash", "dash", "zsh"}


def idle_seconds(argv: list[str], *, tty: bool = False, open_stdin: bool = False) -> float | None:
    """How long a container's main command only keeps it alive, or None when
    it does real work.

    Harnesses start a container with a command that waits (`sleep 2h`,
    `sleep infinity`, `tail -f /dev/null`, a shell held open by -it) and
    then exec their steps into it. A crabd sandbox stays alive by its own
    init, so such a command is not run: it would be a process in every
    checkpoint (a CRIU dump each turn) and do nothing. Anything else runs
    as the container's first turn (see engine)."""
    if not argv:
        return float("inf") if tty or open_stdin else None
    prog = argv[0].rsplit("/", 1)[-1]
    if prog == "sleep":
        return _sleep_arg(argv[1:])
    if prog == "tail" and argv[1:] in (["-f", "/dev/null"], ["-F", "/dev/null"], ["-f", "-n", "0", "/dev/null"]):
        return float("inf")
    if prog in _SHELLS | {"cat"} and len(argv) == 1:
        return float("inf") if tty or open_stdin else None
    if prog in _SHELLS and len(argv) == 3 and argv[1] in ("-c", "-lc"):
        try:
            inner = shlex.split(argv[2])
        except ValueError:
            return None
        if inner and inner[0] == "exec":
            inner = inner[1:]
        return idle_seconds(inner) if inner and inner[0].rsplit("/", 1)[-1] in ("sleep", "tail") else None
    return None


def main_argv(config: dict[str, Any]) -> list[str]:
    ep = config.get("Entrypoint") or []
    cmd = config.get("Cmd") or []
    if isinstance(ep, str):
        ep = ["/bin/sh", "-c", ep]
    if isinstance(cmd, str):
        cmd = ["/bin/sh", "-c", cmd]
    return [*ep, *cmd]


_SETPRIV = ('setpriv --help 2>&1 | grep -q -e --reuid || { echo "crabd: docker exec -u needs util-linux setpriv '
            'in the image (busybox setpriv cannot change user)" >&2; exit 126; }; exec setpriv "$@"')


def user_argv(user: str, argv: list[str]) -> list[str]:
    """`-u USER[:GROUP]`: crabd's exec runs as root; a non-root user is set
    by util-linux setpriv inside the sandbox, which resolves names from the
    sandbox's own /etc/passwd and /etc/group. Without it the exec fails
    with status 126 and says so (never runs as root instead)."""
    if user in ("", "root", "0", "0:0", "root:root"):
        return argv
    u, _, g = user.partition(":")
    opts = [f"--reuid={u}"]
    opts += [f"--regid={g}", "--clear-groups"] if g else ["--init-groups"]
    return ["/bin/sh", "-c", _SETPRIV, "sh", *opts, "--", *argv]


def go_file_mode(mode: int) -> int:
    """A unix st_mode as Go's os.FileMode (what docker cp's path stat carries)."""
    out = mode & 0o777
    fmt = stat.S_IFMT(mode)
    out |= {stat.S_IFDIR: 1 << 31, stat.S_IFLNK: 1 << 27, stat.S_IFIFO: 1 << 25, stat.S_IFSOCK: 1 << 24,
            stat.S_IFBLK: 1 << 26, stat.S_IFCHR: (1 << 26) | (1 << 21)}.get(fmt, 0)
    if mode & stat.S_ISUID:
        out |= 1 << 23
    if mode & stat.S_ISGID:
        out |= 1 << 22
    if mode & stat.S_ISVTX:
        out |= 1 << 20
    return out


def rfc3339(t: float | None) -> str:
    if not t:
        return "0001-01-01T00:00:00Z"
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_filters(raw: str | None) -> dict[str, list[str]]:
    """Docker's `filters` query: {"name": ["x"]} or the old {"name": {"x": true}}."""
    import json
    if not raw:
        return {}
    try:
        data = json.loads(raw)
    except ValueError:
        raise ValueError(f"invalid filters: {raw!r}") from None
    out: dict[str, list[str]] = {}
    for k, v in (data or {}).items():
        out[k] = [x for x, on in v.items() if on] if isinstance(v, dict) else list(v)
    return out


def name_matches(name: str, patterns: Iterable[str]) -> bool:
    """Docker's name filter: a regular expression searched in "/NAME"."""
    for p in patterns:
        try:
            if re.search(p, "/" + name):
                return True
        except re.error:
            if p.lstrip("/") in name:
                return True
    return False


def labels_match(labels: dict[str, str], wanted: Iterable[str]) -> bool:
    """Docker's label filter: every "KEY" present and every "KEY=VALUE" equal."""
    for w in wanted:
        k, eq, v = w.partition("=")
        if k not in labels or (eq and labels[k] != v):
            return False
    return True


def _ago(seconds: float) -> str:
    s = max(0, int(seconds))
    if s < 1:
        return "Less than a second"
    if s < 60:
        return f"{s} seconds"
    if s < 3600:
        return f"{s // 60} minutes"
    if s < 86400:
        return f"{s // 3600} hours"
    return f"{s // 86400} days"


def status_text(status: str, exit_code: int, started: float | None, finished: float | None,
                now: float | None = None) -> str:
    """`docker ps`'s STATUS column: "Up 5 seconds", "Exited (0) 2 minutes ago", "Created"."""
    now = now or time.time()
    if status == "running":
        return f"Up {_ago(now - (started or now))}"
    if status == "exited":
        return f"Exited ({exit_code}) {_ago(now - (finished or now))} ago"
    return status.capitalize()


def env_dict(pairs: list[str]) -> dict[str, str]:
    """Docker's ["K=V", ...] (a bare "K" takes nothing: crabd has no host env to copy)."""
    env: dict[str, str] = {}
    for e in pairs:
        k, eq, v = e.partition("=")
        if k and eq:
            env[k] = v
    return env
