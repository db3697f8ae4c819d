"""The Docker API's HTTP server (crabd.dockerapi.wire) without root: a
hijacked exec-style exchange (101, stdin until the client half-closes,
output, close), keep-alive, and a reply whose body comes later (wait)."""

from __future__ import annotations

import asyncio
import socket

from crabd.dockerapi.shapes import frame
from crabd.dockerapi.wire import DockerError, Hijack, Reply, Request, Router, Stream, serve_connection


def _router() -> Router:
    r = Router()

    @r.route("POST", "/exec/{eid}/start")
    async def start(req: Request) -> Hijack:
        async def run(s: Stream) -> None:
            data = await s.read_all()
            await s.write(frame(1, data.upper()) + frame(2, req.params["eid"].encode()))
        return Hijack(run, "application/vnd.docker.multiplexed-stream")

    @r.route("GET", "/_ping")
    async def ping(req: Request) -> Reply:
        return Reply(200, b"OK")

    @r.route("POST", "/containers/{ref}/wait")
    async def wait(req: Request) -> Reply:
        async def body() -> bytes:
            await asyncio.sleep(0.05)
            return b'{"StatusCode": 3}'
        return Reply(200, later=body)

    @r.route("GET", "/containers/{ref}/json")
    async def missing(req: Request) -> Reply:
        raise DockerError(404, f"No such container: {req.params['ref']}")
    return r


def _exchange(tmp_path, payload: bytes, half_close: bool = True) -> bytes:
    path = str(tmp_path / "d.sock")

    async def main() -> bytes:
        server = await asyncio.start_unix_server(
            lambda r, w: serve_connection(r, w, _router(), lambda req, e: DockerError(500, str(e))), path)

        def client() -> bytes:
            s = socket.socket(socket.AF_UNIX)
            s.connect(path)
            s.sendall(payload)
            if half_close:
                s.shutdown(socket.SHUT_WR)
            out = b""
            s.settimeout(10)
            while chunk := s.recv(65536):
                out += chunk
            s.close()
            return out
        try:
            return await asyncio.to_thread(client)
        finally:
            server.close()
    return asyncio.run(main())


def test_hijacked_exec_reads_stdin_to_the_end_and_frames_output(tmp_path):
    req = (b"POST /v1.41/exec/e1/start HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: tcp\r\n"
           b"Content-Type: application/json\r\nContent-Length: 30\r\n\r\n" + b'{"Detach":false,"Tty":false}  ' +
           b"stdin bytes after the request")
    out = _exchange(tmp_path, req)
    head, _, body = out.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 101 UPGRADED") and b"upgrade: tcp" in head.lower()
    assert body == frame(1, b"STDIN BYTES AFTER THE REQUEST") + frame(2, b"e1")


def test_keep_alive_version_prefix_errors_and_a_later_body(tmp_path):
    req = (b"GET /_ping HTTP/1.1\r\nHost: x\r\n\r\n"
           b"GET /v1.24/containers/nope/json HTTP/1.1\r\nHost: x\r\n\r\n"
           b"POST /containers/c/wait HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"
           b"GET /nowhere HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    out = _exchange(tmp_path, req, half_close=False)
    assert out.count(b"HTTP/1.1 200") == 2 and b"\r\n\r\nOK" in out
    assert b'HTTP/1.1 404' in out and b'{"message": "No such container: nope"}' in out
    assert b"transfer-encoding: chunked" in out.lower() and b'{"StatusCode": 3}' in out
    assert b"not part of crabd's Docker API subset" in out
