"""The Docker API's HTTP/1.1 server: h11 over asyncio unix-socket streams.

Why not uvicorn (as crabd's own API): `docker exec` and `docker attach` send
`Connection: Upgrade`, `Upgrade: tcp` and, after `101 Switching Protocols`,
use the connection as a raw byte stream both ways (stdin in, framed output
out; the client half-closes when its stdin ends). ASGI has no way to hand a
connection over, and uvicorn would parse the stdin bytes that follow the
request as the next request. h11 models exactly this: after a proposed
upgrade it stops parsing and gives back the bytes it already read.

A route answers with a `Reply`, raises `DockerError` (Docker's error shape:
`{"message": ...}` with the status), or returns a `Hijack` whose `run` gets
the raw `Stream`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable
from urllib.parse import parse_qs, urlsplit

import h11

__all__ = ["Request", "Reply", "Hijack", "Stream", "DockerError", "Router", "serve_connection", "MAX_BODY"]

log = logging.getLogger("crabd.docker")

MAX_BODY = 256 * 1024 * 1024  # an archive PUT (docker cp into a container) is held in memory
_VERSION = re.compile(r"^/v(1\.\d{1,3})(/.*)$")


class DockerError(Exception):
    """An answer in Docker's error shape: HTTP `status`, body {"message": ...}."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class Request:
    method: str
    path: str                       # without the /v1.NN prefix
    query: dict[str, list[str]]
    headers: dict[str, str]         # lower-case names
    body: bytes = b""
    api_version: str | None = None  # "1.41" when the client sent /v1.41/...
    params: dict[str, str] = field(default_factory=dict)

    def arg(self, name: str, default: str | None = None) -> str | None:
        v = self.query.get(name)
        return v[-1] if v else default

    def flag(self, name: str, default: bool = False) -> bool:
        """Docker's query booleans: 1/true/True (any other value is false)."""
        v = self.arg(name)
        if v is None or v == "":
            return default
        return v.lower() in ("1", "true", "yes")

    def json(self) -> Any:
        if not self.body.strip():
            return {}
        try:
            return json.loads(self.body)
        except (ValueError, UnicodeDecodeError) as e:
            raise DockerError(400, f"invalid JSON body: {e}") from None


@dataclass
class Reply:
    status: int = 200
    body: bytes = b""
    headers: list[tuple[str, str]] = field(default_factory=list)
    # A body that is known only later (the exit status of `wait`): the status
    # and headers go out at once, as dockerd does; the docker CLI waits for
    # them before it starts the container.
    later: Callable[[], Awaitable[bytes]] | None = None

    @classmethod
    def json(cls, obj: Any, status: int = 200, headers: list[tuple[str, str]] | None = None) -> "Reply":
        return cls(status, json.dumps(obj).encode() + b"\n", [("Content-Type", "application/json"), *(headers or [])])


class Stream:
    """A hijacked connection (or, when the client asked for no upgrade, a
    buffer that becomes the response body)."""

    def __init__(self, reader: asyncio.StreamReader | None, writer: asyncio.StreamWriter | None,
                 leftover: bytes = b"") -> None:
        self._reader = reader
        self._writer = writer
        self._leftover = leftover
        self.buffer = bytearray()

    async def read_all(self, limit: int = MAX_BODY) -> bytes:
        """The client's stdin: everything until it half-closes the connection."""
        data = bytearray(self._leftover)
        self._leftover = b""
        if self._reader is None:
            return bytes(data)
        while len(data) <= limit:
            chunk = await self._reader.read(65536)
            if not chunk:
                return bytes(data)
            data += chunk
        raise DockerError(413, f"stdin over {limit} bytes")

    async def write(self, data: bytes) -> None:
        if self._writer is None:
            self.buffer += data
            return
        self._writer.write(data)
        await self._writer.drain()


@dataclass
class Hijack:
    """Answer 101 and give the connection to `run`. `content_type`: Docker's
    raw-stream (TTY) or multiplexed-stream (framed stdout/stderr)."""

    run: Callable[[Stream], Awaitable[None]]
    content_type: str = "application/vnd.docker.raw-stream"


Handler = Callable[[Request], Awaitable["Reply | Hijack"]]


class Router:
    def __init__(self) -> None:
        self._routes: list[tuple[str, re.Pattern[str], Handler]] = []

    def route(self, method: str, pattern: str) -> Callable[[Handler], Handler]:
        """`pattern` with {name} segments (one path segment each; {name*}: the rest)."""
        rest = re.sub(r"\{(\w+)\*\}", r"(?P<\1>.+)", pattern)
        rx = re.compile("^" + re.sub(r"\{(\w+)\}", r"(?P<\1>[^/]+)", rest) + "$")

        def add(fn: Handler) -> Handler:
            self._routes.append((method, rx, fn))
            return fn
        return add

    def match(self, method: str, path: str) -> tuple[Handler, dict[str, str]]:
        allowed = False
        for m, rx, fn in self._routes:
            hit = rx.match(path)
            if hit:
                if m == method or (m == "GET" and method == "HEAD" and not self._has("HEAD", path)):
                    return fn, hit.groupdict()
                allowed = True
        if allowed:
            raise DockerError(405, f"method {method} not allowed on {path}")
        raise DockerError(404, f"page not found: {method} {path} is not part of crabd's Docker API subset "
                               "(see docs/docker.md)")

    def _has(self, method: str, path: str) -> bool:
        return any(m == method and rx.match(path) for m, rx, _ in self._routes)


def _split(target: str) -> tuple[str, str | None, dict[str, list[str]]]:
    url = urlsplit(target)
    path = url.path or "/"
    version = None
    m = _VERSION.match(path)
    if m:
        version, path = m.group(1), m.group(2)
    return path.rstrip("/") or "/", version, parse_qs(url.query, keep_blank_values=True)


def _error_reply(e: DockerError) -> Reply:
    return Reply.json({"message": e.message}, e.status)


async def serve_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, router: Router,
                           on_error: Callable[[Request, BaseException], DockerError]) -> None:
    """One client connection: requests one after another (keep-alive) until
    the client closes it or a route hijacks it."""
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=64 * 1024)

    async def next_event() -> Any:
        while True:
            ev = conn.next_event()
            if ev is not h11.NEED_DATA:
                return ev
            data = await reader.read(65536)
            conn.receive_data(data)  # b"" = the client closed its side

    async def send(*events: Any) -> None:
        for ev in events:
            data = conn.send(ev)
            if data:
                writer.write(data)
        await writer.drain()

    try:
        while True:
            try:
                ev = await next_event()
                if isinstance(ev, (h11.ConnectionClosed, h11.EndOfMessage)) or ev is h11.PAUSED:
                    return
                assert isinstance(ev, h11.Request)
                body = bytearray()
                while True:
                    part = await next_event()
                    if isinstance(part, h11.Data):
                        body += part.data
                        if len(body) > MAX_BODY:
                            raise DockerError(413, f"request body over {MAX_BODY} bytes")
                    elif isinstance(part, h11.EndOfMessage):
                        break
                    elif isinstance(part, h11.ConnectionClosed):
                        return
            except h11.RemoteProtocolError as e:
                if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                    r = _error_reply(DockerError(400, f"bad HTTP request: {e}"))
                    await send(h11.Response(status_code=400, headers=[*r.headers, ("Content-Length", str(len(r.body))),
                                                                      ("Connection", "close")]),
                               h11.Data(data=r.body), h11.EndOfMessage())
                return
            path, version, query = _split(ev.target.decode("latin-1"))
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in ev.headers}
            req = Request(ev.method.decode("ascii", "replace").upper(), path, query, headers, bytes(body), version)
            try:
                handler, req.params = router.match(req.method, path)
                result: Reply | Hijack = await handler(req)
            except DockerError as e:
                result = _error_reply(e)
            except Exception as e:  # mapped to Docker's shape: crabd's errors keep their status
                result = _error_reply(on_error(req, e))
            if isinstance(result, Hijack):
                await _hijack(conn, reader, writer, send, result)
                return
            hdrs = [*result.headers, ("Api-Version", "1.41"), ("Server", "crabd")]
            if result.later is None:
                hdrs.append(("Content-Length", str(len(result.body))))
            await send(h11.Response(status_code=result.status, headers=hdrs))  # chunked when `later`
            if result.later is not None:
                result.body = await result.later()
            if req.method != "HEAD" and result.status not in (204, 304) and result.body:
                await send(h11.Data(data=result.body))
            await send(h11.EndOfMessage())
            if conn.our_state is h11.MUST_CLOSE:
                return
            conn.start_next_cycle()
    except (ConnectionError, asyncio.IncompleteReadError, h11.LocalProtocolError) as e:
        log.debug("docker API connection: %s", e)
    finally:
        try:
            writer.close()
        except Exception:
            pass


async def _hijack(conn: h11.Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                  send: Callable[..., Awaitable[None]], h: Hijack) -> None:
    if conn.their_state is h11.MIGHT_SWITCH_PROTOCOL:
        # What dockerd answers; the docker CLI refuses anything but 101 here.
        await send(h11.InformationalResponse(status_code=101, reason=b"UPGRADED", headers=[
            ("Content-Type", h.content_type), ("Connection", "Upgrade"), ("Upgrade", "tcp")]))
        leftover, _ = conn.trailing_data
        stream = Stream(reader, writer, bytes(leftover))
        try:
            await h.run(stream)
        except DockerError as e:
            # Too late for a status: the error goes where the output would.
            writer.write(f"crabd: {e.message}\n".encode())
        if writer.can_write_eof():
            writer.write_eof()
        await writer.drain()
        return
    # A client that asked for no upgrade: the same bytes as a plain body.
    stream = Stream(None, None)
    try:
        await h.run(stream)
        status = 200
    except DockerError as e:
        stream.buffer = bytearray(json.dumps({"message": e.message}).encode())
        status = e.status
    await send(h11.Response(status_code=status, headers=[("Content-Type", h.content_type),
                                                         ("Content-Length", str(len(stream.buffer)))]),
               h11.Data(data=bytes(stream.buffer)), h11.EndOfMessage())
