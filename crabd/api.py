"""crabd's REST API v1 (FastAPI), served on a unix socket by `crabd serve`.

Errors are JSON `{"error": {"code", "message", "fix"}}` with the status of
the error's category (crabd.errors): 404 unknown ids, 409 wrong state or a
checkpoint of another sandbox, 422 malformed input, 408 exec timeout.
The OpenAPI document is at /openapi.json.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from .daemon import Daemon
from .errors import CrabdError, ExecTimeout
from .runtime import Limits

__all__ = ["make_app"]

MAX_BODY = 8 * 1024 * 1024


class LimitsIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    memory_bytes: int | None = Field(2 * 1024**3, ge=16 * 1024**2)
    pids: int | None = Field(1024, ge=8, le=1_000_000)
    cpus: float | None = Field(None, gt=0, le=1024)


class SandboxCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    image: str = Field(min_length=1, max_length=63)
    name: str | None = Field(None, min_length=1, max_length=63)
    limits: LimitsIn | None = None


class ExecIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    cmd: list[str] | str = Field(description="argv list, or a string run by /bin/sh -c")
    timeout: float | None = Field(600.0, gt=0, le=86400)
    env: dict[str, str] | None = None
    cwd: str | None = Field(None, max_length=4096)
    stdin: str | None = Field(None, max_length=MAX_BODY)


class RollbackIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    checkpoint: str | int | None = Field(None, description="checkpoint id or sequence number; latest when omitted")


class ForkIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    count: int = Field(1, ge=1, le=64)


class ErrorBody(BaseModel):
    code: str
    message: str
    fix: str | None = None


class ErrorOut(BaseModel):
    error: ErrorBody


def _err(status: int, code: str, message: str, fix: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message, "fix": fix}}, status_code=status)


_ERRORS: dict[int | str, dict[str, Any]] = {
    404: {"model": ErrorOut}, 409: {"model": ErrorOut}, 422: {"model": ErrorOut},
}


def make_app(daemon: Daemon, *, token: str | None = None) -> FastAPI:
    """The API. With `token`, requests that arrive over TCP must carry
    `Authorization: Bearer <token>`; the unix socket is guarded by its mode."""
    app = FastAPI(title="crabd", version="1", description="Recoverable sandboxes for AI agents.",
                  responses=_ERRORS)

    @app.middleware("http")
    async def bearer_on_tcp(request: Request, call_next: Any) -> Response:
        server = request.scope.get("server")
        over_tcp = isinstance(server, (tuple, list)) and len(server) == 2 and isinstance(server[1], int)
        if over_tcp:
            import hmac
            got = request.headers.get("authorization", "")
            if token is None or not hmac.compare_digest(got.encode(), f"Bearer {token}".encode()):
                return _err(401, "unauthenticated", "missing or wrong bearer token",
                            "send Authorization: Bearer <the token in crabd's token_file>")
        return await call_next(request)

    @app.middleware("http")
    async def limit_body(request: Request, call_next: Any) -> Response:
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > MAX_BODY):
            return _err(413, "too_large", f"request body over {MAX_BODY} bytes")
        return await call_next(request)

    @app.exception_handler(CrabdError)
    async def crabd_error(request: Request, e: CrabdError) -> JSONResponse:
        body: dict[str, Any] = {"code": e.code, "message": e.message, "fix": e.fix}
        if isinstance(e, ExecTimeout):
            body.update(stdout=e.stdout, stderr=e.stderr)
        return JSONResponse({"error": body}, status_code=e.http_status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        parts = []
        for err in e.errors()[:5]:
            loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
            parts.append(f"{loc or 'body'}: {err.get('msg')}")
        return _err(422, "invalid_argument", "; ".join(parts) or "invalid request")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "http_error")
        return _err(e.status_code, code, str(e.detail))

    @app.exception_handler(Exception)
    async def internal(request: Request, e: Exception) -> JSONResponse:
        return _err(500, "internal", f"{type(e).__name__}: {e}", "see crabd's log; this is a bug")

    def call(fn: Any, *a: Any, **kw: Any) -> Any:
        return asyncio.to_thread(fn, *a, **kw)

    # --- sandboxes ------------------------------------------------------------------
    @app.post("/v1/sandboxes", status_code=201)
    async def create_sandbox(body: SandboxCreate) -> dict[str, Any]:
        lim = Limits(**body.limits.model_dump()) if body.limits else Limits()
        row = await call(daemon.create_sandbox, body.image, name=body.name, limits=lim)
        return await call(daemon.sandbox_info, row.id)

    @app.get("/v1/sandboxes")
    async def list_sandboxes() -> dict[str, Any]:
        rows = await call(daemon.store.list_sandboxes)
        return {"sandboxes": [await call(daemon.sandbox_info, r.id) for r in rows]}

    @app.get("/v1/sandboxes/{sid}")
    async def get_sandbox(sid: str) -> dict[str, Any]:
        return await call(daemon.sandbox_info, sid)

    @app.delete("/v1/sandboxes/{sid}")
    async def delete_sandbox(sid: str) -> dict[str, Any]:
        await daemon.destroy(sid)
        return {"removed": sid}

    @app.post("/v1/sandboxes/{sid}/exec")
    async def exec_(sid: str, body: ExecIn) -> dict[str, Any]:
        return await daemon.exec(sid, body.cmd, timeout=body.timeout, env=body.env, cwd=body.cwd, stdin=body.stdin)

    @app.post("/v1/sandboxes/{sid}/turns/end")
    async def end_turn(sid: str) -> dict[str, Any]:
        return await daemon.end_turn(sid)

    # --- checkpoints -----------------------------------------------------------------
    @app.get("/v1/sandboxes/{sid}/checkpoints")
    async def list_checkpoints(sid: str, all: bool = False) -> dict[str, Any]:
        return {"checkpoints": await call(daemon.list_checkpoints, sid, all_states=all)}

    @app.post("/v1/sandboxes/{sid}/checkpoints", status_code=201)
    async def create_checkpoint(sid: str) -> dict[str, Any]:
        return await daemon.checkpoint_now(sid)

    @app.get("/v1/checkpoints/{cid}")
    async def get_checkpoint(cid: str) -> dict[str, Any]:
        return await call(daemon.checkpoint_info, cid)

    @app.delete("/v1/checkpoints/{cid}")
    async def delete_checkpoint(cid: str) -> dict[str, Any]:
        await call(daemon.delete_checkpoint, cid)
        return {"removed": cid}

    @app.get("/v1/checkpoints/{a}/diff/{b}")
    async def diff(a: str, b: str) -> dict[str, Any]:
        return await call(daemon.diff, a, b)

    @app.post("/v1/sandboxes/{sid}/rollback")
    async def rollback(sid: str, body: RollbackIn) -> dict[str, Any]:
        return await daemon.rollback(sid, body.checkpoint)

    @app.post("/v1/checkpoints/{cid}/fork", status_code=201)
    async def fork(cid: str, body: ForkIn) -> dict[str, Any]:
        return await daemon.fork(cid, body.count)

    # --- events, health, metrics ----------------------------------------------------------
    @app.get("/v1/events")
    async def events(since: int = Query(0, ge=0), sandbox: str | None = None,
                     follow: bool = True) -> Response:
        if not follow:
            evs = await call(daemon.store.events_since, since, sandbox)
            return JSONResponse({"events": [e.to_dict() for e in evs]})

        async def stream() -> Any:
            last = since
            while True:
                evs = await call(daemon.store.events_since, last, sandbox)
                for e in evs:
                    last = e.seq
                    yield f"id: {e.seq}\nevent: {e.kind}\ndata: {json.dumps(e.to_dict(), default=str)}\n\n"
                if not evs:
                    yield ": keep-alive\n\n"
                    await daemon.wait_event(15.0)

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.get("/v1/health")
    async def health() -> dict[str, Any]:
        return daemon.health()

    @app.get("/metrics")
    async def metrics() -> Response:
        from .metrics import CONTENT_TYPE
        return Response(daemon.metrics.render(), media_type=CONTENT_TYPE)

    return app
