"""`crabd serve`: the daemon process.

Creates its API socket itself (uvicorn's own --uds would leave it world
writable): mode 0660 with group `crabd` when that group exists, else 0600,
in a 0750 directory. A stale socket left by a killed daemon is replaced; a
live one (another daemon answers) is an error. READY=1 goes to systemd once
the socket accepts connections.
"""

from __future__ import annotations

import asyncio
import errno
import grp
import logging
import os
import socket
from pathlib import Path

import uvicorn

from . import sdnotify
from .api import make_app
from .daemon import Daemon, DaemonOptions
from .errors import FailedPrecondition
from .settings import Settings

__all__ = ["serve", "bind_unix_socket"]

log = logging.getLogger("crabd")


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


async def serve(settings: Settings) -> None:
    opts = DaemonOptions(auto_rollback=settings.auto_rollback, snapshot_driver=settings.snapshot.driver,
                         scheduler=settings.scheduler.policy(), keep_last=settings.retention.keep_last,
                         keep_every=settings.retention.keep_every, capture=settings.capture)
    sdnotify.status("starting: loading state")
    daemon = Daemon(settings.state_dir, options=opts)
    await daemon.start()
    sock = bind_unix_socket(settings.socket)
    sockets = [sock]
    token = None
    if settings.tcp_host_port is not None:
        assert settings.token_file is not None  # Settings enforces it
        try:
            token = settings.token_file.read_text().strip()
        except OSError as e:
            raise FailedPrecondition(f"cannot read token_file {settings.token_file}: {e}") from e
        if len(token) < 16:
            raise FailedPrecondition(f"the token in {settings.token_file} is shorter than 16 characters",
                                     fix="put a long random token there: head -c 32 /dev/urandom | base64")
        host, port = settings.tcp_host_port
        tcp = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                   reuse_port=False)
        tcp.setblocking(False)
        sockets.append(tcp)
    app = make_app(daemon, token=token)
    config = uvicorn.Config(app, log_level=os.environ.get("CRABD_LOG_LEVEL", "warning"), lifespan="off",
                            timeout_keep_alive=30)
    server = uvicorn.Server(config)
    deaths = asyncio.create_task(daemon.watch_deaths())

    async def announce() -> None:
        while not server.started:
            await asyncio.sleep(0.01)
        sdnotify.ready(f"serving {settings.socket}; {len(daemon.turns)} sandboxes")
        log.warning("crabd serving on %s (state %s)", settings.socket, settings.state_dir)
        interval = sdnotify.watchdog_interval() if settings.watchdog else None
        if interval:
            await sdnotify.Notifier.from_env().keep_alive(interval)

    ann = asyncio.create_task(announce())
    try:
        await server.serve(sockets=sockets)
    finally:
        sdnotify.stopping("shutting down")
        for t in (deaths, ann):
            t.cancel()
        await daemon.close()
        try:
            settings.socket.unlink()
        except FileNotFoundError:
            pass
