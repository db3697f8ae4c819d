"""The operator view: a web page at /ui on the API's own listeners.

Place in the design: a front door beside the CLI and the Python client. It
holds no state and talks to the daemon only through the REST API and the
event stream, with the caller's own token: what the page may show and do is
exactly what that token may through the API (an owner sees its own
sandboxes). The page is static HTML, CSS and vanilla JS shipped in the
package (`static/`); nothing is fetched from elsewhere at run time.

Auth (crabd.api._Guard): the shell's files are requests like any other, and
a browser's navigation cannot carry an `Authorization` header, so for GET
requests under /ui/ the guard also takes the token from the `crabd_token`
cookie, which `/ui/login` (the one page served without a token: a form, no
data; it and its two files are all that is served without a token) sets
from the URL's fragment. Every API call of the page sends the
token as a bearer header; a cookie never authorises a change (no CSRF).

Four read-only endpoints are added for the page, all owner-scoped:
`GET /v1/host` (sandboxes summarised in one pass, the scheduler's queue,
stalls and checkpoint throughput), `GET /v1/sandboxes/{sid}/tree` (the
checkpoint tree as compact arrays, with the forks made from it),
`GET /v1/sandboxes/{sid}/view` (everything the sandbox page draws first, in
one reply: the sandbox, its tree, budget, effects, newest turns and the
event stream's starting point) and `GET /v1/sandboxes/{sid}/rollback/preview`
(what a rollback to a checkpoint abandons and which effects it does not
undo, from the rollback's own walk).

Scale (bench/ui.py: 500 sandboxes, 10,000 checkpoints, a 1,000-turn tree):
the big replies are plain JSON built without FastAPI's encoder, the host
table is paged, the tree is drawn as a window of the rows in view
(virtualised), and the time line loads the newest turns and more on demand.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from importlib import resources
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Query, Request
from fastapi import Path as PathParam
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse, RedirectResponse, Response

from ..effects import abandoned_line, seen_not_undone
from ..errors import NotFound
from ..store import EVENTS_MAX_PAGE

if TYPE_CHECKING:
    from ..daemon import Daemon

__all__ = ["mount", "host_summary", "sandbox_tree", "sandbox_view", "preview_rollback", "send_see_login", "LOGIN_PATH", "PUBLIC", "COOKIE"]

LOGIN_PATH = "/ui/login"
#: What a request without a token may GET: the token form and its own two
#: files (code and style, no data). Everything else needs the token.
PUBLIC = frozenset({LOGIN_PATH, "/ui/static/login.js", "/ui/static/ui.css"})
COOKIE = "crabd_token"
#: Seconds over which the host's checkpoint throughput is summed.
THROUGHPUT_WINDOW_S = 60.0
#: Scheduler jobs named in the host summary (queued, and running); the rest are counted.
JOBS_LISTED = 50
#: Host-wide events the sandbox view's reply carries for the page's event list (the stream's backlog).
RECENT_EVENTS = 50
#: The checkpoint tree's columns (`sandbox_tree`): one array per checkpoint, in this order.
TREE_FIELDS = ("id", "seq", "parent", "branch", "turn", "plan", "state", "bytes", "pause", "kept", "reasons")

# The page runs only its own files: no inline script, no other origin.
_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml", ".png": "image/png"}


async def send_see_login(send: Any) -> None:
    """ASGI: a 303 to the token form (a page's GET without a valid token)."""
    await send({"type": "http.response.start", "status": 303,
                "headers": [(b"location", LOGIN_PATH.encode()), (b"content-length", b"0")]})
    await send({"type": "http.response.body", "body": b""})


def _assets() -> dict[str, tuple[bytes, str]]:
    """The shipped files by name (read once: a request never names a path).
    The two pages name the code and style they load with a digest of their
    content (`/ui/static/ui.js?v=DIGEST`, see `asset_version`): the browser
    may keep those (a reload asks the daemon for the page and its data
    only), and a changed file is a new URL."""
    out = {}
    for f in resources.files(__name__).joinpath("static").iterdir():
        suffix = "." + f.name.rsplit(".", 1)[-1]
        if f.is_file() and suffix in _TYPES:
            out[f.name] = (f.read_bytes(), _TYPES[suffix])
    for page in ("index.html", "login.html"):
        if page not in out:
            continue
        body = out[page][0]
        for name, (data, _) in out.items():
            if name.endswith((".js", ".css")):
                body = body.replace(f'"/ui/static/{name}"'.encode(),
                                    f'"/ui/static/{name}?v={asset_version(data)}"'.encode())
        out[page] = (body, out[page][1])
    return out


def asset_version(data: bytes) -> str:
    """A shipped file's version in the URLs that name it: its content's digest."""
    return hashlib.sha256(data).hexdigest()[:16]


def host_summary(daemon: Daemon, owner: str | None, jobs: tuple[list[Any], list[Any]],
                 now: float | None = None, forks_of: str | None = None) -> dict[str, Any]:
    """The host view's data in one reply: every sandbox the owner may see
    with its checkpoint count, bytes, last plan and hot standby; the
    scheduler's (queued, running) `jobs`, read on the event loop that
    changes them; stalls; checkpoints committed in the last minute.
    `forks_of`: only the sandboxes forked from that sandbox's checkpoints
    (the sandbox view's fork links)."""
    now = time.time() if now is None else now
    rows = daemon.store.list_sandboxes(owner)
    if forks_of is not None:
        # A checkpoint id is <sandbox>-<seq>.
        rows = [r for r in rows if r.forked_from and r.forked_from.rsplit("-", 1)[0] == forks_of]
    per, recent = daemon.store.checkpoint_totals(now - THROUGHPUT_WINDOW_S)
    standbys = getattr(daemon, "standbys", {})
    sandboxes = []
    for r in rows:
        t = per.get(r.id, {})
        sb = standbys.get(r.id)
        sandboxes.append({
            "id": r.id, "name": r.name, "image": r.image, "owner": r.owner, "state": r.state, "turn": r.turn,
            "branch": r.branch, "head": r.head, "forked_from": r.forked_from, "created_at": r.created_at,
            "checkpoints": t.get("checkpoints", 0), "bytes": t.get("bytes", 0), "last_plan": t.get("last_plan"),
            "standby": sb.checkpoint if sb is not None else None})
    mine = {r.id for r in rows}

    def listed(js: list[Any]) -> list[dict[str, Any]]:
        # Another owner's jobs are counted, never named. A busy host queues
        # thousands (idle sizing, compaction): the first JOBS_LISTED are named,
        # the rest counted (`queued_total`, `running_total`).
        return [{"kind": getattr(j.kind, "value", str(j.kind)),
                 "sandbox_id": j.sandbox_id if owner is None or j.sandbox_id in mine else None,
                 "size_bytes": j.size_bytes} for j in js[:JOBS_LISTED]]

    reg = daemon.metrics.registry
    stall_n = reg.get_sample_value("crabd_stall_seconds_count") or 0.0
    stall_s = reg.get_sample_value("crabd_stall_seconds_sum") or 0.0
    # Stalls over 0: the histogram's first bucket (le=0.0) holds the turns that did not wait.
    no_wait = reg.get_sample_value("crabd_stall_seconds_bucket", {"le": "0.0"}) or 0.0
    return {
        "now": now, "sandboxes": sandboxes,
        "scheduler": {"queued": listed(jobs[0]), "running": listed(jobs[1]), "queued_total": len(jobs[0]),
                      "running_total": len(jobs[1]), "max_concurrency": daemon.scheduler.policy.max_concurrency},
        "stalls": {"turns": int(stall_n), "stalled": int(stall_n - no_wait), "total_s": round(stall_s, 4)},
        "throughput": {"window_s": THROUGHPUT_WINDOW_S, **recent},
    }


def sandbox_tree(daemon: Daemon, sid: str, owner: str | None) -> dict[str, Any]:
    """The sandbox view's checkpoint tree in one compact reply: every
    checkpoint (failed ones too), oldest first, as one array of
    `TREE_FIELDS` each (a 1,000-turn tree is ~100 KB instead of the
    checkpoint list's ~480 KB of objects), and the sandboxes forked from its
    checkpoints that the owner may see (id, name, forked_from)."""
    row = daemon._own(daemon.store.get_sandbox(sid), owner)
    cks = daemon.list_checkpoints(row.id, owner, all_states=True)
    rows = [[c["id"], c["seq"], c["parent"], c["branch"], c["turn"], c["plan"], c["state"], c["bytes"],
             (c.get("durations") or {}).get("pause"), c["kept"], c["reasons"]] for c in cks]
    ids = {c["id"] for c in cks}
    forks = [{"id": r.id, "name": r.name, "forked_from": r.forked_from}
             for r in daemon.store.list_sandboxes(owner) if r.forked_from in ids]
    return {"sandbox": row.id, "head": row.head, "branch": row.branch, "fields": list(TREE_FIELDS),
            "checkpoints": rows, "forks": forks}


def _recent(daemon: Daemon, owner: str | None) -> dict[str, Any]:
    """The newest RECENT_EVENTS events the owner may see, oldest first, and
    the seq the page's event stream starts from."""
    recent, _ = daemon.store.events_page(owner=owner, limit=RECENT_EVENTS, newest_first=True)
    recent.reverse()
    return {"events": [e.to_dict() for e in recent], "last_seq": recent[-1].seq if recent else 0}


def _ledger_and_turns(daemon: Daemon, sid: str, owner: str | None, turns: int) -> dict[str, Any]:
    row = daemon._own(daemon.store.get_sandbox(sid), owner)
    evs, more = daemon.store.events_page(sandbox_id=row.id, owner=owner, limit=turns, newest_first=True)
    evs.reverse()
    return {"budget": jsonable_encoder(daemon.ledger.budget(row.lineage)),
            "effects": jsonable_encoder(daemon.ledger.list(row.lineage)),
            "events": {"events": [e.to_dict() for e in evs], "more": more}}


def _view(recent: dict[str, Any], tree: dict[str, Any], info: dict[str, Any], rest: dict[str, Any]) -> dict[str, Any]:
    return {"sandbox": tree["sandbox"], "info": jsonable_encoder(info), "tree": tree, **rest, "recent": recent}


def sandbox_view(daemon: Daemon, sid: str, owner: str | None, turns: int) -> dict[str, Any]:
    """The sandbox page's first paint in one reply (the page used to make
    five requests and the event stream a sixth): `info` (GET
    /v1/sandboxes/{sid}), `tree` (sandbox_tree), `budget` and `effects` of
    its lineage, `events`: its newest `turns` events, oldest first, with
    `more` (older ones exist: GET /v1/events?order=desc&before=), and
    `recent`: the newest RECENT_EVENTS events the owner may see and
    `last_seq`, where the page's event stream starts.

    `recent` is read first: an event that lands while the rest is read has a
    seq past `last_seq`, so the stream delivers it and the page refreshes;
    read last, such an event would count as already drawn. The endpoint
    reads the other three parts in parallel (`sandbox_view_parallel`)."""
    recent = _recent(daemon, owner)
    return _view(recent, sandbox_tree(daemon, sid, owner), daemon.sandbox_info(sid, owner),
                 _ledger_and_turns(daemon, sid, owner, turns))


async def sandbox_view_parallel(daemon: Daemon, sid: str, owner: str | None, turns: int) -> dict[str, Any]:
    """`sandbox_view`, its three parts read in three threads at once, as the
    page's five requests were: on a host whose cores are contended, one
    thread doing the lot waits its turn for the CPU three times over
    (measured: the one-thread view took ~1.4x the five parallel requests at
    load 14). Each part checks the owner itself."""
    recent = await asyncio.to_thread(_recent, daemon, owner)
    tree, info, rest = await asyncio.gather(
        asyncio.to_thread(sandbox_tree, daemon, sid, owner), asyncio.to_thread(daemon.sandbox_info, sid, owner),
        asyncio.to_thread(_ledger_and_turns, daemon, sid, owner, turns))
    return _view(recent, tree, info, rest)


def preview_rollback(daemon: Daemon, sid: str, checkpoint: str, owner: str | None) -> dict[str, Any]:
    """What `POST /v1/sandboxes/{sid}/rollback` to `checkpoint` would
    abandon (the checkpoints from the head back to where the target's line
    meets it) and the effects it would not undo: what the inspector saw
    leave the sandbox on that stretch, and the ledger's effects. The stretch
    is the rollback's own (crabd.effects.abandoned_line, one walk over the
    sandbox's checkpoints read in one query), so the confirmation lists what
    the rollback's reply will. Changes nothing."""
    row = daemon._own(daemon.store.get_sandbox(sid), owner)
    ck = daemon.resolve_checkpoint(row.id, checkpoint)
    rows = {c.id: c for c in daemon.store.list_checkpoints(row.id, states=("committed", "pending", "failed"))}
    line = abandoned_line(row.head, row.branch, ck.id, rows.get)
    return {"sandbox": row.id, "checkpoint": ck.id, "turn": ck.turn, "head": row.head, "meets": line.meets,
            "lost": [{"id": c.id, "seq": c.seq, "turn": c.turn, "branch": c.branch, "plan": c.plan} for c in line.lost],
            "effects_not_undone": seen_not_undone(line.lost),
            "ledger": daemon._ledger_report(row.id, row, line.path)}


def mount(app: FastAPI, daemon: Daemon) -> None:
    """Add /ui (the page), /ui/login, /ui/static/NAME and the page's
    read-only endpoints to the API."""
    assets = _assets()

    def asset(name: str, version: str | None = None) -> Response:
        try:
            body, ctype = assets[name]
        except KeyError:
            raise NotFound(f"no file {name!r} in the operator view",
                           fix="open /ui/; the page loads its own files") from None
        headers = _HEADERS
        if version is not None and version == asset_version(body):
            # This URL always names these bytes: the browser keeps them (its own cache, not a shared one).
            headers = {**_HEADERS, "Cache-Control": "private, max-age=31536000, immutable"}
        return Response(body, media_type=ctype, headers=headers)

    @app.get("/ui", include_in_schema=False)
    async def ui_root() -> Response:
        return RedirectResponse("/ui/", status_code=307)

    @app.get("/ui/", include_in_schema=False)
    async def ui_index() -> Response:
        return asset("index.html")

    @app.get(LOGIN_PATH, include_in_schema=False)
    async def ui_login() -> Response:
        return asset("login.html")

    @app.get("/ui/static/{name}", include_in_schema=False)
    async def ui_static(name: str, v: str | None = Query(None, max_length=64)) -> Response:
        return asset(name, v)

    @app.get("/v1/host")
    async def host_view(request: Request,
                        forks_of: str | None = Query(None, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
                                                     description="only the sandboxes forked from this sandbox")
                        ) -> dict[str, Any]:
        """The host at a glance (the operator view's host page): each sandbox the caller may see with its state,
        turns, branch, checkpoints, bytes, last plan and ready hot standby; the scheduler's queued and running
        jobs; stalls so far; checkpoints committed (and their bytes) over the last minute."""
        owner = request.scope.get("state", {}).get("crabd_owner")
        jobs = (daemon.scheduler.queued(), daemon.scheduler.running())  # here: the loop's thread owns the queue
        out = await asyncio.to_thread(host_summary, daemon, owner, jobs, None, forks_of)
        # Plain JSON: FastAPI's encoder walks 500 sandboxes' dicts value by
        # value (hundreds of ms here); these are plain types already.
        return JSONResponse(out)  # type: ignore[return-value]

    @app.get("/v1/sandboxes/{sid}/tree")
    async def tree_view(request: Request,
                        sid: str = PathParam(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$",
                                             description="an id (or a sandbox's name)")) -> dict[str, Any]:
        """The sandbox's checkpoint tree, compact (the operator view's sandbox page): `checkpoints` oldest first,
        each an array of the values named by `fields` (id, seq, parent, branch, turn, plan, state, bytes, pause,
        kept, reasons); `forks`: the sandboxes forked from its checkpoints."""
        owner = request.scope.get("state", {}).get("crabd_owner")
        out = await asyncio.to_thread(sandbox_tree, daemon, sid, owner)
        return JSONResponse(out)  # type: ignore[return-value]  # plain types: no encoder walk (as /v1/host)

    @app.get("/v1/sandboxes/{sid}/view")
    async def sandbox_page(request: Request,
                           sid: str = PathParam(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$",
                                                description="an id (or a sandbox's name)"),
                           turns: int = Query(200, ge=1, le=EVENTS_MAX_PAGE,
                                              description="the sandbox's newest events in `events`")) -> dict[str, Any]:
        """What the operator view's sandbox page draws first, in one reply: `info` (as GET /v1/sandboxes/{sid}),
        `tree` (as GET /v1/sandboxes/{sid}/tree), the lineage's `budget` and `effects`, `events` (the sandbox's
        newest `turns` events, oldest first, and whether `more` are older) and `recent` (the newest 50 events the
        caller may see, and `last_seq`: where to start following GET /v1/events)."""
        owner = request.scope.get("state", {}).get("crabd_owner")
        out = await sandbox_view_parallel(daemon, sid, owner, turns)
        return JSONResponse(out)  # type: ignore[return-value]  # plain types already (as /v1/host)

    @app.get("/v1/sandboxes/{sid}/rollback/preview")
    async def rollback_preview(request: Request,
                                sid: str = PathParam(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$",
                                                     description="an id (or a sandbox's name)"),
                                checkpoint: str = Query(..., max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
                                                        description="checkpoint id or sequence number")
                                ) -> dict[str, Any]:
        """What a rollback to `checkpoint` would abandon (`lost`: checkpoints from the head back to the target's
        line) and which external effects it would not undo (`ledger`); changes nothing."""
        owner = request.scope.get("state", {}).get("crabd_owner")
        return await asyncio.to_thread(preview_rollback, daemon, sid, checkpoint, owner)
