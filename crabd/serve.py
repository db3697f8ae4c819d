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


async def serve(settings: Settings) -> None:
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
    # A bad tokens file stops the daemon before it touches any state.
    tokens = load_tokens(settings.tokens_file) if settings.tokens_file is not None else None
    sdnotify.status("starting: loading state")
    daemon = Daemon(settings.state_dir, options=opts)
    await daemon.start()
    sock = bind_unix_socket(settings.socket)
    sockets = [sock]
    token = None
    if settings.token_file is not None:
        try:
            token = settings.token_file.read_text().strip()
        except OSError as e:
            raise FailedPrecondition(f"cannot read token_file {settings.token_file}: {e}") from e
        if len(token) < 16:
            raise FailedPrecondition(f"the token in {settings.token_file} is shorter than 16 characters",
                                     fix="put a long random token there: head -c 32 /dev/urandom | base64")
    if settings.tcp_host_port is not None:
        host, port = settings.tcp_host_port
        tcp = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                   reuse_port=False)
        tcp.setblocking(False)
        sockets.append(tcp)
    docker = None
    if settings.docker_socket_path is not None:
        from .dockerapi import serve_docker
        docker, _ = await serve_docker(daemon, settings.docker_socket_path)
    app = make_app(daemon, token=token, tokens=tokens)
    config = uvicorn.Config(app, log_level=settings.log_level, lifespan="off",
                            timeout_keep_alive=30)
    server = uvicorn.Server(config)
    deaths = asyncio.create_task(daemon.watch_deaths(settings.death_poll_s))

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
        if docker is not None:
            docker.close()
            try:
                settings.docker_socket_path.unlink()  # type: ignore[union-attr]
            except FileNotFoundError:
                pass
        await daemon.close()
        try:
            settings.socket.unlink()
        except FileNotFoundError:
            pass
