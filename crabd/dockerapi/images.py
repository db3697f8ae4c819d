"""The Docker API's image routes: crabd's images under Docker's names and
ids; `docker pull` imports an image from a local Docker engine.
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any

from ..errors import CrabdError, InvalidArgument, NotFound
from ..images import validate_name
from . import shapes
from .wire import DockerError, Reply, Request

if TYPE_CHECKING:
    from .engine import DockerEngine


def image_json(img: Any) -> dict[str, Any]:
    return {"Id": shapes.image_id(img.name), "RepoTags": [f"{img.name}:latest"], "RepoDigests": [],
            "Parent": "", "Comment": f"crabd image ({img.source})", "Created": shapes.rfc3339(img.created_at),
            "Container": "", "DockerVersion": "", "Author": "", "Architecture": "amd64", "Os": "linux",
            "Size": img.size_bytes, "VirtualSize": img.size_bytes,
            "Config": {"Env": list(img.env), "WorkingDir": "" if img.workdir == "/" else img.workdir,
                       "Cmd": None, "Entrypoint": None, "Labels": {}, "User": ""},
            "RootFS": {"Type": "layers", "Layers": []}, "Metadata": {"LastTagTime": "0001-01-01T00:00:00Z"}}


def find_image(engine: DockerEngine, ref: str) -> Any:
    """The crabd image a Docker reference names (a name, or a prefix of its id)."""
    name = shapes.image_name(ref)
    try:
        return engine.images.get(validate_name(name))
    except (NotFound, InvalidArgument):
        pass
    bare = ref.removeprefix("sha256:")
    for img in engine.images.list():
        if len(bare) >= 4 and shapes.image_id(img.name).removeprefix("sha256:").startswith(bare):
            return img
    raise DockerError(404, f"No such image: {ref}")


def add_routes(engine: DockerEngine) -> None:
    r = engine.router

    @r.route("GET", "/images/json")
    async def images_list(req: Request) -> Reply:
        out = []
        for img in await asyncio.to_thread(engine.images.list):
            out.append({"Id": shapes.image_id(img.name), "ParentId": "", "RepoTags": [f"{img.name}:latest"],
                        "RepoDigests": [], "Created": int(img.created_at), "Size": img.size_bytes,
                        "VirtualSize": img.size_bytes, "SharedSize": -1, "Labels": {}, "Containers": -1})
        return Reply.json(out)

    @r.route("GET", "/images/{ref*}/json")
    async def image_inspect(req: Request) -> Reply:
        return Reply.json(image_json(await asyncio.to_thread(find_image, engine, req.params["ref"])))

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
        if not engine.images.exists(name):
            try:
                await asyncio.to_thread(engine.images.import_docker, full, name)
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
