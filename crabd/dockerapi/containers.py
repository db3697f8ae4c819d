"""Docker's containers: the record kept of each (Container), its JSON
shapes, and the container routes: create (a crabd sandbox, or with the
crabd.fork-from label a fork of a checkpoint), list, inspect, start, stop,
restart, kill, wait, remove, logs, attach.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import AlreadyExists, InvalidArgument, NotFound
from ..images import validate_name
from . import shapes
from .images import find_image
from .shapes import STDERR, STDOUT
from .wire import DockerError, Hijack, Reply, Request, Stream

if TYPE_CHECKING:
    from .engine import DockerEngine


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


async def fork_for(engine: DockerEngine, cid: str, image: str, name: str | None, host: dict[str, Any]) -> Any:
    """A container created with the crabd.fork-from label: a crabd fork of
    that checkpoint (files and processes), so that a harness which only
    knows `docker run` (mini-swe-agent's environment, configured with
    run_args) starts its best-of-N branches on the checkpoint's state."""
    d = engine.daemon
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


def inspect_json(engine: DockerEngine, c: Container, info: dict[str, Any] | None) -> dict[str, Any]:
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
        "ExecIDs": [e.id for e in engine.execs.values() if e.container is c and e.running] or None,
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


def summary_json(c: Container) -> dict[str, Any]:
    argv = shapes.main_argv(c.config)
    return {"Id": c.id, "Names": ["/" + c.name], "Image": c.config.get("Image") or c.image,
            "ImageID": shapes.image_id(c.image), "Command": " ".join(argv), "Created": int(c.created),
            "Ports": [], "Labels": dict(c.config.get("Labels") or {}), "State": c.status,
            "Status": shapes.status_text(c.status, c.exit_code, c.started_at, c.finished_at),
            "HostConfig": {"NetworkMode": "none"}, "NetworkSettings": {"Networks": {}}, "Mounts": []}


def add_routes(engine: DockerEngine) -> None:
    r, d = engine.router, engine.daemon

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
        img = await asyncio.to_thread(find_image, engine, ref)
        name = (req.arg("name") or "").lstrip("/") or None
        if name is not None:
            try:
                validate_name(name, "container")
            except InvalidArgument:
                raise DockerError(400, f"Invalid container name ({name}): crabd names are 1-63 characters of "
                                       "a-z, 0-9, '.', '_', '-' (lower case)") from None
            for c in await engine.all_containers():
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
                row = await fork_for(engine, fork_from, img.name, name, host)
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
        engine.containers[c.sid] = c
        engine.save(c)
        return Reply.json({"Id": c.id, "Warnings": []}, 201)

    @r.route("GET", "/containers/json")
    async def list_(req: Request) -> Reply:
        try:
            f = shapes.parse_filters(req.arg("filters"))
        except ValueError as e:
            raise DockerError(400, str(e)) from None
        cs = await engine.all_containers()
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
        return Reply.json([summary_json(c) for c in cs])

    @r.route("GET", "/containers/{ref}/json")
    async def inspect(req: Request) -> Reply:
        c = await engine.find(req.params["ref"])
        try:
            info = await asyncio.to_thread(d.sandbox_info, c.sid)
        except NotFound:
            info = None
        return Reply.json(inspect_json(engine, c, info))

    @r.route("POST", "/containers/{ref}/start")
    async def start(req: Request) -> Reply:
        c = await engine.find(req.params["ref"])
        if c.status == "running":
            return Reply(304)
        ck = req.arg("checkpoint")
        if ck:
            cid = c.checkpoints.get(ck, ck)
            await d.rollback(c.sid, cid)
        await engine.start(c)
        return Reply(204)

    @r.route("POST", "/containers/{ref}/stop")
    async def stop(req: Request) -> Reply:
        c = await engine.find(req.params["ref"])
        if c.status != "running":
            return Reply(304)
        t = req.arg("t") or req.arg("timeout")
        await engine.stop(c, signal.SIGTERM, float(t) if t and t.lstrip("-").isdigit() and int(t) >= 0 else 10.0)
        return Reply(204)

    @r.route("POST", "/containers/{ref}/restart")
    async def restart(req: Request) -> Reply:
        c = await engine.find(req.params["ref"])
        if c.status == "running":
            await engine.stop(c, signal.SIGTERM, 10.0)
        await engine.start(c)
        return Reply(204)

    @r.route("POST", "/containers/{ref}/kill")
    async def kill(req: Request) -> Reply:
        c = await engine.find(req.params["ref"])
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
        await engine.stop(c, sig, 10.0)
        return Reply(204)

    @r.route("POST", "/containers/{ref}/wait")
    async def wait(req: Request) -> Reply:
        c = await engine.find(req.params["ref"])
        cond = req.arg("condition") or "not-running"
        seen = c.finished_at

        def done() -> bool:
            engine.settle(c)
            if c.sid not in engine.containers:
                return True
            if cond == "removed":
                return False
            if cond == "next-exit":
                return c.status == "exited" and c.finished_at != seen
            return c.status != "running" and c.sid not in engine.mains

        async def body() -> bytes:
            await engine.until(done)
            return json.dumps({"StatusCode": c.exit_code,
                               "Error": {"Message": c.error} if c.error else None}).encode() + b"\n"
        return Reply(200, headers=[("Content-Type", "application/json")], later=body)

    @r.route("DELETE", "/containers/{ref}")
    async def remove(req: Request) -> Reply:
        c = await engine.find(req.params["ref"])
        if c.status == "running":
            if not req.flag("force"):
                raise DockerError(409, f"You cannot remove a running container {c.id}. Stop the container "
                                       "before attempting removal or force remove")
            c.host["AutoRemove"] = False  # removed here, once
            await engine.stop(c, signal.SIGKILL)
        await engine.remove(c)
        return Reply(204)

    @r.route("GET", "/containers/{ref}/logs")
    async def logs(req: Request) -> Reply:
        c = await engine.find(req.params["ref"])
        want = {STDOUT: req.flag("stdout"), STDERR: req.flag("stderr")}

        async def body() -> bytes:
            if req.flag("follow"):
                await engine.until(lambda: engine.settle(c) or c.status != "running" or c.sid not in engine.containers)
            return engine.frames(c, [(s, t) for s, t in c.logs if want.get(s)])
        return Reply(200, headers=[("Content-Type", engine.stream_type(bool(c.config.get("Tty"))))], later=body)

    @r.route("POST", "/containers/{ref}/attach")
    async def attach(req: Request) -> Hijack:
        c = await engine.find(req.params["ref"])
        want = {STDOUT: req.flag("stdout"), STDERR: req.flag("stderr")}

        async def run(s: Stream) -> None:
            seen = c.finished_at
            await engine.until(lambda: engine.settle(c) or c.sid not in engine.containers
                              or (c.status == "exited" and c.finished_at != seen))
            await s.write(engine.frames(c, [(k, t) for k, t in c.logs if want.get(k)]))
        return Hijack(run, engine.stream_type(bool(c.config.get("Tty"))))

    @r.route("POST", "/containers/{ref}/resize")
    async def resize(req: Request) -> Reply:
        await engine.find(req.params["ref"])
        return Reply(200)
