"""crabd's REST API v1 (FastAPI), served on a unix socket by `crabd serve`.

Errors are JSON `{"error": {"code", "message", "fix"}}` with the status of
the error's category (crabd.errors): 404 unknown ids, 409 wrong state or a
checkpoint of another sandbox, 422 malformed input, 408 exec timeout.
The OpenAPI document is at /openapi.json.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI, Query, Request
from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StringConstraints, WithJsonSchema
from starlette.exceptions import HTTPException as StarletteHTTPException

from deltacr.errors import DeltacrError
from deltafs.errors import DeltafsError

from .daemon import Daemon, is_disk_full
from .errors import CrabdError, ExecTimeout, InvalidArgument, NotFound, from_library
from .images import NAME_PATTERN
from .runtime import Limits
from .store import EVENTS_MAX_PAGE
from .ui import COOKIE as UI_COOKIE
from .ui import PUBLIC as UI_PUBLIC
from .ui import send_see_login

__all__ = ["make_app"]

MAX_BODY = 8 * 1024 * 1024
# Sandbox ids and names, checkpoint ids: no "..", "/", NUL or other bytes a
# path could be built from (ids never become paths, but refuse them early).
ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
MAX_SEQ = 2**63 - 1  # SQLite's INTEGER


# The request models below carry every rule the server enforces on a body,
# so /openapi.json (and docs/reference/api.md, generated from it) says what
# is accepted: a schema-valid request is never a 422 `invalid_argument`.
# Only what JSON Schema cannot say stays in validators (lone surrogates).
NO_NUL = r"^[^\x00]*$"
ENV_NAME_PATTERN = r"^[^=\x00]+$"


def _utf8(v: str) -> str:
    # Lone surrogates (JSON "\ud800") are valid JSON but no UTF-8: they would
    # fail deep in subprocess/sqlite with a 500.
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("not valid UTF-8 (lone surrogate)") from None
    return v


def _integral(v: Any) -> Any:
    # JSON Schema's "integer" is any number with a zero fraction: 62.0 is
    # one. Strict models would refuse it, so take it as the int it is.
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


#: A string with no NUL byte, valid UTF-8.
Text = Annotated[str, StringConstraints(pattern=NO_NUL), AfterValidator(_utf8)]
Utf8 = Annotated[str, AfterValidator(_utf8)]
#: Put after an int's bounds: 62.0 counts as 62, true and "62" do not.
#: (Placed before them, pydantic would leave the bounds out of the schema.)
AS_INT = BeforeValidator(_integral)
#: An image or sandbox name (crabd.images.validate_name).
Name = Annotated[str, StringConstraints(pattern=NAME_PATTERN)]
Env = Annotated[
    dict[Annotated[str, StringConstraints(min_length=1, pattern=ENV_NAME_PATTERN)], Text],
    WithJsonSchema({"type": "object", "propertyNames": {"pattern": ENV_NAME_PATTERN},
                    "additionalProperties": {"type": "string", "pattern": NO_NUL}}),
]
Id = Annotated[str, PathParam(pattern=ID_PATTERN, max_length=128, description="an id (or a sandbox's name)")]


class StrictIn(BaseModel):
    """A request body: unknown keys and mistyped values are 422 (true is no number)."""
    model_config = ConfigDict(extra="forbid", strict=True)


class LimitsIn(StrictIn):
    memory_bytes: Annotated[int, Field(ge=16 * 1024**2, le=1 << 50), AS_INT] | None = Field(
        2 * 1024**3, description="memory limit of the sandbox's cgroup (bytes); null: none")
    pids: Annotated[int, Field(ge=8, le=1_000_000), AS_INT] | None = Field(
        1024, description="most processes and threads at once; null: none")
    # The kernel refuses a CFS quota under 1 ms (of the 100 ms period runtime/oci.py sets):
    # a smaller one failed the sandbox's creation inside runc, a 500 instead of a 422.
    cpus: float | None = Field(None, ge=0.01, le=1024,
                               description="CPU quota in cores (at least 0.01: 1 ms of each 100 ms); null: none")


class SandboxCreate(StrictIn):
    image: Name = Field(description="an image name (crabd image ls)")
    name: Name | None = Field(None, description="a unique name for the sandbox; usable wherever its id is")
    limits: LimitsIn | None = Field(None, description="cgroup limits; the defaults when omitted")


class ExecIn(StrictIn):
    cmd: Annotated[list[Text], Field(min_length=1)] | Annotated[Text, Field(min_length=1)] = Field(
        description="argv list, or a string run by /bin/sh -c")
    timeout: float | None = Field(600.0, gt=0, le=86400,
                                  description="seconds; then the command's process tree is killed (408)")
    env: Env | None = Field(None, description="environment variables added to the image's")
    cwd: Text | None = Field(None, min_length=1, max_length=4096,
                             description="working directory in the sandbox; the image's when omitted")
    stdin: Utf8 | None = Field(None, max_length=MAX_BODY, description="text given to the command on stdin")


class RollbackIn(StrictIn):
    checkpoint: (Annotated[str, Field(pattern=ID_PATTERN)] | Annotated[int, Field(ge=0, le=MAX_SEQ), AS_INT]
                 | None) = Field(None, description="checkpoint id or sequence number; latest when omitted")


class ForkIn(StrictIn):
    count: Annotated[int, Field(ge=1, le=64), AS_INT] = Field(1, description="how many sandboxes")


class ErrorBody(BaseModel):
    code: str
    message: str
    fix: str | None = None


class ErrorOut(BaseModel):
    error: ErrorBody


def _err(status: int, code: str, message: str, fix: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message, "fix": fix}}, status_code=status)


_ERRORS: dict[int | str, dict[str, Any]] = {
    s: {"model": ErrorOut} for s in (401, 404, 408, 409, 413, 422, 500)
}


async def _send_error(send: Any, status: int, code: str, message: str, fix: str | None = None) -> None:
    body = json.dumps({"error": {"code": code, "message": message, "fix": fix}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class _Guard:
    """Raw ASGI middleware in front of every route.

    Authentication: over TCP a request must carry `Authorization: Bearer T`
    with T the token of `token_file` (owner: none, sees everything) or a
    token of `tokens_file` (owner: its name); otherwise 401. On the unix
    socket (guarded by its mode) no token is needed (no owner); one that is
    sent must be valid and scopes the request to its owner.

    Body size: at most MAX_BODY bytes, read as it arrives (chunked bodies
    too, which carry no Content-Length) and answered 413 at the first byte
    over, never buffered whole beyond the limit.

    The operator view (crabd.ui): a GET under /ui/ may carry the token in
    the `crabd_token` cookie instead (a browser's navigation sends no
    header), and is sent to /ui/login without one; /ui/login itself, a form
    with no data, and its two files need none (crabd.ui.PUBLIC)."""

    def __init__(self, app: Any, token: str | None = None, tokens: dict[str, str] | None = None) -> None:
        self.app = app
        self.token = token
        self.tokens = dict(tokens or {})

    def _owner(self, header: str) -> tuple[bool, str | None]:
        import hmac
        if not header.startswith("Bearer "):
            return False, None
        got = header[7:].strip().encode()
        ok, owner = False, None
        if self.token is not None and hmac.compare_digest(got, self.token.encode()):
            ok = True
        for tok, name in self.tokens.items():  # compare with all: no early exit
            if hmac.compare_digest(got, tok.encode()):
                ok, owner = True, name
        return ok, owner

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        server = scope.get("server")
        over_tcp = isinstance(server, (tuple, list)) and len(server) == 2 and isinstance(server[1], int)
        auth = headers.get("authorization")
        owner: str | None = None
        path, method = scope.get("path", ""), scope.get("method")
        if auth is None and method in ("GET", "HEAD") and path.startswith("/ui"):
            auth = _cookie_bearer(headers.get("cookie", ""))  # a page's navigation sends no header (crabd.ui)
        if over_tcp and auth is None and method == "GET" and path in UI_PUBLIC:
            pass  # the token form and its files: no data (crabd.ui)
        elif over_tcp or auth is not None:
            ok, owner = self._owner(auth or "")
            if not ok and method == "GET" and path.startswith("/ui"):
                return await send_see_login(send)
            if not ok:
                return await _send_error(send, 401, "unauthenticated", "missing or wrong bearer token",
                                         "send Authorization: Bearer <a token of crabd's token_file or tokens_file>")
        scope.setdefault("state", {})["crabd_owner"] = owner
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > MAX_BODY):
            return await _send_error(send, 413, "too_large", f"request body over {MAX_BODY} bytes",
                                     "send a smaller body (stdin is limited to the same size)")
        # Read the body as it streams in, up to the limit, then replay it.
        chunks: list[bytes] = []
        size = 0
        more = scope.get("method") not in ("GET", "HEAD", "DELETE") or length not in (None, "0")
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            part = msg.get("body", b"")
            size += len(part)
            if size > MAX_BODY:
                return await _send_error(send, 413, "too_large", f"request body over {MAX_BODY} bytes",
                                         "send a smaller body (stdin is limited to the same size)")
            chunks.append(part)
            more = msg.get("more_body", False)
        body = b"".join(chunks)
        sent = False

        async def replay() -> Any:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def _cookie_bearer(cookie: str) -> str | None:
    """`Bearer T` for a `crabd_token=T` cookie, else None."""
    for part in cookie.split(";"):
        k, _, v = part.strip().partition("=")
        if k == UI_COOKIE and v:
            from urllib.parse import unquote
            return "Bearer " + unquote(v)
    return None


def _owner(request: Request) -> str | None:
    """The owner a request acts for (its token's name), None = no owner scope."""
    return request.scope.get("state", {}).get("crabd_owner")


Owner = Annotated[str | None, Depends(_owner)]


def make_app(daemon: Daemon, *, token: str | None = None, tokens: dict[str, str] | None = None) -> FastAPI:
    """The API. With `token` (token_file) or `tokens` (tokens_file: token ->
    owner), requests that arrive over TCP must carry `Authorization: Bearer
    <token>`; the unix socket is guarded by its mode. A request with an
    owner's token sees and changes only that owner's sandboxes, their
    checkpoints and events; others' are 404, as if they did not exist."""

    def _ck_owned(cid: str, owner: str) -> None:
        try:
            c = daemon.store.get_checkpoint(cid)
            daemon._own(daemon.store.get_sandbox(c.sandbox_id), owner)
        except NotFound:
            raise NotFound(f"no checkpoint {cid!r}", fix="GET /v1/sandboxes/{id}/checkpoints lists them") from None

    async def owner_scope(request: Request) -> None:
        """Every route with a sandbox or checkpoint id in its path, for a
        request with an owner: another owner's ids are 404 (routes added by
        other modules included)."""
        owner = _owner(request)
        p = request.path_params
        if owner is None or not p:
            return

        def check() -> None:
            if "sid" in p:
                daemon._own(daemon.store.get_sandbox(p["sid"]), owner)
            for key in ("cid", "a", "b"):
                if key in p:
                    _ck_owned(p[key], owner)
            if "eid" in p:
                get = getattr(getattr(daemon, "ledger", None), "get", None)
                try:
                    sid = get(p["eid"]).get("sandbox_id") if get else None
                    daemon._own(daemon.store.get_sandbox(sid), owner)
                except (NotFound, AttributeError, TypeError):
                    raise NotFound(f"no effect {p['eid']!r}") from None

        await asyncio.to_thread(check)

    app = FastAPI(title="crabd", version="1", description="Recoverable sandboxes for AI agents.",
                  responses=_ERRORS, dependencies=[Depends(owner_scope)],
                  generate_unique_id_function=lambda route: route.name)  # operationId = the handler's name
    app.add_middleware(_Guard, token=token, tokens=tokens)

    @app.exception_handler(CrabdError)
    async def crabd_error(request: Request, e: CrabdError) -> JSONResponse:
        body: dict[str, Any] = {"code": e.code, "message": e.message, "fix": e.fix}
        if isinstance(e, ExecTimeout):
            body.update(stdout=e.stdout, stderr=e.stderr)
        return JSONResponse({"error": body}, status_code=e.http_status)

    # deltafs and deltacr errors that reach the API: by their crabd class
    # (crabd.errors.from_library), so the client catches them by type.
    @app.exception_handler(DeltafsError)
    @app.exception_handler(DeltacrError)
    async def library_error(request: Request, e: Exception) -> JSONResponse:
        return await crabd_error(request, from_library(e) or CrabdError(str(e)))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        parts = []
        for err in e.errors()[:5]:
            loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
            parts.append(f"{loc or 'body'}: {err.get('msg')}")
        return _err(422, "invalid_argument", "; ".join(parts) or "invalid request")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        if e.status_code == 400:  # a body FastAPI could not parse (not UTF-8 JSON): malformed input
            return _err(422, "invalid_argument", f"{e.detail}: the body is not JSON in UTF-8",
                        "send a JSON object encoded as UTF-8")
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "http_error")
        return _err(e.status_code, code, str(e.detail))

    # The state file system is shared by every sandbox (no per-sandbox
    # quota): a sandbox that fills it makes crabd's own writes fail. Handled
    # here (not by the catch-all, which re-raises) so the client gets a clean
    # answer that says so instead of a reset connection.
    @app.exception_handler(OSError)
    @app.exception_handler(sqlite3.Error)
    async def storage_error(request: Request, e: Exception) -> JSONResponse:
        logging.getLogger("crabd").warning("%s %s failed: %s", request.method, request.url.path, e, exc_info=e)
        if is_disk_full(e):
            return _err(507, "disk_full", f"crabd's state file system is full: {e}",
                        "free space in the state directory: delete sandboxes or checkpoints that hold big "
                        "files (a rm inside a sandbox frees nothing its checkpoints still hold)")
        return _err(500, "internal", f"{type(e).__name__}: {e}", "see crabd's log")

    @app.exception_handler(Exception)
    async def internal(request: Request, e: Exception) -> JSONResponse:
        return _err(500, "internal", f"{type(e).__name__}: {e}", "see crabd's log; this is a bug")

    def call(fn: Any, *a: Any, **kw: Any) -> Any:
        return asyncio.to_thread(fn, *a, **kw)

    # --- sandboxes ------------------------------------------------------------------
    @app.post("/v1/sandboxes", status_code=201)
    async def create_sandbox(body: SandboxCreate, owner: Owner) -> dict[str, Any]:
        """A new sandbox from an image, started, with its initial checkpoint; 201 and the sandbox."""
        lim = Limits(**body.limits.model_dump()) if body.limits else Limits()
        row = await call(daemon.create_sandbox, body.image, name=body.name, limits=lim, owner=owner or "")
        return await call(daemon.sandbox_info, row.id)

    @app.get("/v1/sandboxes")
    async def list_sandboxes(owner: Owner) -> dict[str, Any]:
        """Every sandbox the caller may see: `{"sandboxes": [...]}`."""
        rows = await call(daemon.store.list_sandboxes, owner)
        return {"sandboxes": [await call(daemon.sandbox_info, r.id) for r in rows]}

    @app.get("/v1/sandboxes/{sid}")
    async def get_sandbox(sid: Id, owner: Owner) -> dict[str, Any]:
        """One sandbox: state, image, head checkpoint, branch, turn, limits."""
        return await call(daemon.sandbox_info, sid, owner)

    @app.delete("/v1/sandboxes/{sid}")
    async def delete_sandbox(sid: Id, owner: Owner) -> dict[str, Any]:
        """Destroy the sandbox and its checkpoints (not the checkpoints its forks still use)."""
        await daemon.destroy(sid, owner)
        return {"removed": sid}

    @app.post("/v1/sandboxes/{sid}/exec", name="exec")
    async def exec_(sid: Id, body: ExecIn, owner: Owner) -> dict[str, Any]:
        """One agent turn: run `cmd`, then plan and start its checkpoint in the background. Replies at once
        with `exit_code`, `stdout`, `stderr`, `turn`, `checkpoint`, `plan`, `reasons`, `stall_ms`, `branch`.
        408 with the partial output on timeout."""
        return await daemon.exec(sid, body.cmd, timeout=body.timeout, env=body.env, cwd=body.cwd, stdin=body.stdin,
                                 owner=owner)

    @app.post("/v1/sandboxes/{sid}/turns/end")
    async def end_turn(sid: Id, owner: Owner) -> dict[str, Any]:
        """An explicit turn boundary, for agents that run commands another way: checkpoint what changed since
        the last one."""
        return await daemon.end_turn(sid, owner)

    # --- checkpoints -----------------------------------------------------------------
    @app.get("/v1/sandboxes/{sid}/checkpoints")
    async def list_checkpoints(sid: Id, owner: Owner, all: bool = False) -> dict[str, Any]:
        """The sandbox's checkpoints, oldest first (`all=true`: failed ones too), each with why retention keeps
        it."""
        return {"checkpoints": await call(daemon.list_checkpoints, sid, owner, all_states=all)}

    @app.post("/v1/sandboxes/{sid}/checkpoints", status_code=201)
    async def create_checkpoint(sid: Id, owner: Owner) -> dict[str, Any]:
        """A manual checkpoint of the sandbox now (files and processes); 201 and the checkpoint."""
        return await daemon.checkpoint_now(sid, owner)

    @app.get("/v1/checkpoints/{cid}")
    async def get_checkpoint(cid: Id, owner: Owner) -> dict[str, Any]:
        """One checkpoint: plan and reasons, effects seen, bytes, phase timings, parent, branch, state."""
        return await call(daemon.checkpoint_info, cid, owner)

    @app.delete("/v1/checkpoints/{cid}")
    async def delete_checkpoint(cid: Id, owner: Owner) -> dict[str, Any]:
        """Delete a checkpoint; its children take its parent."""
        await call(daemon.delete_checkpoint, cid, owner)
        return {"removed": cid}

    @app.get("/v1/checkpoints/{a}/diff/{b}")
    async def diff(a: Id, b: Id, owner: Owner,
                   limit: int = Query(10_000, ge=1, le=1_000_000, description="at most this many changes")) -> dict[str, Any]:
        """Files added, modified and deleted from checkpoint `a` to checkpoint `b` (at most `limit`; `total`
        and `truncated` say how many there are)."""
        return await call(daemon.diff, a, b, owner, limit)

    @app.post("/v1/sandboxes/{sid}/rollback")
    async def rollback(sid: Id, body: RollbackIn, owner: Owner) -> dict[str, Any]:
        """Roll the sandbox back to a checkpoint (id or sequence number; the newest complete one when omitted):
        files and processes. A new branch starts there. The reply lists the external effects no rollback
        undoes (`effects_not_undone`, `ledger`)."""
        return await daemon.rollback(sid, body.checkpoint, owner=owner)

    @app.post("/v1/checkpoints/{cid}/fork", status_code=201)
    async def fork(cid: Id, body: ForkIn, owner: Owner) -> dict[str, Any]:
        """`count` new sandboxes from one checkpoint, each with its files and processes; 201 and `{"sandboxes":
        [...]}`."""
        return await daemon.fork(cid, body.count, owner)

    # --- events, health, metrics ----------------------------------------------------------
    max_page = EVENTS_MAX_PAGE

    def event_page(since: int, before: int | None, sandbox: str | None, owner: str | None, limit: int,
                   order: str, latest: int | None) -> dict[str, Any]:
        """One page of the events the owner may see (its sandboxes' only)."""
        newest_first = order == "desc" or latest is not None
        n = latest if latest is not None else limit
        evs, more = daemon.store.events_page(since=since, before=before, sandbox_id=sandbox, owner=owner,
                                             limit=n, newest_first=newest_first)
        if latest is not None:
            evs.reverse()  # the newest N, oldest first: read like a log's tail
        if order == "desc":
            # Older events are next: pass `next` as `before`.
            nxt = evs[-1].seq if evs and more else None
        else:
            # Newer ones: pass `next` as `since` (also once caught up, to tail).
            nxt = evs[-1].seq if evs else since
        return {"events": [e.to_dict() for e in evs], "order": "desc" if order == "desc" else "asc",
                "limit": n, "max_limit": max_page, "more": more, "next": nxt,
                "last_seq": daemon.store.last_event_seq(sandbox, owner)}

    @app.get("/v1/events", description=(
        "The daemon's events (rollbacks, deaths, checkpoints), a page at a time: at most `limit` "
        f"(1..{max_page}, default {max_page}) per reply. `order=asc` (default): the oldest events after `since`; "
        "`order=desc`: the newest (before `before`, if given), newest first; `latest=N`: the newest N, "
        "oldest first. The reply echoes `limit`, says whether the range holds `more` events beyond the page, "
        "and gives the cursor `next`: pass it as `since` for the next page (asc, latest; also to tail once "
        "`more` is false) or as `before` (desc; null when there is nothing older). `last_seq` is the newest "
        "matching event's seq. follow=true (the default): a server-sent event stream from `since` (or from the "
        "newest `latest`) on, without end."), responses={200: {
            "description": "follow=false: {events, order, limit, max_limit, more, next, last_seq}; "
                           "follow=true: a server-sent event stream",
            "content": {"application/json": {}, "text/event-stream": {}}}})
    async def events(owner: Owner, since: int = Query(0, ge=0, le=MAX_SEQ),
                     sandbox: Annotated[str | None, Query(pattern=ID_PATTERN, max_length=128)] = None,
                     follow: bool = True,
                     before: int | None = Query(None, ge=1, le=MAX_SEQ),
                     limit: int = Query(max_page, ge=1, le=max_page),
                     order: Literal["asc", "desc"] = "asc",
                     latest: int | None = Query(None, ge=1, le=max_page)) -> Response:
        if latest is not None and order == "desc":
            raise InvalidArgument("latest=N already gives the newest events (oldest first); "
                                  "drop order=desc, or use order=desc&limit=N")
        if not follow:
            return JSONResponse(await call(event_page, since, before, sandbox, owner, limit, order, latest))
        if latest is not None:  # start the stream just before the newest N
            first, _ = await call(lambda: daemon.store.events_page(
                since=since, sandbox_id=sandbox, owner=owner, limit=latest, newest_first=True))
            since = first[-1].seq - 1 if first else since

        async def stream() -> Any:
            last = since
            while True:
                evs, _ = await call(lambda: daemon.store.events_page(since=last, sandbox_id=sandbox, owner=owner,
                                                                     limit=max_page))
                for e in evs:
                    yield f"id: {e.seq}\nevent: {e.kind}\ndata: {json.dumps(e.to_dict(), default=str)}\n\n"
                if evs:
                    last = evs[-1].seq
                else:
                    yield ": keep-alive\n\n"
                    await daemon.wait_event(15.0)

        return StreamingResponse(stream(), media_type="text/event-stream")

    from .api_effects import make_router as effects_router
    app.include_router(effects_router(daemon))  # effects ledger and budgets
    from .ui import mount as mount_ui
    mount_ui(app, daemon)  # the operator view (/ui) and its two read-only endpoints
    from .remote.api import make_router as remote_router
    app.include_router(remote_router(daemon))  # checkpoints pushed to / pulled from OCI registries

    @app.get("/v1/health")
    async def health() -> dict[str, Any]:
        """The daemon's health: ok, uptime, the snapshot driver and the inspector in use (`loading` while the BPF
        program compiles after a start: `inspector_ready` false, and every turn that ends meanwhile is saved whole),
        sandboxes and how many of them are still being re-adopted after a start (`adopting`: their turns and
        rollbacks wait for it), store schema version. Answered from the moment the daemon's state is loaded, before
        the rest of the API is (a request without a token on the unix socket)."""
        return daemon.health()

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        """Prometheus metrics (docs/reference/metrics.md)."""
        from .metrics import CONTENT_TYPE
        return Response(daemon.metrics.render(), media_type=CONTENT_TYPE)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            add_links(schema)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


# OpenAPI links: which reply field feeds which path parameter. They tell a
# client (and a stateful fuzzer) that the id a create returns is the id the
# other operations take, so generated sequences reach real sandboxes,
# checkpoints and effects instead of 404.
#   (method, path, status) -> [(JSON pointer in the reply, path parameter)]
PRODUCERS: dict[tuple[str, str, str], list[tuple[str, str]]] = {
    ("post", "/v1/sandboxes", "201"): [("/id", "sid")],
    ("post", "/v1/checkpoints/{cid}/fork", "201"): [("/sandboxes/0/id", "sid")],
    ("post", "/v1/sandboxes/{sid}/checkpoints", "201"): [("/id", "cid"), ("/id", "a"), ("/id", "b")],
    ("post", "/v1/sandboxes/{sid}/exec", "200"): [("/checkpoint", "cid"), ("/checkpoint", "a"), ("/checkpoint", "b")],
    ("post", "/v1/sandboxes/{sid}/effects/intent", "200"): [("/effect/id", "eid")],
}


def add_links(schema: dict[str, Any]) -> dict[str, Any]:
    """Add the PRODUCERS' links to an OpenAPI document (in place). Every
    operation with one of the produced parameters in its path is a target;
    its other path parameters are taken from the producer's request when it
    has them (a checkpoint's sandbox), else left to the caller."""
    paths = schema.get("paths", {})
    for (method, path, status), fields in PRODUCERS.items():
        producer = paths.get(path, {}).get(method)
        if producer is None:
            continue
        response = producer.setdefault("responses", {}).setdefault(status, {"description": "OK"})
        links = response.setdefault("links", {})
        own = {p for p in ("sid", "cid", "eid") if "{" + p + "}" in path}
        for target_path, ops in paths.items():
            for target_method, op in ops.items():
                wanted = {n for n in ("sid", "cid", "a", "b", "eid") if "{" + n + "}" in target_path}
                params = {name: f"$response.body#{ptr}" for ptr, name in fields if name in wanted}
                if not params:
                    continue
                params.update({n: f"$request.path.{n}" for n in wanted - set(params) if n in own})
                if set(params) != wanted:
                    continue  # a parameter no reply or request of this producer gives
                links[op["operationId"]] = {"operationId": op["operationId"], "parameters": params}
        checkpoint = next((ptr for ptr, name in fields if name == "cid"), None)
        if checkpoint is not None and "sid" in own:
            # A checkpoint of this sandbox: roll the sandbox back to it.
            links["rollback"] = {"operationId": "rollback", "parameters": {"sid": "$request.path.sid"},
                                 "requestBody": {"checkpoint": f"$response.body#{checkpoint}"}}
    return schema
