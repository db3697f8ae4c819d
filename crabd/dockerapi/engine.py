"""The Docker API routes, on top of the Daemon's public methods.

Size: one route per Docker endpoint (~40), kept in one table so that the
subset crabd serves reads in one place; the pure translation is in shapes.py
and the wire protocol in wire.py.

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
import base64
import json
import logging
import os
import platform
import secrets
import signal
import socket as socketlib
import tarfile
import io
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .. import __version__
from ..errors import AlreadyExists, CommandNotFound, CrabdError, FailedPrecondition, InvalidArgument, NotFound
from ..images import ImageStore, validate_name
from . import shapes
from .shapes import STDERR, STDOUT
from .wire import DockerError, Hijack, Reply, Request, Router, Stream, serve_connection

__all__ = ["DockerEngine", "serve_docker"]

log = logging.getLogger("crabd.docker")

# docker cp out of a container: tar | base64 in the sandbox, as crabd's exec
# returns text and keeps at most 1 MiB of each stream.
_ARCHIVE_OUT_MAX = (1 << 20) * 3 // 4 - 4096
_MISSING = 44  # exit status of the archive helpers: no such path


@dataclass
class Container:
    """Docker's view of one sandbox (persisted as JSON)."""

    sid: str
    name: str
    image: str
    created: float
    config: dict[str, Any] = field(default_factory=dict)
    host: dict[str, Any] = field(default_factory=dict)
    status: str = "created"          # created | running | exited
    exit_code: int = 0
    started_at: float | None = None
    finished_at: float | None = None
    idle: float | None = None        # seconds the main command only waits (inf: forever); None: it runs
    logs: list[list[Any]] = field(default_factory=list)  # [[stream, text], ...] of the main command
    checkpoints: dict[str, str] = field(default_factory=dict)  # Docker checkpoint name -> crabd checkpoint id
    error: str = ""
    persisted: bool = True

    @property
    def id(self) -> str:
        return shapes.docker_id(self.sid)

    def refresh(self, now: float | None = None) -> None:
        """A `sleep N` main command ends N seconds after the start."""
        if self.status == "running" and self.idle is not None and self.idle != float("inf") and self.started_at:
            end = self.started_at + self.idle
            if (now or time.time()) >= end:
                self.status, self.exit_code, self.finished_at = "exited", 0, end


@dataclass
class ExecJob:
    id: str
    container: Container
    argv: list[str]
    env: dict[str, str]
    workdir: str | None
    user: str
    tty: bool
    stdin: bool
    running: bool = False
    exit_code: int | None = None
    pid: int = 0


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

    def _save(self, c: Container) -> None:
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

    async def _until(self, pred: Any) -> None:
        while not pred():
            ev = self._changed
            try:
                await asyncio.wait_for(ev.wait(), 1.0)  # also re-checks `sleep N` ends
            except asyncio.TimeoutError:
                pass

    def _settle(self, c: Container) -> bool:
        """A `sleep N` main command that has ended: the container exits (and
        goes, with --rm). Always False, so that a wait condition can start
        with it: `self._settle(c) or <condition>`."""
        before = c.status
        c.refresh()
        if before == "running" and c.status == "exited" and c.sid in self.containers:
            self._save(c)
            if c.host.get("AutoRemove"):
                task = asyncio.ensure_future(self._remove(c))
                self._detached.add(task)
                task.add_done_callback(self._detached.discard)
        return False

    async def _rows(self) -> list[Any]:
        return await asyncio.to_thread(self.daemon.store.list_sandboxes, None)

    async def _all(self) -> list[Container]:
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
            self._settle(c)
            out.append(c)
        for sid in [s for s in self.containers if s not in live]:
            self.containers.pop(sid, None)  # destroyed through crabd's API
        return out

    async def _find(self, ref: str) -> Container:
        ref = ref.lstrip("/")
        cs = await self._all()
        for c in cs:
            if ref in (c.id, c.name, c.sid):
                return c
        hits = [c for c in cs if c.id.startswith(ref)] if ref else []
        if len(hits) == 1:
            return hits[0]
        if len(hits) > 1:
            raise DockerError(400, f"multiple IDs found with provided prefix: {ref}")
        raise DockerError(404, f"No such container: {ref}")

    # --- the main command -----------------------------------------------------------
    @staticmethod
    def _env_dict(pairs: list[str]) -> dict[str, str]:
        """Docker's ["K=V", ...] (a bare "K" takes nothing: crabd has no host env to copy)."""
        env: dict[str, str] = {}
        for e in pairs:
            k, eq, v = e.partition("=")
            if k and eq:
                env[k] = v
        return env

    def _env(self, c: Container) -> dict[str, str]:
        return self._env_dict(list(c.config.get("Env") or []))

    async def _start(self, c: Container) -> None:
        argv = shapes.main_argv(c.config)
        c.idle = shapes.idle_seconds(argv, tty=bool(c.config.get("Tty")), open_stdin=bool(c.config.get("OpenStdin")))
        wd = c.config.get("WorkingDir") or ""
        if wd and wd != "/" and c.started_at is None:
            # Docker makes a missing working directory; so does this first turn.
            await self._exec(c, ["mkdir", "-p", wd], cwd="/")
        c.status, c.exit_code, c.started_at, c.finished_at, c.error = "running", 0, time.time(), None, ""
        if c.idle is None:
            c.logs = []
            self.mains[c.sid] = asyncio.ensure_future(self._run_main(c, argv))
        self._save(c)

    async def _run_main(self, c: Container, argv: list[str]) -> None:
        try:
            res = await self._exec(c, shapes.user_argv(c.config.get("User") or "", argv))
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
            self._save(c)
            if (c.host.get("AutoRemove")):
                await self._remove(c)

    async def _exec(self, c: Container, argv: list[str], *, env: dict[str, str] | None = None,
                    cwd: str | None = None, stdin: bytes | None = None) -> dict[str, Any]:
        # stdin as bytes: crabd's runtime takes bytes as well as text (tar
        # archives of docker cp are binary).
        return await self.daemon.exec(c.sid, argv, timeout=None, env={**self._env(c), **(env or {})},
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

    async def _stop(self, c: Container, sig: int = signal.SIGKILL, grace: float = 10.0) -> None:
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
        self._save(c)
        if c.host.get("AutoRemove"):
            await self._remove(c)

    async def _remove(self, c: Container) -> None:
        try:
            await self.daemon.destroy(c.sid)
        except NotFound:
            pass
        self._forget(c)

    async def _fork_for(self, cid: str, image: str, name: str | None, host: dict[str, Any]) -> Any:
        """A container created with the crabd.fork-from label: a crabd fork of
        that checkpoint (files and processes), so that a harness which only
        knows `docker run` (mini-swe-agent's environment, configured with
        run_args) starts its best-of-N branches on the checkpoint's state."""
        d = self.daemon
        try:
            ck = await asyncio.to_thread(d.store.get_checkpoint, cid)
            src = await asyncio.to_thread(d.store.get_sandbox, ck.sandbox_id)
        except NotFound:
            raise DockerError(404, f"No such crabd checkpoint: {cid} (label {shapes.FORK_LABEL}; list them with "
                                   "crabd checkpoint ls SANDBOX)") from None
        if src.image != image:
            raise DockerError(400, f"checkpoint {cid} is of a sandbox of image {src.image!r}, not {image!r}: "
                                   f"run the fork with image {src.image}")
        if any(host.get(k) for k in ("Memory", "NanoCpus", "CpuQuota", "PidsLimit")):
            raise DockerError(400, f"a fork ({shapes.FORK_LABEL}) keeps the limits of its checkpoint's sandbox: "
                                   "drop --memory, --cpus and --pids-limit")
        made = await d.fork(cid, 1, name=name)
        return await asyncio.to_thread(d.store.get_sandbox, made["sandboxes"][0])

    # --- JSON shapes ----------------------------------------------------------------
    def _inspect(self, c: Container, info: dict[str, Any] | None) -> dict[str, Any]:
        argv = shapes.main_argv(c.config)
        cfg = {"Hostname": c.config.get("Hostname") or c.sid, "Domainname": "", "User": c.config.get("User") or "",
               "AttachStdin": False, "AttachStdout": False, "AttachStderr": False,
               "Tty": bool(c.config.get("Tty")), "OpenStdin": bool(c.config.get("OpenStdin")), "StdinOnce": False,
               "Env": list(c.config.get("Env") or []), "Cmd": c.config.get("Cmd"),
               "Image": c.config.get("Image") or c.image, "Volumes": None,
               "WorkingDir": c.config.get("WorkingDir") or "", "Entrypoint": c.config.get("Entrypoint"),
               "Labels": dict(c.config.get("Labels") or {}), "ExposedPorts": None}
        running = c.status == "running"
        return {
            "Id": c.id, "Created": shapes.rfc3339(c.created), "Path": argv[0] if argv else "",
            "Args": argv[1:], "Name": "/" + c.name, "Image": shapes.image_id(c.image), "RestartCount": 0,
            "Driver": "crabd", "Platform": "linux", "MountLabel": "", "ProcessLabel": "", "AppArmorProfile": "",
            "ExecIDs": [e.id for e in self.execs.values() if e.container is c and e.running] or None,
            "State": {"Status": c.status, "Running": running, "Paused": False, "Restarting": False,
                      "OOMKilled": False, "Dead": False, "Pid": (info or {}).get("pid") or 0 if running else 0,
                      "ExitCode": c.exit_code, "Error": c.error, "StartedAt": shapes.rfc3339(c.started_at),
                      "FinishedAt": shapes.rfc3339(c.finished_at)},
            "HostConfig": {"NetworkMode": "none", "AutoRemove": bool(c.host.get("AutoRemove")),
                           "Memory": c.host.get("Memory") or 0, "NanoCpus": c.host.get("NanoCpus") or 0,
                           "PidsLimit": c.host.get("PidsLimit"), "RestartPolicy": {"Name": "no", "MaximumRetryCount": 0},
                           "PortBindings": {}, "Binds": None, "Privileged": False},
            "Config": cfg, "Mounts": [],
            "NetworkSettings": {"Networks": {}, "Ports": {}, "IPAddress": "", "Gateway": "", "MacAddress": ""},
            "Crabd": {"sandbox": c.sid, **({k: info.get(k) for k in ("turn", "branch", "head", "status")} if info else {})},
        }

    def _summary(self, c: Container) -> dict[str, Any]:
        argv = shapes.main_argv(c.config)
        return {"Id": c.id, "Names": ["/" + c.name], "Image": c.config.get("Image") or c.image,
                "ImageID": shapes.image_id(c.image), "Command": " ".join(argv), "Created": int(c.created),
                "Ports": [], "Labels": dict(c.config.get("Labels") or {}), "State": c.status,
                "Status": shapes.status_text(c.status, c.exit_code, c.started_at, c.finished_at),
                "HostConfig": {"NetworkMode": "none"}, "NetworkSettings": {"Networks": {}}, "Mounts": []}

    def _image_json(self, img: Any) -> dict[str, Any]:
        return {"Id": shapes.image_id(img.name), "RepoTags": [f"{img.name}:latest"], "RepoDigests": [],
                "Parent": "", "Comment": f"crabd image ({img.source})", "Created": shapes.rfc3339(img.created_at),
                "Container": "", "DockerVersion": "", "Author": "", "Architecture": "amd64", "Os": "linux",
                "Size": img.size_bytes, "VirtualSize": img.size_bytes,
                "Config": {"Env": list(img.env), "WorkingDir": "" if img.workdir == "/" else img.workdir,
                           "Cmd": None, "Entrypoint": None, "Labels": {}, "User": ""},
                "RootFS": {"Type": "layers", "Layers": []}, "Metadata": {"LastTagTime": "0001-01-01T00:00:00Z"}}

    def _image(self, ref: str) -> Any:
        name = shapes.image_name(ref)
        try:
            return self.images.get(validate_name(name))
        except (NotFound, InvalidArgument):
            pass
        bare = ref.removeprefix("sha256:")
        for img in self.images.list():
            if len(bare) >= 4 and shapes.image_id(img.name).removeprefix("sha256:").startswith(bare):
                return img
        raise DockerError(404, f"No such image: {ref}")

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
            cs = await self._all()
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

        # --- images ---
        @r.route("GET", "/images/json")
        async def images_list(req: Request) -> Reply:
            out = []
            for img in await asyncio.to_thread(self.images.list):
                out.append({"Id": shapes.image_id(img.name), "ParentId": "", "RepoTags": [f"{img.name}:latest"],
                            "RepoDigests": [], "Created": int(img.created_at), "Size": img.size_bytes,
                            "VirtualSize": img.size_bytes, "SharedSize": -1, "Labels": {}, "Containers": -1})
            return Reply.json(out)

        @r.route("GET", "/images/{ref*}/json")
        async def image_inspect(req: Request) -> Reply:
            return Reply.json(self._image_json(await asyncio.to_thread(self._image, req.params["ref"])))

        @r.route("POST", "/images/create")
        async def image_create(req: Request) -> Reply:
            ref = req.arg("fromImage") or ""
            tag = req.arg("tag") or ""
            if req.arg("fromSrc"):
                raise DockerError(400, "docker import is not supported: use crabd image import PATH --name N")
            full = f"{ref}:{tag}" if tag and ":" not in ref.rsplit("/", 1)[-1] else ref
            name = shapes.image_name(full)
            try:
                validate_name(name)
            except InvalidArgument as e:
                raise DockerError(400, f"image {full!r} maps to the crabd name {name!r}, which is not valid: {e.message}")
            if not self.images.exists(name):
                try:
                    await asyncio.to_thread(self.images.import_docker, full, name)
                except CrabdError as e:
                    raise DockerError(404, f"crabd has no image {name!r} and could not import {full!r} from a local "
                                           f"Docker engine: {e.message} (fix: import it with crabd image import "
                                           f"docker://{full} --name {name}, or build one: crabd image build debian "
                                           f"--name {name})") from None
                status = f"Imported {full} from the local Docker engine as crabd image {name}"
            else:
                status = f"Image is up to date for {name} (crabd image)"
            lines = [{"status": f"Pulling from {ref}", "id": tag or "latest"}, {"status": status}]
            return Reply(200, b"".join(json.dumps(x).encode() + b"\r\n" for x in lines),
                         [("Content-Type", "application/json")])

        # --- containers ---
        @r.route("POST", "/containers/create")
        async def create(req: Request) -> Reply:
            body = req.json()
            if not isinstance(body, dict):
                raise DockerError(400, "the body must be a JSON object")
            why = shapes.refusals(body)
            if why:
                raise DockerError(400, "crabd cannot honour: " + "; ".join(why) +
                                  ". Drop these options (docs/docker.md lists what crabd refuses and why)")
            host = body.get("HostConfig") or {}
            try:
                limits = shapes.limits_of(host)
            except ValueError as e:
                raise DockerError(400, str(e)) from None
            ref = body.get("Image") or ""
            img = await asyncio.to_thread(self._image, ref)
            name = (req.arg("name") or "").lstrip("/") or None
            if name is not None:
                try:
                    validate_name(name, "container")
                except InvalidArgument:
                    raise DockerError(400, f"Invalid container name ({name}): crabd names are 1-63 characters of "
                                           "a-z, 0-9, '.', '_', '-' (lower case)") from None
                for c in await self._all():
                    if c.name == name:
                        raise DockerError(409, f'Conflict. The container name "/{name}" is already in use by '
                                               f'container "{c.id}". You have to remove (or rename) that container '
                                               "to be able to reuse that name.")
            argv = shapes.main_argv(body)
            if not argv and not (body.get("Tty") or body.get("OpenStdin")):
                raise DockerError(400, "No command specified (crabd images carry no default command)")
            fork_from = (body.get("Labels") or {}).get(shapes.FORK_LABEL)
            try:
                if fork_from:
                    row = await self._fork_for(fork_from, img.name, name, host)
                else:
                    row = await asyncio.to_thread(d.create_sandbox, img.name, name=name, limits=limits)
            except AlreadyExists as e:
                raise DockerError(409, f"Conflict. {e.message}") from None
            keep = ("Image", "Cmd", "Entrypoint", "Env", "WorkingDir", "Labels", "User", "Tty", "OpenStdin",
                    "Hostname")
            c = Container(sid=row.id, name=row.name, image=img.name, created=time.time(),
                          config={k: body.get(k) for k in keep if body.get(k) is not None},
                          host={k: host.get(k) for k in ("AutoRemove", "Memory", "NanoCpus", "PidsLimit")
                                if host.get(k) is not None})
            self.containers[c.sid] = c
            self._save(c)
            return Reply.json({"Id": c.id, "Warnings": []}, 201)

        @r.route("GET", "/containers/json")
        async def list_(req: Request) -> Reply:
            try:
                f = shapes.parse_filters(req.arg("filters"))
            except ValueError as e:
                raise DockerError(400, str(e)) from None
            cs = await self._all()
            if not req.flag("all") and "status" not in f:
                cs = [c for c in cs if c.status == "running"]
            if f.get("name"):
                cs = [c for c in cs if shapes.name_matches(c.name, f["name"])]
            if f.get("label"):
                cs = [c for c in cs if shapes.labels_match(c.config.get("Labels") or {}, f["label"])]
            if f.get("status"):
                cs = [c for c in cs if c.status in f["status"]]
            if f.get("id"):
                cs = [c for c in cs if any(c.id.startswith(i) or c.sid == i for i in f["id"])]
            if f.get("ancestor"):
                cs = [c for c in cs if any(shapes.image_name(a) == c.image for a in f["ancestor"])]
            cs.sort(key=lambda c: c.created, reverse=True)
            limit = int(req.arg("limit") or 0)
            if limit > 0:
                cs = cs[:limit]
            return Reply.json([self._summary(c) for c in cs])

        @r.route("GET", "/containers/{ref}/json")
        async def inspect(req: Request) -> Reply:
            c = await self._find(req.params["ref"])
            try:
                info = await asyncio.to_thread(d.sandbox_info, c.sid)
            except NotFound:
                info = None
            return Reply.json(self._inspect(c, info))

        @r.route("POST", "/containers/{ref}/start")
        async def start(req: Request) -> Reply:
            c = await self._find(req.params["ref"])
            if c.status == "running":
                return Reply(304)
            ck = req.arg("checkpoint")
            if ck:
                cid = c.checkpoints.get(ck, ck)
                await d.rollback(c.sid, cid)
            await self._start(c)
            return Reply(204)

        @r.route("POST", "/containers/{ref}/stop")
        async def stop(req: Request) -> Reply:
            c = await self._find(req.params["ref"])
            if c.status != "running":
                return Reply(304)
            t = req.arg("t") or req.arg("timeout")
            await self._stop(c, signal.SIGTERM, float(t) if t and t.lstrip("-").isdigit() and int(t) >= 0 else 10.0)
            return Reply(204)

        @r.route("POST", "/containers/{ref}/restart")
        async def restart(req: Request) -> Reply:
            c = await self._find(req.params["ref"])
            if c.status == "running":
                await self._stop(c, signal.SIGTERM, 10.0)
            await self._start(c)
            return Reply(204)

        @r.route("POST", "/containers/{ref}/kill")
        async def kill(req: Request) -> Reply:
            c = await self._find(req.params["ref"])
            if c.status != "running":
                raise DockerError(409, f"Cannot kill container: {req.params['ref']}: container {c.id} is not running")
            s = (req.arg("signal") or "KILL").upper().removeprefix("SIG")
            try:
                sig = signal.Signals(int(s)) if s.isdigit() else signal.Signals["SIG" + s]
            except (KeyError, ValueError):
                raise DockerError(400, f"Invalid signal: {s}") from None
            if sig not in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
                raise DockerError(400, f"crabd delivers only KILL, TERM, INT, HUP and QUIT to a container (they stop "
                                       f"it); send {sig.name} with docker exec CONTAINER kill -{sig.name[3:]} PID")
            await self._stop(c, sig, 10.0)
            return Reply(204)

        @r.route("POST", "/containers/{ref}/wait")
        async def wait(req: Request) -> Reply:
            c = await self._find(req.params["ref"])
            cond = req.arg("condition") or "not-running"
            seen = c.finished_at

            def done() -> bool:
                self._settle(c)
                if c.sid not in self.containers:
                    return True
                if cond == "removed":
                    return False
                if cond == "next-exit":
                    return c.status == "exited" and c.finished_at != seen
                return c.status != "running" and c.sid not in self.mains

            async def body() -> bytes:
                await self._until(done)
                return json.dumps({"StatusCode": c.exit_code,
                                   "Error": {"Message": c.error} if c.error else None}).encode() + b"\n"
            return Reply(200, headers=[("Content-Type", "application/json")], later=body)

        @r.route("DELETE", "/containers/{ref}")
        async def remove(req: Request) -> Reply:
            c = await self._find(req.params["ref"])
            if c.status == "running":
                if not req.flag("force"):
                    raise DockerError(409, f"You cannot remove a running container {c.id}. Stop the container "
                                           "before attempting removal or force remove")
                c.host["AutoRemove"] = False  # removed here, once
                await self._stop(c, signal.SIGKILL)
            await self._remove(c)
            return Reply(204)

        @r.route("GET", "/containers/{ref}/logs")
        async def logs(req: Request) -> Reply:
            c = await self._find(req.params["ref"])
            want = {STDOUT: req.flag("stdout"), STDERR: req.flag("stderr")}

            async def body() -> bytes:
                if req.flag("follow"):
                    await self._until(lambda: self._settle(c) or c.status != "running" or c.sid not in self.containers)
                return self._frames(c, [(s, t) for s, t in c.logs if want.get(s)])
            return Reply(200, headers=[("Content-Type", self._stream_type(bool(c.config.get("Tty"))))], later=body)

        @r.route("POST", "/containers/{ref}/attach")
        async def attach(req: Request) -> Hijack:
            c = await self._find(req.params["ref"])
            want = {STDOUT: req.flag("stdout"), STDERR: req.flag("stderr")}

            async def run(s: Stream) -> None:
                seen = c.finished_at
                await self._until(lambda: self._settle(c) or c.sid not in self.containers
                                  or (c.status == "exited" and c.finished_at != seen))
                await s.write(self._frames(c, [(k, t) for k, t in c.logs if want.get(k)]))
            return Hijack(run, self._stream_type(bool(c.config.get("Tty"))))

        @r.route("POST", "/containers/{ref}/resize")
        async def resize(req: Request) -> Reply:
            await self._find(req.params["ref"])
            return Reply(200)

        # --- exec ---
        @r.route("POST", "/containers/{ref}/exec")
        async def exec_create(req: Request) -> Reply:
            c = await self._find(req.params["ref"])
            if c.status != "running":
                raise DockerError(409, f"Container {c.id} is not running")
            body = req.json()
            cmd = body.get("Cmd") or []
            if not cmd or not all(isinstance(a, str) for a in cmd):
                raise DockerError(400, "No exec command specified")
            if body.get("Privileged"):
                raise DockerError(400, "crabd cannot honour: Privileged exec (a sandbox holds untrusted agent code)")
            env = {**self._env(c), **self._env_dict(list(body.get("Env") or []))}
            job = ExecJob(id=secrets.token_hex(32), container=c, argv=list(cmd), env=env,
                          workdir=body.get("WorkingDir") or None, user=body.get("User") or c.config.get("User") or "",
                          tty=bool(body.get("Tty")), stdin=bool(body.get("AttachStdin")))
            self.execs[job.id] = job
            if len(self.execs) > 4096:  # Docker forgets finished execs too
                for k in [k for k, j in self.execs.items() if j.exit_code is not None][:1024]:
                    self.execs.pop(k, None)
            return Reply.json({"Id": job.id}, 201)

        @r.route("POST", "/exec/{eid}/start")
        async def exec_start(req: Request) -> Reply | Hijack:
            job = self.execs.get(req.params["eid"])
            if job is None:
                raise DockerError(404, f"No such exec instance: {req.params['eid']}")
            if job.running or job.exit_code is not None:
                raise DockerError(409, f"Exec {job.id} has already been started")
            body = req.json()
            tty = bool(body.get("Tty", job.tty))
            job.running = True
            if body.get("Detach"):
                task = asyncio.ensure_future(self._run_exec(job, None, tty, b""))
                self._detached.add(task)  # a reference, so the task is not collected while it runs
                task.add_done_callback(self._detached.discard)
                return Reply.json({})

            async def run(s: Stream) -> None:
                data = await s.read_all() if job.stdin else b""
                await self._run_exec(job, s, tty, data)
            return Hijack(run, self._stream_type(tty))

        @r.route("GET", "/exec/{eid}/json")
        async def exec_inspect(req: Request) -> Reply:
            job = self.execs.get(req.params["eid"])
            if job is None:
                raise DockerError(404, f"No such exec instance: {req.params['eid']}")
            return Reply.json({"ID": job.id, "Running": job.running, "ExitCode": job.exit_code,
                               "ProcessConfig": {"tty": job.tty, "entrypoint": job.argv[0], "arguments": job.argv[1:],
                                                 "privileged": False, "user": job.user},
                               "OpenStdin": job.stdin, "OpenStderr": True, "OpenStdout": True, "CanRemove": False,
                               "ContainerID": job.container.id, "DetachKeys": "", "Pid": job.pid})

        @r.route("POST", "/exec/{eid}/resize")
        async def exec_resize(req: Request) -> Reply:
            if req.params["eid"] not in self.execs:
                raise DockerError(404, f"No such exec instance: {req.params['eid']}")
            return Reply(201)

        # --- archive (docker cp) ---
        @r.route("HEAD", "/containers/{ref}/archive")
        async def archive_head(req: Request) -> Reply:
            c = await self._find(req.params["ref"])
            st = await self._path_stat(c, self._path(req))
            return Reply(200, b"", [("X-Docker-Container-Path-Stat", st), ("Content-Type", "application/x-tar")])

        @r.route("GET", "/containers/{ref}/archive")
        async def archive_get(req: Request) -> Reply:
            c = await self._find(req.params["ref"])
            path = self._path(req)
            st = await self._path_stat(c, path)
            parent, base = os.path.split(path.rstrip("/") or "/")
            script = 'cd "$1" && tar -c -f - "$2" | base64'
            res = await self._exec(c, ["/bin/sh", "-c", script, "sh", parent or "/", base or "."], cwd="/")
            if res.get("stdout_truncated"):
                raise DockerError(413, f"{path} is over crabd's copy-out limit ({_ARCHIVE_OUT_MAX >> 10} KiB of tar: "
                                       "an exec returns at most 1 MiB of output); copy it in parts")
            if res["exit_code"] != 0:
                raise DockerError(500, f"tar of {path} failed in the sandbox: {res['stderr'].strip()[-300:]}")
            data = base64.b64decode("".join(res["stdout"].split()))
            return Reply(200, data, [("X-Docker-Container-Path-Stat", st), ("Content-Type", "application/x-tar")])

        @r.route("PUT", "/containers/{ref}/archive")
        async def archive_put(req: Request) -> Reply:
            c = await self._find(req.params["ref"])
            path = self._path(req)
            try:  # refuse what tar could not unpack before it reaches the sandbox
                tarfile.open(fileobj=io.BytesIO(req.body), mode="r:*").getmembers()
            except (tarfile.TarError, EOFError) as e:
                raise DockerError(400, f"the body is not a tar archive: {e}") from None
            script = f'[ -d "$1" ] || exit {_MISSING}; exec tar -x -f - -C "$1"'
            res = await self._exec(c, ["/bin/sh", "-c", script, "sh", path], cwd="/", stdin=req.body)
            if res["exit_code"] == _MISSING:
                raise DockerError(404, f"Could not find the file {path} in container {req.params['ref']}")
            if res["exit_code"] != 0:
                raise DockerError(500, f"extracting into {path} failed in the sandbox: {res['stderr'].strip()[-300:]}")
            return Reply(200)

        # --- checkpoints (crabd's checkpoints under Docker's names) ---
        @r.route("GET", "/containers/{ref}/checkpoints")
        async def ck_list(req: Request) -> Reply:
            c = await self._find(req.params["ref"])
            names = {v: k for k, v in c.checkpoints.items()}
            cks = await asyncio.to_thread(d.list_checkpoints, c.sid)
            return Reply.json([{"Name": names.get(k["id"], k["id"])} for k in cks])

        @r.route("POST", "/containers/{ref}/checkpoints")
        async def ck_create(req: Request) -> Reply:
            c = await self._find(req.params["ref"])
            if c.status != "running":
                raise DockerError(409, f"Container {c.id} is not running")
            body = req.json()
            name = body.get("CheckpointID") or ""
            if not name:
                raise DockerError(400, "a checkpoint name is required")
            if name in c.checkpoints:
                raise DockerError(409, f"checkpoint with name {name} already exists for container {c.name}")
            ck = await d.checkpoint_now(c.sid)
            c.checkpoints[name] = ck["id"]
            self._save(c)
            if body.get("Exit", True):  # docker checkpoint create stops the container unless --leave-running
                await self._stop(c, signal.SIGKILL)
            return Reply(201)

        @r.route("DELETE", "/containers/{ref}/checkpoints/{name}")
        async def ck_delete(req: Request) -> Reply:
            c = await self._find(req.params["ref"])
            name = req.params["name"]
            if name not in c.checkpoints:  # a crabd checkpoint id: deleted as crabd's API would
                await asyncio.to_thread(d.delete_checkpoint, name)
                return Reply(204)
            # A Docker name is a handle on a crabd checkpoint: the name goes;
            # the checkpoint too unless later ones still build on it (then
            # crabd's retention removes it in time).
            cid = c.checkpoints.pop(name)
            self._save(c)
            try:
                await asyncio.to_thread(d.delete_checkpoint, cid)
            except FailedPrecondition as e:
                log.info("docker checkpoint rm %s: keeping %s: %s", name, cid, e.message)
            return Reply(204)

    # --- helpers of the routes ------------------------------------------------------
    @staticmethod
    def _stream_type(tty: bool) -> str:
        return "application/vnd.docker.raw-stream" if tty else "application/vnd.docker.multiplexed-stream"

    @staticmethod
    def _frames(c: Container | None, parts: list[tuple[int, str]], tty: bool | None = None) -> bytes:
        raw = tty if tty is not None else bool(c and c.config.get("Tty"))
        out = bytearray()
        for s, text in parts:
            data = text.encode()
            out += data if raw else shapes.frame(s, data)
        return bytes(out)

    async def _run_exec(self, job: ExecJob, s: Stream | None, tty: bool, stdin: bytes) -> None:
        c = job.container
        argv = shapes.user_argv(job.user, job.argv)
        try:
            res = await self._exec(c, argv, env=job.env, cwd=job.workdir, stdin=stdin or None)
            code, parts = res["exit_code"], [(STDOUT, res["stdout"]), (STDERR, res["stderr"])]
        except CommandNotFound as e:
            code, parts = 127, [(STDERR, f"crabd: {e.message}\n")]
        except CrabdError as e:
            code, parts = 126, [(STDERR, f"crabd: {e.message}" + (f" (fix: {e.fix})" if e.fix else "") + "\n")]
        except Exception as e:  # the client waits on this stream: say what broke
            log.warning("docker exec %s: %s", job.id, e, exc_info=e)
            code, parts = 126, [(STDERR, f"crabd: {type(e).__name__}: {e}\n")]
        job.exit_code, job.running = code, False
        if s is not None:
            await s.write(self._frames(None, [p for p in parts if p[1]], tty=tty))

    @staticmethod
    def _path(req: Request) -> str:
        p = req.arg("path") or ""
        if not p.startswith("/"):
            p = "/" + p
        if "\x00" in p:
            raise DockerError(400, "path contains a NUL byte")
        return p

    async def _path_stat(self, c: Container, path: str) -> str:
        """Docker's X-Docker-Container-Path-Stat: base64 of JSON
        {name, size, mode (Go FileMode), mtime, linkTarget}."""
        script = (f'[ -e "$1" ] || [ -L "$1" ] || exit {_MISSING}; stat -c "%s %f %Y" "$1"; '
                  '[ -L "$1" ] && readlink "$1"; exit 0')
        res = await self._exec(c, ["/bin/sh", "-c", script, "sh", path], cwd="/")
        if res["exit_code"] == _MISSING:
            raise DockerError(404, f"Could not find the file {path} in container {c.name}")
        lines = res["stdout"].splitlines()
        try:
            size, mode_hex, mtime = lines[0].split()
            mode = shapes.go_file_mode(int(mode_hex, 16))
        except (IndexError, ValueError):
            raise DockerError(500, f"stat of {path} in the sandbox failed: {res['stderr'].strip()[-300:]}") from None
        st = {"name": os.path.basename(path.rstrip("/")) or "/", "size": int(size), "mode": mode,
              "mtime": shapes.rfc3339(float(mtime)).replace(".000000", ""),
              "linkTarget": lines[1] if len(lines) > 1 else ""}
        return base64.b64encode(json.dumps(st).encode()).decode()


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
