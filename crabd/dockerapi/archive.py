"""The Docker API's archive routes (`docker cp`): tar runs in the sandbox,
as a crabd turn, so a file copied in is in the next checkpoint.
"""

from __future__ import annotations

import base64
import io
import json
import os
import tarfile
from typing import TYPE_CHECKING

from . import shapes
from .wire import DockerError, Reply, Request

from .containers import Container

if TYPE_CHECKING:
    from .engine import DockerEngine

# docker cp out of a container: tar | base64 in the sandbox, as crabd's exec
# returns text and keeps at most 1 MiB of each stream.
_ARCHIVE_OUT_MAX = (1 << 20) * 3 // 4 - 4096
_MISSING = 44  # exit status of the archive helpers: no such path


def _path(req: Request) -> str:
    p = req.arg("path") or ""
    if not p.startswith("/"):
        p = "/" + p
    if "\x00" in p:
        raise DockerError(400, "path contains a NUL byte")
    return p


async def _path_stat(engine: DockerEngine, c: Container, path: str) -> str:
    """Docker's X-Docker-Container-Path-Stat: base64 of JSON
    {name, size, mode (Go FileMode), mtime, linkTarget}."""
    script = (f'[ -e "$1" ] || [ -L "$1" ] || exit {_MISSING}; stat -c "%s %f %Y" "$1"; '
              '[ -L "$1" ] && readlink "$1"; exit 0')
    res = await engine.exec(c, ["/bin/sh", "-c", script, "sh", path], cwd="/")
    if res["exit_code"] == _MISSING:
        raise DockerError(404, f"Could not find the file {path} in container {c.name}")
    lines = res["stdout"].splitlines()
    try:
        size, mode_hex, mtime = lines[0].split()
        mode = shapes.go_file_mode(int(mode_hex, 16))
    except (IndexError, ValueError):
        raise DockerError(500, f"stat of {path} in the sandbox failed: {res['stderr'].strip()[-300:]}") from None
    st = {"name": os.path.basename(path.rstrip("/")) or "/", "size": int(size), "mode": mode,
          "mtime": shapes.rfc3339(float(mtime)).replace(".000000", ""),
          "linkTarget": lines[1] if len(lines) > 1 else ""}
    return base64.b64encode(json.dumps(st).encode()).decode()


def add_routes(engine: DockerEngine) -> None:
    r = engine.router

    @r.route("HEAD", "/containers/{ref}/archive")
    async def archive_head(req: Request) -> Reply:
        c = await engine.find(req.params["ref"])
        st = await _path_stat(engine, c, _path(req))
        return Reply(200, b"", [("X-Docker-Container-Path-Stat", st), ("Content-Type", "application/x-tar")])

    @r.route("GET", "/containers/{ref}/archive")
    async def archive_get(req: Request) -> Reply:
        c = await engine.find(req.params["ref"])
        path = _path(req)
        st = await _path_stat(engine, c, path)
        parent, base = os.path.split(path.rstrip("/") or "/")
        script = 'cd "$1" && tar -c -f - "$2" | base64'
        res = await engine.exec(c, ["/bin/sh", "-c", script, "sh", parent or "/", base or "."], cwd="/")
        if res.get("stdout_truncated"):
            raise DockerError(413, f"{path} is over crabd's copy-out limit ({_ARCHIVE_OUT_MAX >> 10} KiB of tar: "
                                   "an exec returns at most 1 MiB of output); copy it in parts")
        if res["exit_code"] != 0:
            raise DockerError(500, f"tar of {path} failed in the sandbox: {res['stderr'].strip()[-300:]}")
        data = base64.b64decode("".join(res["stdout"].split()))
        return Reply(200, data, [("X-Docker-Container-Path-Stat", st), ("Content-Type", "application/x-tar")])

    @r.route("PUT", "/containers/{ref}/archive")
    async def archive_put(req: Request) -> Reply:
        c = await engine.find(req.params["ref"])
        path = _path(req)
        try:  # refuse what tar could not unpack before it reaches the sandbox
            tarfile.open(fileobj=io.BytesIO(req.body), mode="r:*").getmembers()
        except (tarfile.TarError, EOFError) as e:
            raise DockerError(400, f"the body is not a tar archive: {e}") from None
        script = f'[ -d "$1" ] || exit {_MISSING}; exec tar -x -f - -C "$1"'
        res = await engine.exec(c, ["/bin/sh", "-c", script, "sh", path], cwd="/", stdin=req.body)
        if res["exit_code"] == _MISSING:
            raise DockerError(404, f"Could not find the file {path} in container {req.params['ref']}")
        if res["exit_code"] != 0:
            raise DockerError(500, f"extracting into {path} failed in the sandbox: {res['stderr'].strip()[-300:]}")
        return Reply(200)
