"""The Docker API's exec routes: `docker exec` as crabd turns (an exec
returns when the command ends, with all of its output).
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import CommandNotFound, CrabdError
from . import shapes
from .containers import Container
from .shapes import STDERR, STDOUT
from .wire import DockerError, Hijack, Reply, Request, Stream

if TYPE_CHECKING:
    from .engine import DockerEngine

log = logging.getLogger("crabd.docker")


@dataclass
class ExecJob:
    """One `docker exec`: created by one request, run by the next (or detached)."""

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


async def run_exec(engine: DockerEngine, job: ExecJob, s: Stream | None, tty: bool, stdin: bytes) -> None:
    """Run an exec job as a crabd turn; its output, framed, to the stream `s` (if attached)."""
    c = job.container
    argv = shapes.user_argv(job.user, job.argv)
    try:
        res = await engine.exec(c, argv, env=job.env, cwd=job.workdir, stdin=stdin or None)
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
        await s.write(engine.frames(None, [p for p in parts if p[1]], tty=tty))


def add_routes(engine: DockerEngine) -> None:
    r = engine.router

    @r.route("POST", "/containers/{ref}/exec")
    async def exec_create(req: Request) -> Reply:
        c = await engine.find_running(req.params["ref"])
        body = req.json()
        cmd = body.get("Cmd") or []
        if not cmd or not all(isinstance(a, str) for a in cmd):
            raise DockerError(400, "No exec command specified")
        if body.get("Privileged"):
            raise DockerError(400, "crabd cannot honour: Privileged exec (a sandbox holds untrusted agent code)")
        env = {**engine.env(c), **shapes.env_dict(list(body.get("Env") or []))}
        job = ExecJob(id=secrets.token_hex(32), container=c, argv=list(cmd), env=env,
                      workdir=body.get("WorkingDir") or None, user=body.get("User") or c.config.get("User") or "",
                      tty=bool(body.get("Tty")), stdin=bool(body.get("AttachStdin")))
        engine.execs[job.id] = job
        if len(engine.execs) > 4096:  # Docker forgets finished execs too
            for k in [k for k, j in engine.execs.items() if j.exit_code is not None][:1024]:
                engine.execs.pop(k, None)
        return Reply.json({"Id": job.id}, 201)

    @r.route("POST", "/exec/{eid}/start")
    async def exec_start(req: Request) -> Reply | Hijack:
        job = engine.execs.get(req.params["eid"])
        if job is None:
            raise DockerError(404, f"No such exec instance: {req.params['eid']}")
        if job.running or job.exit_code is not None:
            raise DockerError(409, f"Exec {job.id} has already been started")
        body = req.json()
        tty = bool(body.get("Tty", job.tty))
        job.running = True
        if body.get("Detach"):
            engine.detach(run_exec(engine, job, None, tty, b""))
            return Reply.json({})

        async def run(s: Stream) -> None:
            data = await s.read_all() if job.stdin else b""
            await run_exec(engine, job, s, tty, data)
        return Hijack(run, engine.stream_type(tty))

    @r.route("GET", "/exec/{eid}/json")
    async def exec_inspect(req: Request) -> Reply:
        job = engine.execs.get(req.params["eid"])
        if job is None:
            raise DockerError(404, f"No such exec instance: {req.params['eid']}")
        return Reply.json({"ID": job.id, "Running": job.running, "ExitCode": job.exit_code,
                           "ProcessConfig": {"tty": job.tty, "entrypoint": job.argv[0], "arguments": job.argv[1:],
                                             "privileged": False, "user": job.user},
                           "OpenStdin": job.stdin, "OpenStderr": True, "OpenStdout": True, "CanRemove": False,
                           "ContainerID": job.container.id, "DetachKeys": "", "Pid": job.pid})

    @r.route("POST", "/exec/{eid}/resize")
    async def exec_resize(req: Request) -> Reply:
        if req.params["eid"] not in engine.execs:
            raise DockerError(404, f"No such exec instance: {req.params['eid']}")
        return Reply(201)
