"""`crabd-docker`: the real docker CLI, pointed at crabd's Docker API.

For harnesses that take the name of a docker executable but not its
environment (mini-swe-agent's docker environment: `executable:`). It adds
`-H unix://SOCKET` and runs the docker CLI in its place: Docker's flags,
output and exit codes are then the docker CLI's own, which a re-implementation
would only approximate. Socket: $CRABD_DOCKER_SOCKET, else
/run/crabd/docker.sock.
"""

from __future__ import annotations

import os
import shutil
import sys

__all__ = ["main"]

DEFAULT_SOCKET = "/run/crabd/docker.sock"


def argv(args: list[str], socket: str, docker: str) -> list[str]:
    """The docker command line crabd-docker runs. Pure."""
    return [docker, "-H", f"unix://{socket}", *args]


def main() -> None:
    docker = os.environ.get("CRABD_DOCKER_CLI") or shutil.which("docker")
    if docker is None:
        sys.stderr.write("crabd-docker: the docker CLI is not installed (fix: apt-get install docker.io, or set "
                         "CRABD_DOCKER_CLI to its path); crabd-docker runs it against crabd's Docker API socket\n")
        raise SystemExit(127)
    socket = os.environ.get("CRABD_DOCKER_SOCKET") or DEFAULT_SOCKET
    env = {k: v for k, v in os.environ.items() if k not in ("DOCKER_HOST", "DOCKER_CONTEXT")}
    os.execve(docker, argv(sys.argv[1:], socket, docker), env)
