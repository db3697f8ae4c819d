"""`crabd serve`: the daemon process.

Creates its API socket itself (uvicorn's own --uds would leave it world
writable): mode 0660 with group `crabd` when that group exists, else 0600,
in a 0750 directory. A stale socket left by a killed daemon is replaced; a
live one (another daemon answers) is an error. READY=1 goes to systemd once
the whole API answers.

Start order (issue 16: serve within a second of a (re)start): the socket is
bound and answering before the slow parts. A request that arrives while the
daemon starts waits for it (`_Starting`), except a local health probe, which
the daemon answers as soon as its state is loaded and settled; the FastAPI
app (its import and routes are most of a start's CPU) is built in a worker
thread meanwhile, the sandboxes are re-adopted in the background (each
one's turns and rollbacks wait for its own adoption: `Startup.start`), and
the BPF program compiles after that (ebpf/_loading.py). Nothing here imports
FastAPI, pydantic's API models, the Docker API or the registry code before
the socket answers (tests/unit/test_lazy_imports.py).
"""

from __future__ import annotations

import asyncio
import errno
import grp
import json
import logging
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import sdnotify
from .errors import FailedPrecondition

if TYPE_CHECKING:
    from .daemon import Daemon
    from .settings import Settings

__all__ = ["serve", "bind_unix_socket", "load_tokens"]

log = logging.getLogger("crabd")


def load_tokens(path: Path) -> dict[str, str]:
    """The tokens file: `owner:token` lines (blank lines and `#` comments
    ignored) -> {token: owner}. Refused when group/world accessible, when a
    token is shorter than 16 characters or used twice, or an owner name is
    not [a-z0-9][a-z0-9._-]{0,62}."""
    import re
    try:
        st = os.stat(path)
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise FailedPrecondition(f"cannot read tokens_file {path}: {e}") from e
    if st.st_mode & 0o077:
        raise FailedPrecondition(f"tokens_file {path} is accessible by group or others (mode {st.st_mode & 0o777:o})",
                                 fix=f"chmod 600 {path}")
    out: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        owner, sep, tok = line.partition(":")
        owner, tok = owner.strip(), tok.strip()
        where = f"tokens_file {path} line {n}"
        if not sep or not re.fullmatch(r"[a-z0-9][a-z0-9._-]{0,62}", owner):
            raise FailedPrecondition(f"{where}: not `owner:token` with a lowercase owner name",
                                     fix="one `owner:token` per line, e.g. alice:$(head -c 32 /dev/urandom | base64)")
        if len(tok) < 16 or any(c.isspace() for c in tok):
            raise FailedPrecondition(f"{where}: the token of {owner} is shorter than 16 characters or has spaces",
                                     fix="use a long random token: head -c 32 /dev/urandom | base64")
        if tok in out:
            raise FailedPrecondition(f"{where}: the token of {owner} is also {out[tok]}'s",
                                     fix="give every owner its own token")
        out[tok] = owner
    return out


def bind_unix_socket(path: Path) -> socket.socket:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o750)
    if path.exists() or path.is_symlink():
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError as e:
            if e.errno not in (errno.ECONNREFUSED, errno.ENOENT, errno.ENOTSOCK):
                raise
            path.unlink()  # stale: its daemon is gone
        else:
            raise FailedPrecondition(f"another crabd already serves {path}",
                                     fix="stop it, or give this one another --socket and --state-dir")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # never world-accessible, not even for an instant
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    try:
        gid = grp.getgrnam("crabd").gr_gid
        os.chown(path, 0, gid)
        os.chmod(path, 0o660)
    except KeyError:
        os.chmod(path, 0o600)
    sock.listen(128)
    sock.setblocking(False)
    return sock


class _Starting:
    """The ASGI app while the daemon starts, in front of the API for good.

    Until the API is built every request waits for it, except `GET
    /v1/health` on the unix socket without a token (no owner, no token to
    check: crabd.api's _Guard would let it through unchanged), which gets the
    daemon's own health as soon as its state is loaded and settled
    (`adopting` counts the sandboxes still being re-adopted). If the start
    fails, waiting requests get a 503 and the daemon exits with the error."""

    def __init__(self) -> None:
        self.daemon: Daemon | None = None
        self.app: Any = None
        self.error: str | None = None
        self._loaded = asyncio.Event()
        self._built = asyncio.Event()

    def loaded(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self._loaded.set()

    def built(self, app: Any) -> None:
        self.app = app
        self._loaded.set()
        self._built.set()

    def failed(self, error: str) -> None:
        self.error = error
        self._loaded.set()
        self._built.set()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if self.app is not None:
            return await self.app(scope, receive, send)
        if _local_health_probe(scope):
            await self._loaded.wait()
            if self.daemon is not None and self.app is None:
                return await _send_json(send, 200, self.daemon.health())
        await self._built.wait()
        if self.app is None:
            if scope["type"] != "http":
                return
            return await _send_json(send, 503, {"error": {
                "code": "unavailable", "message": f"crabd failed to start: {self.error}",
                "fix": "see the daemon's log; it exits"}})
        return await self.app(scope, receive, send)


def _local_health_probe(scope: Any) -> bool:
    if scope["type"] != "http" or scope.get("method") != "GET" or scope.get("path") != "/v1/health":
        return False
    server = scope.get("server")
    over_tcp = isinstance(server, (tuple, list)) and len(server) == 2 and isinstance(server[1], int)
    return not over_tcp and not any(k.lower() == b"authorization" for k, _ in scope.get("headers", []))


async def _send_json(send: Any, status: int, data: Any) -> None:
    body = json.dumps(data).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _build_app(daemon: Daemon, token: str | None, tokens: dict[str, str] | None) -> Any:
    """The FastAPI app (worker thread: importing FastAPI and building the
    routes' models is most of a start's CPU)."""
    from .api import make_app
    return make_app(daemon, token=token, tokens=tokens)


def _read_token(settings: Settings) -> str | None:
    if settings.token_file is None:
        return None
    try:
        token = settings.token_file.read_text().strip()
    except OSError as e:
        raise FailedPrecondition(f"cannot read token_file {settings.token_file}: {e}") from e
    if len(token) < 16:
        raise FailedPrecondition(f"the token in {settings.token_file} is shorter than 16 characters",
                                 fix="put a long random token there: head -c 32 /dev/urandom | base64")
    return token


async def serve(settings: Settings) -> None:
    # A bad tokens file stops the daemon before it touches any state.
    tokens = load_tokens(settings.tokens_file) if settings.tokens_file is not None else None
    token = _read_token(settings)
    sdnotify.status("starting: loading state")
    sock = bind_unix_socket(settings.socket)
    sockets = [sock]
    try:
        if settings.tcp_host_port is not None:
            host, port = settings.tcp_host_port
            tcp = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                       reuse_port=False)
            tcp.setblocking(False)
            sockets.append(tcp)
    except BaseException:
        sock.close()
        _unlink(settings.socket)
        raise
    import uvicorn
    front = _Starting()
    config = uvicorn.Config(front, log_level=settings.log_level, lifespan="off", timeout_keep_alive=30)
    server = uvicorn.Server(config)
    daemon: Daemon | None = None
    docker = None
    tasks: list[asyncio.Task[Any]] = []
    stopping = False

    async def boot() -> None:
        nonlocal daemon, docker
        from .daemon import Daemon, DaemonOptions
        opts = DaemonOptions(auto_rollback=settings.auto_rollback, snapshot_driver=settings.snapshot.driver,
                             pool_size=int(settings.snapshot.pool_size_gib * 2**30),
                             scheduler=settings.scheduler.policy(), keep_last=settings.retention.keep_last,
                             keep_every=settings.retention.keep_every, capture=settings.capture,
                             oracle_dir=os.environ.get("CRABD_ORACLE") or None)   # a bench hook, not a setting
        # inspector = "proc" ($CRABD_INSPECTOR): the /proc inspector instead of
        # compiling the BPF one (seconds of clang at start); API-layer tests use it.
        opts.use_bpf = settings.inspector != "proc"
        # Serve at once; the BPF program compiles in the background (seconds) and
        # turns that end before it is ready are saved whole (ebpf/_loading.py).
        opts.inspector_async = True
        daemon = Daemon(settings.state_dir, options=opts)
        app = asyncio.ensure_future(asyncio.to_thread(_build_app, daemon, token, tokens))
        try:
            await daemon.start(adopt_in_background=True)
        except BaseException:
            await asyncio.gather(app, return_exceptions=True)
            raise
        front.loaded(daemon)
        tasks.append(asyncio.create_task(daemon.watch_deaths(settings.death_poll_s)))
        if settings.docker_socket_path is not None:
            from .dockerapi import serve_docker
            docker, _ = await serve_docker(daemon, settings.docker_socket_path)
        front.built(await app)
        if stopping:
            return  # the server stopped while this start ran: nothing to announce
        while not server.started:
            await asyncio.sleep(0.01)
        sdnotify.ready(f"serving {settings.socket}; {len(daemon.turns)} sandboxes")
        log.warning("crabd serving on %s (state %s)", settings.socket, settings.state_dir)
        interval = sdnotify.watchdog_interval() if settings.watchdog else None
        if interval:
            await sdnotify.Notifier.from_env().keep_alive(interval)

    async def booting() -> None:
        try:
            await boot()
        except BaseException as e:
            front.failed(str(e))
            await asyncio.sleep(0.2)  # requests already read get their 503 before the server closes
            server.should_exit = True
            raise

    start = asyncio.create_task(booting())
    try:
        await server.serve(sockets=sockets)
    finally:
        stopping = True
        sdnotify.stopping("shutting down")
        if not start.done() and front.app is not None:
            start.cancel()  # the watchdog's keep-alive
        # A start under way runs to its end (its threads would outlive a
        # cancel), then everything it made is closed.
        await asyncio.gather(start, return_exceptions=True)
        for t in tasks:
            t.cancel()
        if docker is not None:
            docker.close()
            _unlink(settings.docker_socket_path)  # type: ignore[arg-type]
        if daemon is not None:
            await daemon.close()
        _unlink(settings.socket)
    if start.done() and not start.cancelled() and start.exception() is not None:
        raise start.exception()  # type: ignore[misc]


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
