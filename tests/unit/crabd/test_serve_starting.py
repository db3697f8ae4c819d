"""crabd.serve's `_Starting`: the ASGI app in front of the API while the
daemon starts (issue 16: serve within a second of a (re)start). No root, no
daemon: fakes of the daemon and the app."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from crabd.serve import _Starting


class FakeDaemon:
    def health(self) -> dict[str, Any]:
        return {"ok": True, "adopting": 2}


async def app(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"app:" + scope["path"].encode()})


def scope(path: str, method: str = "GET", server: Any = ("/run/crabd.sock", None),
          headers: list[tuple[bytes, bytes]] | None = None) -> dict[str, Any]:
    return {"type": "http", "path": path, "method": method, "server": server, "headers": headers or []}


def request(front: _Starting, sc: dict[str, Any]) -> "asyncio.Task[tuple[int, bytes]]":
    async def go() -> tuple[int, bytes]:
        sent: list[dict[str, Any]] = []

        async def send(msg: dict[str, Any]) -> None:
            sent.append(msg)

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        await front(sc, receive, send)
        return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])
    return asyncio.ensure_future(go())


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_health_answers_once_loaded_and_the_rest_waits_for_the_app() -> None:
    async def go() -> None:
        front = _Starting()
        health, other = request(front, scope("/v1/health")), request(front, scope("/v1/sandboxes"))
        await settle()
        assert not health.done() and not other.done()   # nothing loaded yet: both wait
        front.loaded(FakeDaemon())  # type: ignore[arg-type]
        await settle()
        assert health.done() and health.result() == (200, json.dumps({"ok": True, "adopting": 2}).encode())
        assert not other.done()
        front.built(app)
        await settle()
        assert other.result() == (200, b"app:/v1/sandboxes")
        assert await request(front, scope("/v1/health")) == (200, b"app:/v1/health")  # the API's own from now on
    asyncio.run(go())


def test_health_over_tcp_or_with_a_token_waits_for_the_api() -> None:
    # The API's guard checks tokens: such a probe is not answered before it exists.
    async def go() -> None:
        front = _Starting()
        front.loaded(FakeDaemon())  # type: ignore[arg-type]
        tcp = request(front, scope("/v1/health", server=("127.0.0.1", 7411)))
        token = request(front, scope("/v1/health", headers=[(b"authorization", b"Bearer x")]))
        await settle()
        assert not tcp.done() and not token.done()
        front.built(app)
        assert await tcp == (200, b"app:/v1/health") and await token == (200, b"app:/v1/health")
    asyncio.run(go())


def test_a_failed_start_answers_503() -> None:
    async def go() -> None:
        front = _Starting()
        waiting = request(front, scope("/v1/sandboxes"))
        health = request(front, scope("/v1/health"))
        await settle()
        front.failed("state directory in use")
        status, body = await waiting
        assert status == 503 and "state directory in use" in json.loads(body)["error"]["message"]
        assert (await health)[0] == 503
    asyncio.run(go())
