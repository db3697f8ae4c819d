"""`crabd ui`: a local TCP port in front of the daemon's unix socket, for a browser.

Place in the design: the unix socket is root-only by its mode, and a browser
cannot open a unix socket. A plain byte forwarder would hand that root-only
access to every local user who can reach the port, so this one is a small
HTTP proxy with a key of its own: a random secret made at start, given to the
operator in the printed URL's fragment. A request carries it as the page's
bearer token (or, for the page's own files, the `crabd_token` cookie that
/ui/login sets, exactly as with the daemon's TCP listener); the proxy checks
it, strips it, and forwards the request over the socket with `Connection:
close` (one request per upstream connection, so every request is checked)
and, when asked, an owner's token of the daemon so that the page acts for
that owner. Responses, the event stream included, are piped back as they
come.

`rewrite_head` is the whole policy, pure and tested without a daemon.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import secrets
from dataclasses import dataclass
from urllib.parse import unquote

from . import COOKIE, LOGIN_PATH, PUBLIC

__all__ = ["Forwarder", "rewrite_head", "Refusal", "MAX_HEAD"]

MAX_HEAD = 64 * 1024
# Hop-by-hop headers and the browser's credentials: never sent upstream.
_DROP = {"authorization", "cookie", "connection", "keep-alive", "proxy-authorization", "proxy-connection", "te",
         "upgrade", "transfer-encoding"}


@dataclass(frozen=True)
class Refusal:
    """The proxy's own answer to a request it does not forward."""
    status: int
    code: str
    message: str
    location: str | None = None

    def response(self) -> bytes:
        body = json.dumps({"error": {"code": self.code, "message": self.message,
                                     "fix": "open the URL `crabd ui` printed (its #token=... part is the key)"}}).encode()
        reason = {303: "See Other", 400: "Bad Request", 401: "Unauthorized", 411: "Length Required"}.get(self.status, "")
        lines = [f"HTTP/1.1 {self.status} {reason}", "Content-Type: application/json",
                 f"Content-Length: {len(body)}", "Connection: close"]
        if self.location:
            lines.append(f"Location: {self.location}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def _cookie(value: str) -> str | None:
    for part in value.split(";"):
        k, _, v = part.strip().partition("=")
        if k == COOKIE and v:
            return unquote(v)
    return None


def rewrite_head(head: bytes, secret: str, bearer: str | None = None) -> tuple[bytes, int] | Refusal:
    """The request head to send upstream and its body's length, or the
    refusal to answer instead. `head` is the request line and headers
    (through the blank line); `secret` the proxy's key; `bearer` the
    daemon token to act with (None: the socket's own, no owner)."""
    try:
        text = head.decode("latin-1")
        request_line, *lines = text.split("\r\n")
        method, target, version = request_line.split(" ")
    except ValueError:
        return Refusal(400, "invalid_argument", "malformed request line")
    if not version.startswith("HTTP/1."):
        return Refusal(400, "invalid_argument", "only HTTP/1.x")
    headers: list[tuple[str, str]] = []
    for line in lines:
        if not line:
            continue
        k, sep, v = line.partition(":")
        if not sep or not k or k != k.strip():
            return Refusal(400, "invalid_argument", "malformed header line")
        headers.append((k, v.strip()))
    named = {k.lower(): v for k, v in headers}
    if "transfer-encoding" in named:
        return Refusal(411, "invalid_argument", "send the body with a Content-Length")
    length = named.get("content-length", "0")
    if not length.isdigit():
        return Refusal(400, "invalid_argument", "bad Content-Length")
    path = target.split("?", 1)[0]
    got = None
    auth = named.get("authorization", "")
    if auth.startswith("Bearer "):
        got = auth[7:].strip()
    elif method in ("GET", "HEAD") and path.startswith("/ui"):
        got = _cookie(named.get("cookie", ""))
    ok = got is not None and hmac.compare_digest(got.encode(), secret.encode())
    if not ok and not (method == "GET" and path in PUBLIC):
        if method == "GET" and path.startswith("/ui"):
            return Refusal(303, "unauthenticated", "sign in first", location=LOGIN_PATH)
        return Refusal(401, "unauthenticated", "missing or wrong key of this `crabd ui`")
    out = [f"{method} {target} {version}"]
    out += [f"{k}: {v}" for k, v in headers if k.lower() not in _DROP]
    if bearer is not None:
        out.append(f"Authorization: Bearer {bearer}")
    out.append("Connection: close")
    return ("\r\n".join(out) + "\r\n\r\n").encode("latin-1"), int(length)


class Forwarder:
    """The proxy: `await start()`, then `url`; `close()` to stop."""

    def __init__(self, socket_path: str, host: str = "127.0.0.1", port: int = 0, bearer: str | None = None,
                 secret: str | None = None) -> None:
        self.socket_path = socket_path
        self.host, self.port = host, port
        self.bearer = bearer
        self.secret = secret or secrets.token_urlsafe(24)
        self._server: asyncio.AbstractServer | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}{LOGIN_PATH}#token={self.secret}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError):
                return
            if len(head) > MAX_HEAD:
                return
            got = rewrite_head(head, self.secret, self.bearer)
            if isinstance(got, Refusal):
                writer.write(got.response())
                await writer.drain()
                return
            upstream_head, length = got
            body = await reader.readexactly(length) if length else b""
            try:
                up_r, up_w = await asyncio.open_unix_connection(self.socket_path)
            except OSError as e:
                writer.write(Refusal(502, "unavailable", f"crabd's socket {self.socket_path}: {e}").response())
                await writer.drain()
                return
            try:
                up_w.write(upstream_head + body)
                await up_w.drain()
                # Pipe the answer back (an event stream never ends) until
                # either side closes.
                pipe = asyncio.ensure_future(self._pipe(up_r, writer))
                gone = asyncio.ensure_future(reader.read(1))
                await asyncio.wait({pipe, gone}, return_when=asyncio.FIRST_COMPLETED)
                for t in (pipe, gone):
                    t.cancel()
            finally:
                up_w.close()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    @staticmethod
    async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        while True:
            chunk = await src.read(65536)
            if not chunk:
                return
            dst.write(chunk)
            await dst.drain()
