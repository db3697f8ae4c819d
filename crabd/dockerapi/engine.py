"""The Docker engine: containers as crabd sandboxes, on top of the Daemon's
public methods, and the routes of the Docker API.

This module holds the engine's state (the containers, their main commands,
the exec jobs) and the system routes (`/_ping`, `/version`, `/info`); the
other routes are a module per kind of endpoint, each registered by its
`add_routes(engine)`: images.py, containers.py, execs.py, archive.py
(`docker cp`), checkpoints.py. The pure translation is in shapes.py, the
wire protocol in wire.py.

A container is a crabd sandbox. What Docker has and crabd does not (the
container's main command, its state, logs, labels, env, working dir, user)
is kept here, in `<state>/docker/<sandbox id>.json`, so it survives a
restart of crabd. Sandboxes made through crabd's own API appear as running
containers with no main command.

The main command: a command that only keeps the container alive (`sleep
2h`, `tail -f /dev/null`; see shapes.idle_seconds) is not run, the
sandbox's own init does that. Any other main command runs as the
container's first turn, in the background; its output is the container's
logs and its exit the container's exit. A `docker exec` meanwhile waits for
that turn (crabd runs one turn at a time per sandbox).

Every exec is a crabd turn (`Daemon.exec`): it returns when the command
ends, with all of its output, so attached output arrives at the end, not
as it is written (crabd's exec does not stream). `docker cp` runs tar in the
sandbox, also as a turn: a file copied in is in the next checkpoint.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import platform
import signal
import socket as socketlib
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Coroutine

from .. import __version__
from ..errors import CommandNotFound, CrabdError, NotFound
from ..images import ImageStore
from . import archive, checkpoints, containers, execs, images, shapes
from .containers import Container
from .execs import ExecJob
from .shapes import STDERR, STDOUT
from .wire import DockerError, Reply, Request, Router, serve_connection

__all__ = ["DockerEngine", "serve_docker"]

log = logging.getLogger("crabd.docker")


def _err(e: BaseException) -> DockerError:
    if isinstance(e, DockerError):
        return e
    if isinstance(e, CrabdError):
        status = {404: 404, 409: 409, 422: 400, 408: 408}.get(e.http_status, 500)
        msg = e.message + (f" (fix: {e.fix})" if e.fix else "")
        return DockerError(status, msg)
    log.warning("docker API: %s", e, exc_info=e)
    return DockerError(500, f"{type(e).__name__}: {e}")


class DockerEngine:
    def __init__(self, daemon: Any) -> None:
        self.daemon = daemon
        self.dir = Path(daemon.state_dir) / "docker"
        self.dir.mkdir(mode=0o700, exist_ok=True)
        self.images = ImageStore(daemon.state_dir)
        self.containers: dict[str, Container] = {}
        self.execs: dict[str, ExecJob] = {}
        self.mains: dict[str, asyncio.Task[None]] = {}
        self._changed = asyncio.Event()
        self._detached: set[asyncio.Future[None]] = set()
        self.router = Router()
        self._load()
        self._routes()

    # --- state ----------------------------------------------------------------------
    def _load(self) -> None:
        for p in self.dir.glob("sb-*.json"):
            try:
                c = Container(**json.loads(p.read_text()))
            except (OSError, ValueError, TypeError) as e:
                log.warning("ignoring %s: %s", p, e)
                continue
            if c.status == "running" and c.idle is None:
                # Its main command's turn died with the previous crabd.
                c.status, c.exit_code, c.finished_at = "exited", 137, time.time()
                c.error = "crabd restarted while the main command ran"
            self.containers[c.sid] = c

    def save(self, c: Container) -> None:
        c.persisted = True
        tmp = self.dir / f".{c.sid}.json.tmp"
        d = asdict(c)
        d.pop("persisted")
        if d["idle"] == float("inf"):
            d["idle"] = 1e18  # JSON has no infinity
        tmp.write_text(json.dumps(d))
        os.replace(tmp, self.dir / f"{c.sid}.json")
        self._notify()

    def _forget(self, c: Container) -> None:
        self.containers.pop(c.sid, None)
        (self.dir / f"{c.sid}.json").unlink(missing_ok=True)
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def until(self, pred: Any) -> None:
        while not pred():
            ev = self._changed
            try:
                await asyncio.wait_for(ev.wait(), 1.0)  # also re-checks `sleep N` ends
            except asyncio.TimeoutError:
                pass

    def settle(self, c: Container) -> bool:
        """A `sleep N` main command that has ended: the container exits (and
        goes, with --rm). Always False, so that a wait condition can start
        with it: `self.settle(c) or <condition>`."""
        before = c.status
        c.refresh()
        if before == "running" and c.status == "exited" and c.sid in self.containers:
            self.save(c)
            if c.host.get("AutoRemove"):
                self.detach(self.remove(c))
        return False

    def detach(self, work: Coroutine[Any, Any, None]) -> None:
        """Run `work` in the background, holding a reference so that the
        task is not collected while it runs."""
        task = asyncio.ensure_future(work)
        self._detached.add(task)
        task.add_done_callback(self._detached.discard)

    async def _rows(self) -> list[Any]:
        return await asyncio.to_thread(self.daemon.store.list_sandboxes, None)

    async def all_containers(self) -> list[Container]:
        """Every sandbox as a container (ours, and those made by crabd's own API)."""
        rows = await self._rows()
        out = []
        live = {r.id for r in rows}
        for r in rows:
            c = self.containers.get(r.id)
            if c is None:
                c = Container(sid=r.id, name=r.name, image=r.image, created=getattr(r, "created_at", 0) or 0,
                              config={"Image": r.image}, status="running", idle=float("inf"), persisted=False)
                c.started_at = c.created
                self.containers[r.id] = c
            self.settle(c)
            out.append(c)
        for sid in [s for s in self.containers if s not in live]:
            self.containers.pop(sid, None)  # destroyed through crabd's API
        return out

    async def find(self, ref: str) -> Container:
        ref = ref.lstrip("/")
        cs = await self.all_containers()
        for c in cs:
            if ref in (c.id, c.name, c.sid):
                return c
        hits = [c for c in cs if c.id.startswith(ref)] if ref else []
        if len(hits) == 1:
            return hits[0]
        if len(hits) > 1:
            raise DockerError(400, f"multiple IDs found with provided prefix: {ref}")
        raise DockerError(404, f"No such container: {ref}")

    async def find_running(self, ref: str) -> Container:
        """The container `ref` names, which must be running (Docker's 409 if not)."""
        c = await self.find(ref)
        if c.status != "running":
            raise DockerError(409, f"Container {c.id} is not running")
        return c

    # --- the main command -----------------------------------------------------------
    def env(self, c: Container) -> dict[str, str]:
        return shapes.env_dict(list(c.config.get("Env") or []))

    async def start(self, c: Container) -> None:
        argv = shapes.main_argv(c.config)
        c.idle = shapes.idle_seconds(argv, tty=bool(c.config.get("Tty")), open_stdin=bool(c.config.get("OpenStdin")))
        wd = c.config.get("WorkingDir") or ""
        if wd and wd != "/" and c.started_at is None:
            # Docker makes a missing working directory; so does this first turn.
            await self.exec(c, ["mkdir", "-p", wd], cwd="/")
        c.status, c.exit_code, c.started_at, c.finished_at, c.error = "running", 0, time.time(), None, ""
        if c.idle is None:
            c.logs = []
            self.mains[c.sid] = asyncio.ensure_future(self._run_main(c, argv))
        self.save(c)

    async def _run_main(self, c: Container, argv: list[str]) -> None:
        try:
            res = await self.exec(c, shapes.user_argv(c.config.get("User") or "", argv))
            code, out, err = res["exit_code"], res["stdout"], res["stderr"]
        except CommandNotFound as e:
            code, out, err = 127, "", f"crabd: {e.message}\n"
        except CrabdError as e:
            code, out, err = 126, "", f"crabd: {e.message}\n"
        except asyncio.CancelledError:
            raise
        except Exception as e:  # recorded on the container: nobody awaits this task
            code, out, err = 126, "", f"crabd: {type(e).__name__}: {e}\n"
        self.mains.pop(c.sid, None)
        if c.status == "running":
            c.status, c.exit_code, c.finished_at = "exited", code, time.time()
        c.logs = [x for x in ([STDOUT, out], [STDERR, err]) if x[1]]
        if c.sid in self.containers:
            self.save(c)
            if (c.host.get("AutoRemove")):
                await self.remove(c)

    async def exec(self, c: Container, argv: list[str], *, env: dict[str, str] | None = None,
                    cwd: str | None = None, stdin: bytes | None = None) -> dict[str, Any]:
        # stdin as bytes: crabd's runtime takes bytes as well as text (tar
        # archives of docker cp are binary).
        return await self.daemon.exec(c.sid, argv, timeout=None, env={**self.env(c), **(env or {})},
                                      cwd=cwd or c.config.get("WorkingDir") or None, stdin=stdin)  # type: ignore[arg-type]

    def _signal_all(self, c: Container, sig: int) -> None:
        """Signal every process of the sandbox but its init (which keeps
        the sandbox, and so its checkpoints, alive)."""
        try:
            init = self.daemon.sandbox_info(c.sid).get("pid")
            pids = self.daemon.runtime.pids(c.sid)
        except (CrabdError, OSError):
            return
        for pid in pids:
            if pid != init:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass

    async def stop(self, c: Container, sig: int = signal.SIGKILL, grace: float = 10.0) -> None:
        task = self.mains.get(c.sid)
        await asyncio.to_thread(self._signal_all, c, sig)
        if task is not None and sig != signal.SIGKILL:
            try:
                await asyncio.wait_for(asyncio.shield(task), grace)
            except asyncio.TimeoutError:
                await asyncio.to_thread(self._signal_all, c, signal.SIGKILL)
        if task is not None:
            try:
                await asyncio.shield(task)
            except Exception:
                pass
        if c.status == "running":
            c.status, c.exit_code, c.finished_at = "exited", 128 + int(sig), time.time()
        self.save(c)
        if c.host.get("AutoRemove"):
            await self.remove(c)

    async def remove(self, c: Container) -> None:
        try:
            await self.daemon.destroy(c.sid)
        except NotFound:
            pass
        self._forget(c)

    # --- routes ---------------------------------------------------------------------
    def _routes(self) -> None:
        r = self.router
        d = self.daemon

        ping_headers = [("Api-Version", shapes.API_VERSION), ("Ostype", "linux"), ("Docker-Experimental", "true"),
                        ("Builder-Version", "1"), ("Cache-Control", "no-cache, no-store, must-revalidate"),
                        ("Pragma", "no-cache")]

        @r.route("GET", "/_ping")
        async def ping(req: Request) -> Reply:
            return Reply(200, b"OK", [("Content-Type", "text/plain; charset=utf-8"), *ping_headers])

        @r.route("HEAD", "/_ping")
        async def ping_head(req: Request) -> Reply:
            return Reply(200, b"", [("Content-Type", "text/plain; charset=utf-8"), *ping_headers])

        @r.route("GET", "/version")
        async def version(req: Request) -> Reply:
            v = f"crabd-{__version__}"
            return Reply.json({"Platform": {"Name": "crabd"}, "Version": v, "ApiVersion": shapes.API_VERSION,
                               "MinAPIVersion": shapes.MIN_API_VERSION, "GitCommit": "", "GoVersion": "",
                               "Os": "linux", "Arch": "amd64", "KernelVersion": platform.release(),
                               "Experimental": True, "BuildTime": "",
                               "Components": [{"Name": "crabd", "Version": __version__,
                                               "Details": {"ApiVersion": shapes.API_VERSION}}]})

        @r.route("GET", "/info")
        async def info(req: Request) -> Reply:
            cs = await self.all_containers()
            running = sum(c.status == "running" for c in cs)
            return Reply.json({
                "ID": "crabd", "Containers": len(cs), "ContainersRunning": running, "ContainersPaused": 0,
                "ContainersStopped": len(cs) - running, "Images": len(self.images.list()),
                "Driver": getattr(getattr(d, "fs", None), "driver", "crabd"), "DockerRootDir": str(d.state_dir),
                "OperatingSystem": "crabd (recoverable agent sandboxes)", "OSType": "linux",
                "Architecture": platform.machine(), "KernelVersion": platform.release(), "NCPU": os.cpu_count(),
                "MemTotal": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "Name": socketlib.gethostname(),
                "ServerVersion": f"crabd-{__version__}", "ExperimentalBuild": True, "CgroupDriver": "cgroupfs",
                "CgroupVersion": "1", "Runtimes": {"runc": {"path": "runc"}}, "DefaultRuntime": "runc",
                "SecurityOptions": [], "Labels": [], "Warnings": None})

        for group in (images, containers, execs, archive, checkpoints):
            group.add_routes(self)

    # --- helpers of the routes ------------------------------------------------------
    @staticmethod
    def stream_type(tty: bool) -> str:
        return "application/vnd.docker.raw-stream" if tty else "application/vnd.docker.multiplexed-stream"

    @staticmethod
    def frames(c: Container | None, parts: list[tuple[int, str]], tty: bool | None = None) -> bytes:
        raw = tty if tty is not None else bool(c and c.config.get("Tty"))
        return b"".join(text.encode() if raw else shapes.frame(s, text.encode()) for s, text in parts)


async def serve_docker(daemon: Any, path: Path) -> tuple[asyncio.AbstractServer, DockerEngine]:
    """Serve the Docker API on unix socket `path` (same owner and mode rules
    as crabd's socket: crabd.serve.bind_unix_socket)."""
    from ..serve import bind_unix_socket
    engine = DockerEngine(daemon)
    sock = bind_unix_socket(path)

    async def client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await serve_connection(reader, writer, engine.router, lambda req, e: _err(e))

    server = await asyncio.start_unix_server(client, sock=sock, limit=1 << 20)
    return server, engine
