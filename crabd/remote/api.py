"""REST routes of checkpoint push/pull (crabd.remote), mounted by crabd/api.py.

    POST /v1/checkpoints/{cid}/push  {"reference", "registry_auth"?, "insecure"?}
         -> {digest, pinned, blobs_pushed, blobs_skipped, bytes_pushed, bytes_total, ...}
    POST /v1/sandboxes/pull          {"reference", "name"?, "registry_auth"?, "insecure"?, "processes"?,
                                      "prefetch"?}
         -> 201 {sandbox, status, restored, fs_layers_imported, fs_layers_reused, ...}
            (prefetch: {prefetched, fs_layers_imported, chunks_imported, ...}, no sandbox)
    POST /v1/sandboxes/{sid}/migrate {"reference", "target_socket", "registry_auth"?, "insecure"?}
         -> {target_sandbox, reference, downtime_ms, phases_ms, precopy, push, ...} (the source is gone)

Errors: 502 `registry_error` (unreachable, refused, bad credentials), 500
`integrity_error` (a blob or manifest that does not match its digest: nothing
imported), 404 (no such manifest), 409 (the image the checkpoint runs is
missing here), 422 (a malformed reference).
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter
from pydantic import Field

from ..api import Id, Name, Owner, StrictIn
from .oci import REFERENCE_PATTERN

__all__ = ["make_router"]

Ref = Annotated[str, Field(max_length=512, pattern=REFERENCE_PATTERN,
                           description="HOST[:PORT]/REPOSITORY[:TAG][@sha256:...]")]
Auth = Annotated[str, Field(min_length=1, max_length=4096, pattern=r"^[^\x00]*:[^\x00]*$")]


class PushIn(StrictIn):
    reference: Ref
    registry_auth: Auth | None = Field(None, description="USER:PASSWORD; else ~/.docker/config.json of crabd")
    insecure: bool = Field(False, description="plain HTTP to a registry that is not localhost")


class PullIn(StrictIn):
    reference: Ref
    name: Name | None = Field(None, description="a unique name for the new sandbox")
    registry_auth: Auth | None = None
    insecure: bool = False
    processes: bool = Field(True, description="restore the checkpoint's processes (CRIU); false: a fresh init")
    prefetch: bool = Field(False, description="only import its layers and chunks, no sandbox (a migration's "
                                              "pre-copy)")


class MigrateIn(StrictIn):
    reference: Ref
    target_socket: str = Field(min_length=1, max_length=4096, pattern=r"^/[^\x00]*$",
                               description="the target crabd's API socket (an absolute path)")
    registry_auth: Auth | None = None
    insecure: bool = False


def make_router(daemon: Any) -> APIRouter:
    from .migrate import migrate_sandbox
    from .transfer import pull_sandbox, push_checkpoint

    r = APIRouter(tags=["remote"])

    @r.post("/v1/checkpoints/{cid}/push", name="push_checkpoint")
    async def push(cid: Id, body: PushIn, owner: Owner) -> dict[str, Any]:
        """Push the checkpoint to an OCI registry: its file-system layers, its CRIU image's chunks and a
        config, skipping every blob the registry already has."""
        ck = await asyncio.to_thread(daemon.store.get_checkpoint, cid)
        daemon._own(await asyncio.to_thread(daemon.store.get_sandbox, ck.sandbox_id), owner)
        return await asyncio.to_thread(push_checkpoint, daemon, ck.id, body.reference, auth=body.registry_auth,
                                       insecure=body.insecure)

    @r.post("/v1/sandboxes/pull", status_code=201, name="pull_sandbox")
    async def pull(body: PullIn, owner: Owner) -> dict[str, Any]:
        """A new sandbox from a checkpoint in an OCI registry: its files and (CRIU) its processes."""
        return await asyncio.to_thread(pull_sandbox, daemon, body.reference, name=body.name, owner=owner or "",
                                       auth=body.registry_auth, insecure=body.insecure, processes=body.processes,
                                       prefetch=body.prefetch)

    @r.post("/v1/sandboxes/{sid}/migrate", name="migrate_sandbox")
    async def migrate(sid: Id, body: MigrateIn, owner: Owner) -> dict[str, Any]:
        """Live migration to another daemon: pre-copy, freeze, capture, push the delta, the target restores
        it; the source is destroyed only once the target runs it, else thawed and kept."""
        return await migrate_sandbox(daemon, sid, body.reference, body.target_socket, owner=owner,
                                     auth=body.registry_auth, insecure=body.insecure)

    return r
