"""The Docker API's checkpoint routes: crabd's checkpoints under Docker's
names (`docker checkpoint create/ls/rm`, `docker start --checkpoint`).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import TYPE_CHECKING

from ..errors import FailedPrecondition
from .wire import DockerError, Reply, Request

if TYPE_CHECKING:
    from .engine import DockerEngine

log = logging.getLogger("crabd.docker")


def add_routes(engine: DockerEngine) -> None:
    r, d = engine.router, engine.daemon

    @r.route("GET", "/containers/{ref}/checkpoints")
    async def ck_list(req: Request) -> Reply:
        c = await engine.find(req.params["ref"])
        names = {v: k for k, v in c.checkpoints.items()}
        cks = await asyncio.to_thread(d.list_checkpoints, c.sid)
        return Reply.json([{"Name": names.get(k["id"], k["id"])} for k in cks])

    @r.route("POST", "/containers/{ref}/checkpoints")
    async def ck_create(req: Request) -> Reply:
        c = await engine.find_running(req.params["ref"])
        body = req.json()
        name = body.get("CheckpointID") or ""
        if not name:
            raise DockerError(400, "a checkpoint name is required")
        if name in c.checkpoints:
            raise DockerError(409, f"checkpoint with name {name} already exists for container {c.name}")
        ck = await d.checkpoint_now(c.sid)
        c.checkpoints[name] = ck["id"]
        engine.save(c)
        if body.get("Exit", True):  # docker checkpoint create stops the container unless --leave-running
            await engine.stop(c, signal.SIGKILL)
        return Reply(201)

    @r.route("DELETE", "/containers/{ref}/checkpoints/{name}")
    async def ck_delete(req: Request) -> Reply:
        c = await engine.find(req.params["ref"])
        name = req.params["name"]
        if name not in c.checkpoints:  # a crabd checkpoint id: deleted as crabd's API would
            await asyncio.to_thread(d.delete_checkpoint, name)
            return Reply(204)
        # A Docker name is a handle on a crabd checkpoint: the name goes;
        # the checkpoint too unless later ones still build on it (then
        # crabd's retention removes it in time).
        cid = c.checkpoints.pop(name)
        engine.save(c)
        try:
            await asyncio.to_thread(d.delete_checkpoint, cid)
        except FailedPrecondition as e:
            log.info("docker checkpoint rm %s: keeping %s: %s", name, cid, e.message)
        return Reply(204)
