"""A Docker Engine API subset in front of crabd (issue 17).

Agent harnesses make their sandboxes through Docker (`docker run -d`, then
`docker exec` per step; or the `docker` Python SDK). `crabd serve` answers
the Docker API on a second unix socket (default: `docker.sock` next to
crabd's socket) so that such a harness keeps its code and gains per-turn
checkpoints, recovery and fork by changing only `DOCKER_HOST`.

A Docker container is a crabd sandbox (the container's name is the
sandbox's name); every `docker exec` is a crabd turn (`Daemon.exec`), so the
daemon inspects, plans and checkpoints it as it does for its own API, and
the sandbox stays visible to `crabd checkpoint ls NAME`, `crabd rollback`,
`crabd fork`.

Modules:
- `wire`: the HTTP/1.1 server (h11 over asyncio streams). Not ASGI: `docker
  exec`/`attach` hijack the connection (101 Switching Protocols, then raw
  bytes both ways), which ASGI servers cannot hand over.
- `shapes`: pure translation between Docker's JSON and crabd's terms
  (refused options, limits, ids, names, stream framing, file modes).
- `engine`: containers as sandboxes (their state, main commands, stop and
  remove), calling the Daemon's public methods, and the system routes;
  the other routes by kind: `images`, `containers`, `execs`, `archive`
  (`docker cp`), `checkpoints`.

What crabd cannot honour (published ports, host bind mounts, privileged,
...) is refused with a Docker-shaped 400 `{"message": ...}`, never ignored.
See docs/docker.md.
"""

from __future__ import annotations

from .engine import DockerEngine, serve_docker

__all__ = ["DockerEngine", "serve_docker"]
