"""Push a checkpoint to an OCI registry; create a sandbox from one pulled back.

Part of `crabd.remote`; runs in the daemon's worker threads (the API awaits
it through `asyncio.to_thread`) and uses the daemon's parts: the snapshot
store, the CRIU image store, the metadata store and the runtime.

The artifact (media types in `crabd.remote.__init__`): an OCI image manifest
whose `config` is crabd's own JSON (the checkpoint row: turn, plan, reasons,
Effects, seals; the sandbox's image name and limits; the digest of the
parent checkpoint's manifest when it was pushed before; the layer list and
the CRIU image's chunk index) and whose `layers` are

* the file-system chain of the checkpoint's snapshot, root first: one
  tar+zstd per committed snapshot on it, each the delta against the one
  below (`layers.py`); the root one holds the image's files;
* the CRIU image's chunks (deltacr's zstandard frames, de-duplicated by
  blake3), packed into blobs of at most PACK_BYTES.

A layer is the diff of its snapshot against the one below (`layer_diff`):
the lower one's tree is kept from its own push or scan (a migration's
pre-copy scans it while the sandbox runs), and the new one is looked at only
where the snapshot store says it may differ (btrfs: the paths `btrfs send
--no-data` names; `Snapshotter.diff_from`), not scanned whole.

Incremental both ways. Push: a snapshot's layer digest is remembered per
snapshot (committed snapshots never change) and a chunk's pack per chunk
key, so pushing turn N after N-1 writes only N's layer and the packs of
chunks N-1 lacked; every blob the registry already has (HEAD) is skipped.
Pull: the layers of a chain are imported as committed snapshots named by a
hash of the chain up to them (`img-rmt-<hash>`, so the daemon keeps them like
image snapshots), and chunks the local CRIU store has are not unpacked.

Nothing half-imported: every blob is downloaded and checked against its
digest (and every layer's member names checked) before the first snapshot
is made; a failure while applying removes what that layer began. A push
writes the manifest last: a registry gone mid-push leaves only unreferenced
blobs there and nothing changed here.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import deltafs
from deltafs import mount_all, unmount
from deltafs.snapshotter import chaos_point
from deltafs.tree import diff_entries

from ..errors import CrabdError, FailedPrecondition, IntegrityError, InvalidArgument, NotFound
from . import CONFIG_TYPE, FS_LAYER_TYPE, MANIFEST_TYPE, ARTIFACT_TYPE, PROC_PACK_TYPE
from .layers import apply_layer, layer_members, member_paths, write_layer
from .oci import Reference, Registry, parse_reference, sha256_file

__all__ = ["push_checkpoint", "pull_sandbox", "gc_imported", "snapshot_tree", "layer_diff", "PACK_BYTES", "IMPORTED_PREFIX"]

PACK_BYTES = 16 << 20
IMPORTED_PREFIX = "img-rmt-"  # an image-like snapshot: the daemon never drops it with a sandbox
_pull_lock = threading.Lock()


class _Memo:
    """A small JSON map in the state directory (what was pushed: layer per
    snapshot, pack per chunk, manifest per checkpoint); written atomically."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.data: dict[str, Any] = json.loads(path.read_text())
        except (FileNotFoundError, ValueError):
            self.data = {}

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data))
        os.replace(tmp, self.path)


def _registry(ref: Reference, auth: str | None, insecure: bool) -> Registry:
    return Registry(ref.host, auth=auth, insecure=insecure)


def _fs_chain(fs: Any, name: str) -> list[str]:
    """Committed snapshots from the root to `name` (its deltafs parents)."""
    chain = [name]
    while True:
        parent = fs.stat(chain[-1]).parent
        if parent is None:
            return list(reversed(chain))
        chain.append(parent)


_trees: dict[tuple[int, str, float], Any] = {}
_trees_lock = threading.Lock()
TREES_KEPT = 2


def snapshot_tree(fs: Any, name: str) -> Any:
    """`fs.tree(name)`, the last few kept: a committed snapshot never changes,
    and a migration's frozen push diffs its new snapshot against the one its
    pre-copy scanned while the sandbox ran (a full scan of an image's tree
    saved from the downtime)."""
    key = (id(fs), name, fs.stat(name).created)
    with _trees_lock:
        hit = _trees.get(key)
    if hit is not None:
        return hit
    tree = fs.tree(name)
    _remember(fs, name, tree)
    return tree


def layer_diff(fs: Any, prev: str | None, name: str) -> tuple[list[Any], dict[bytes, Any]]:
    """(changes, tree of `name`) from committed `prev` to committed `name`.
    `prev`'s tree comes from the cache (a migration scanned it during its
    pre-copy); `name`'s is then looked at only where the driver says it may
    differ (`Snapshotter.diff_from`: on btrfs the paths `btrfs send
    --no-data` names, no scan of the whole tree), and kept for the next."""
    if prev is None:
        tree = snapshot_tree(fs, name)
        return diff_entries({}, tree), tree
    changes, tree = fs.diff_from(prev, snapshot_tree(fs, prev), name)
    _remember(fs, name, tree)
    return changes, tree


def _remember(fs: Any, name: str, tree: Any) -> None:
    key = (id(fs), name, fs.stat(name).created)
    with _trees_lock:
        _trees[key] = tree
        while len(_trees) > TREES_KEPT:
            _trees.pop(next(iter(_trees)))


def _unmount_all(target: str) -> None:
    """Unmount everything stacked on `target` (a spec list may mount more than one layer there)."""
    for _ in range(8):
        if not deltafs.is_mountpoint(target):
            return
        unmount(target)


class _View:
    """A read-only mount of a committed snapshot (a deltafs view, removed after)."""

    def __init__(self, fs: Any, name: str, under: Path) -> None:
        from ..daemon.names import new_import_key
        self.fs, self.name = fs, name
        self.key = new_import_key("remote")
        self.dir = tempfile.mkdtemp(prefix="crabd-import-", dir=under)

    def __enter__(self) -> str:
        mount_all(self.fs.view(self.key, self.name), self.dir)
        return self.dir

    def __exit__(self, *exc: object) -> None:
        try:
            _unmount_all(self.dir)
        finally:
            try:
                self.fs.remove(self.key)
            finally:
                os.rmdir(self.dir)


def _work_dir(daemon: Any) -> Path:
    d = Path(daemon.state_dir) / "remote" / "tmp"
    d.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="xfer-", dir=d))


# ---- push ---------------------------------------------------------------------------------
def push_checkpoint(daemon: Any, cid: str, ref_text: str, *, auth: str | None = None,
                    insecure: bool = False) -> dict[str, Any]:
    """Push checkpoint `cid` to `ref_text` (host/repo:tag); returns what was sent and skipped."""
    t0 = time.monotonic()
    ref = parse_reference(ref_text)
    if ref.digest:
        raise InvalidArgument("a push names a tag, not a digest", fix="drop the @sha256:... part")
    timing: dict[str, float] = {}

    def lap(step: str, since: float) -> None:
        timing[step] = timing.get(step, 0.0) + time.monotonic() - since

    ck = daemon.store.get_checkpoint(cid)
    daemon._require_files(ck)
    tp = time.monotonic()
    daemon.integrity.verify(ck)
    lap("verify", tp)
    sb = daemon.store.get_sandbox(ck.sandbox_id)
    memo_dir = Path(daemon.state_dir) / "remote"
    layers_memo = _Memo(memo_dir / "pushed-layers.json")
    packs_memo = _Memo(memo_dir / "pushed-chunks.json")
    manifests_memo = _Memo(memo_dir / "pushed-manifests.json")
    pack_sizes = _Memo(memo_dir / "pushed-packs.json")
    work = _work_dir(daemon)
    stats = {"blobs_pushed": 0, "blobs_skipped": 0, "bytes_pushed": 0, "bytes_total": 0}
    try:
        with _registry(ref, auth, insecure) as reg:
            have: dict[str, bool] = {}

            def registry_has(digest: str) -> bool:
                if digest not in have:
                    have[digest] = reg.has_blob(ref.repository, digest)
                return have[digest]

            def upload(path: str, digest: str, size: int) -> None:
                stats["bytes_total"] += size
                tp = time.monotonic()
                try:
                    if registry_has(digest):
                        stats["blobs_skipped"] += 1
                        return
                    reg.push_blob(ref.repository, path, digest, size)
                finally:
                    lap("upload", tp)
                have[digest] = True
                stats["blobs_pushed"] += 1
                stats["bytes_pushed"] += size

            fs_layers = []
            chain = _fs_chain(daemon.fs, ck.fs_snapshot)
            prev: str | None = None
            prev_key = ""
            for name in chain:
                # The layer is a delta against `prev`: a retention that removes
                # a snapshot reparents its child, whose layer then differs.
                key = hashlib.sha256(f"{name}@{daemon.fs.stat(name).created}<-{prev_key}".encode()).hexdigest()[:40]
                known = layers_memo.data.get(key)
                if known and registry_has(known["digest"]):
                    stats["blobs_skipped"] += 1
                    stats["bytes_total"] += known["size"]
                    fs_layers.append(known)
                else:
                    tp = time.monotonic()
                    changes, new_tree = layer_diff(daemon.fs, prev, name)
                    paths, whiteouts = member_paths(changes, new_tree)
                    lap("fs_diff", tp)
                    tp = time.monotonic()
                    with _View(daemon.fs, name, Path(daemon.state_dir)) as root:
                        lf = write_layer(root, paths, whiteouts, str(work))
                    lap("fs_layer", tp)
                    upload(lf.path, lf.digest, lf.size)
                    os.unlink(lf.path)
                    known = {"digest": lf.digest, "size": lf.size, "snapshot": name, "entries": lf.entries}
                    layers_memo.data[key] = known
                    layers_memo.save()
                    fs_layers.append(known)
                prev = name
                prev_key = key
            proc = None
            packs: list[dict[str, Any]] = []
            if ck.proc_image:
                tp = time.monotonic()
                proc, packs = _push_proc(daemon, ck.proc_image, packs_memo, pack_sizes, registry_has, upload, work)
                lap("proc", tp)  # its uploads included
            chaos_point("remote_push")  # CRABD_CHAOS: a registry killed between the blobs and the manifest
            parent_digest = manifests_memo.data.get(ck.parent or "", {}).get("digest")
            config = {
                "crabd": 1,
                "checkpoint": {k: getattr(ck, k) for k in ("id", "seq", "turn", "branch", "plan", "reasons",
                                                           "effects", "created_at", "seals", "bytes")},
                "sandbox": {"id": sb.id, "name": sb.name, "image": sb.image, "limits": sb.limits,
                            "lineage": sb.lineage},
                "image": sb.image,
                "parent_digest": parent_digest,
                "fs": {"layers": [x["digest"] for x in fs_layers]},
                "proc": proc,
            }
            raw = json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
            cfg_digest = "sha256:" + hashlib.sha256(raw).hexdigest()
            stats["bytes_total"] += len(raw)
            if not registry_has(cfg_digest):
                reg.push_bytes(ref.repository, raw)
                stats["blobs_pushed"] += 1
                stats["bytes_pushed"] += len(raw)
            manifest = {
                "schemaVersion": 2,
                "mediaType": MANIFEST_TYPE,
                "artifactType": ARTIFACT_TYPE,
                "config": {"mediaType": CONFIG_TYPE, "digest": cfg_digest, "size": len(raw)},
                "layers": [{"mediaType": FS_LAYER_TYPE, "digest": x["digest"], "size": x["size"]} for x in fs_layers]
                + [{"mediaType": PROC_PACK_TYPE, "digest": p["digest"], "size": p["size"]} for p in packs],
                "annotations": {"dev.crabd.checkpoint": ck.id, "dev.crabd.turn": str(ck.turn),
                                "dev.crabd.image": sb.image,
                                "org.opencontainers.image.created": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                  time.gmtime(ck.created_at))},
            }
            tp = time.monotonic()
            digest = reg.put_manifest(ref, manifest)
            lap("manifest", tp)
            stats["bytes_pushed"] += len(json.dumps(manifest, sort_keys=True, separators=(",", ":")))
        manifests_memo.data[ck.id] = {"digest": digest, "ref": str(ref)}
        manifests_memo.save()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"checkpoint": ck.id, "reference": str(ref), "digest": digest,
            "pinned": str(ref.with_digest(digest)), "fs_layers": len(fs_layers), "proc_packs": len(packs),
            **stats, "timing_ms": {k: round(v * 1000, 3) for k, v in timing.items()},
            "duration_ms": round((time.monotonic() - t0) * 1000, 3)}


def _push_proc(daemon: Any, image_id: str, memo: _Memo, pack_memo: _Memo, registry_has: Any, upload: Any,
               work: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Pack the image's chunks the registry lacks; return (the config's proc part, every pack it names)."""
    images = daemon.images
    m = images.manifest(image_id)
    doc = {**m.body(), "digest": m.digest}  # the signed document, as the receiving store checks it
    keys = list(dict.fromkeys(k for f in m.files for k, _ in f.chunks))
    index: dict[str, list[Any]] = {}
    missing: list[str] = []
    for k in keys:
        at = memo.data.get(k)
        if at is not None and at[0] in pack_memo.data and registry_has(at[0]):
            index[k] = at
        else:
            missing.append(k)
    cur: list[tuple[str, bytes]] = []
    cur_size = 0

    def flush() -> None:
        nonlocal cur, cur_size
        if not cur:
            return
        path = work / f"pack-{secrets.token_hex(4)}"
        off = 0
        spans = []
        with open(path, "wb") as f:
            for k, frame in cur:
                f.write(frame)
                spans.append((k, off, len(frame)))
                off += len(frame)
        digest, size = sha256_file(path)
        upload(str(path), digest, size)
        pack_memo.data[digest] = size
        pack_memo.save()
        path.unlink()
        for k, o, n in spans:
            index[k] = [digest, o, n]
            memo.data[k] = [digest, o, n]
        cur, cur_size = [], 0

    for k in missing:
        frame = images.chunk_frame(k)
        if cur_size + len(frame) > PACK_BYTES:
            flush()
        cur.append((k, frame))
        cur_size += len(frame)
    flush()
    memo.save()
    sizes = pack_memo.data
    packs = [{"digest": d, "size": sizes[d]} for d in dict.fromkeys(v[0] for v in index.values())]
    return {"manifest": doc, "chunks": index, "packs": [p["digest"] for p in packs]}, packs


# ---- pull ---------------------------------------------------------------------------------
def _chain_names(digests: list[str]) -> list[str]:
    """Snapshot names of an imported layer chain: each a hash of the digests up to it."""
    out = []
    h = hashlib.sha256()
    for d in digests:
        h.update(d.encode() + b"\n")
        out.append(IMPORTED_PREFIX + h.copy().hexdigest()[:40])
    return out


def _fetch(reg: Registry, repo: str, digest: str, size: int | None, work: Path) -> str:
    path = work / digest.replace(":", "-")
    with open(path, "wb") as f:
        reg.pull_blob(repo, digest, f, size)
    return str(path)


def pull_sandbox(daemon: Any, ref_text: str, *, name: str | None = None, owner: str = "",
                 auth: str | None = None, insecure: bool = False, processes: bool = True,
                 prefetch: bool = False) -> dict[str, Any]:
    """Create a sandbox from the checkpoint artifact at `ref_text`: its files,
    and its processes restored by CRIU (unless `processes` is False).
    `prefetch`: import its layers and chunks only, no sandbox (a migration's
    pre-copy: the pull after the freeze then fetches only the delta; the
    layers stay until the next collection finds nothing on them)."""
    from ..runtime import Limits
    from ..store import CheckpointRow

    t0 = time.monotonic()
    ref = parse_reference(ref_text)
    work = _work_dir(daemon)
    timing: dict[str, float] = {}
    try:
        with _registry(ref, auth, insecure) as reg:
            manifest, mdigest = reg.get_manifest(ref, MANIFEST_TYPE)
            cfg_desc = manifest.get("config") or {}
            if manifest.get("artifactType") != ARTIFACT_TYPE and cfg_desc.get("mediaType") != CONFIG_TYPE:
                raise InvalidArgument(f"{ref} is not a crabd checkpoint (artifactType "
                                      f"{manifest.get('artifactType')!r})", fix="push one with `crabd checkpoint push`")
            raw = reg.pull_small(ref.repository, cfg_desc["digest"])
            if len(raw) != cfg_desc.get("size", len(raw)):
                raise IntegrityError(f"config of {ref} has the wrong size")
            config = json.loads(raw)
            layer_descs = [x for x in manifest.get("layers", []) if x.get("mediaType") == FS_LAYER_TYPE]
            pack_descs = {x["digest"]: x for x in manifest.get("layers", []) if x.get("mediaType") == PROC_PACK_TYPE}
            digests = [x["digest"] for x in layer_descs]
            if digests != config["fs"]["layers"]:
                raise IntegrityError(f"{ref}: the manifest's layers are not the config's")
            image = config["image"]
            try:
                img = daemon.runtime.images.get(image)
            except NotFound:
                raise FailedPrecondition(f"the checkpoint at {ref} runs image {image!r}, which this daemon lacks "
                                         "(its env and working directory come from there)",
                                         fix=f"import image {image} on this host first (crabd image import)") from None
            del img
            names = _chain_names(digests)
            start = 0
            for i in range(len(names) - 1, -1, -1):
                try:
                    daemon.fs.stat(names[i])
                    start = i + 1
                    break
                except deltafs.NotFound:
                    continue
            # Everything is downloaded and checked before anything is imported.
            t = time.monotonic()
            files = []
            for desc in layer_descs[start:]:
                path = _fetch(reg, ref.repository, desc["digest"], desc.get("size"), work)
                layer_members(path)  # names checked now, not halfway through an apply
                files.append(path)
            proc = config.get("proc") if processes else None
            frames: dict[str, tuple[str, int, int]] = {}
            pack_files: dict[str, str] = {}
            lengths: dict[str, int] = {}
            if proc:
                for f in proc["manifest"]["files"]:
                    for k, n in f["chunks"]:
                        lengths[k] = int(n)
                have = daemon.images.root / "chunks"
                for k, (d, o, n) in proc["chunks"].items():
                    if (have / k[:2] / k).exists():
                        continue
                    if d not in pack_descs:
                        raise IntegrityError(f"{ref}: chunk {k[:16]}... lies in a pack the manifest does not list")
                    if d not in pack_files:
                        pack_files[d] = _fetch(reg, ref.repository, d, pack_descs[d].get("size"), work)
                    frames[k] = (pack_files[d], int(o), int(n))
            timing["download"] = time.monotonic() - t
        src = config["checkpoint"]
        origin = str(ref.with_digest(mdigest))
        # Held until the new sandbox's root stacks on the imported chain: the
        # GC of imported layers (gc_imported) takes it too.
        with _pull_lock:
            t = time.monotonic()
            top = _import_layers(daemon, names, start, files, work)
            timing["fs"] = time.monotonic() - t
            if prefetch:
                from deltacr.errors import DeltacrError
                try:
                    _import_chunks(daemon, frames, lengths)
                except DeltacrError as e:
                    raise IntegrityError(f"chunks of {mdigest}: {e}", fix="the registry's copy is corrupt or was "
                                         "tampered with: push the checkpoint again") from None
                return {"prefetched": origin, "checkpoint": src["id"], "fs_layers_imported": len(files),
                        "fs_layers_reused": start, "chunks_imported": len(frames), "packs_pulled": len(pack_files),
                        "duration_ms": round((time.monotonic() - t0) * 1000, 3)}
            t = time.monotonic()
            image_id = _import_proc(daemon, proc, frames, lengths, mdigest) if proc else None
            timing["proc_import"] = time.monotonic() - t
            base = CheckpointRow(id=origin, sandbox_id=config["sandbox"]["id"], seq=src["seq"], parent=None,
                                 branch=0, turn=src["turn"], plan=src["plan"], state="committed", fs_snapshot=top,
                                 proc_image=image_id)
            chaos_point("remote_restore")  # CRABD_CHAOS: a target killed with everything imported, before the start
            t = time.monotonic()
            try:
                row = daemon._new_sandbox(image=image, name=name,
                                          limits=Limits.from_dict(config["sandbox"]["limits"]), owner=owner,
                                          parent_snapshot=top, base_checkpoint=base, lineage=None)
            except BaseException:
                if image_id:
                    daemon._drop_image_if_unused(image_id)
                _gc_imported_locked(daemon)  # a chain this pull imported for nothing
                raise
            timing["start"] = time.monotonic() - t
    finally:
        shutil.rmtree(work, ignore_errors=True)
    from ..daemon.plans import BLIND_RESTORED
    t_row = daemon.turns.get(row.id)
    restored = "fs+proc" if t_row is not None and t_row.blind == BLIND_RESTORED else "fs"
    try:
        live = daemon.runtime.get(row.id).status
    except CrabdError:
        live = "absent"
    return {"sandbox": row.id, "name": row.name, "from": origin, "checkpoint": src["id"], "turn": src["turn"],
            "image": image, "status": live, "restored": restored, "fs_layers_imported": len(files),
            "fs_layers_reused": start, "packs_pulled": len(pack_files),
            "timing_ms": {k: round(v * 1000, 3) for k, v in timing.items()},
            "duration_ms": round((time.monotonic() - t0) * 1000, 3)}


def _import_layers(daemon: Any, names: list[str], start: int, files: list[str], work: Path) -> str:
    from ..daemon.names import new_import_key
    fs = daemon.fs
    for i, path in zip(range(start, len(names)), files):
        try:
            fs.stat(names[i])
            continue  # imported meanwhile by another pull
        except deltafs.NotFound:
            pass
        key = new_import_key("remote")
        mounts = fs.prepare(key, parent=names[i - 1] if i else None)
        mnt = tempfile.mkdtemp(prefix="crabd-import-", dir=daemon.state_dir)
        try:
            mount_all(mounts, mnt)
            try:
                apply_layer(path, mnt)
            finally:
                _unmount_all(mnt)
            fs.commit(names[i], key)
            if i + 1 < len(names):
                chaos_point("remote_import")  # CRABD_CHAOS: a daemon killed with half a chain imported
        except BaseException:
            try:
                fs.remove(key)
            except Exception:
                pass
            raise
        finally:
            os.rmdir(mnt)
    return names[-1]


def _import_chunks(daemon: Any, frames: dict[str, tuple[str, int, int]], lengths: dict[str, int]) -> None:
    """Store the downloaded chunks (each checked against its blake3 key by the store)."""
    opened: dict[str, Any] = {}
    try:
        for k, (path, off, n) in frames.items():
            f = opened.get(path) or opened.setdefault(path, open(path, "rb"))
            f.seek(off)
            daemon.images.add_chunk_frame(k, f.read(n), lengths.get(k, 0))
    finally:
        for f in opened.values():
            f.close()


def _import_proc(daemon: Any, proc: dict[str, Any], frames: dict[str, tuple[str, int, int]],
                 lengths: dict[str, int], mdigest: str) -> str:
    from deltacr.errors import DeltacrError
    images = daemon.images
    image_id = f"rmt-{mdigest[7:19]}-{secrets.token_hex(4)}"
    try:
        _import_chunks(daemon, frames, lengths)
        images.adopt(image_id, proc["manifest"], meta={"imported_from": mdigest})
    except DeltacrError as e:
        raise IntegrityError(f"process image of {mdigest}: {e}",
                             fix="the registry's copy is corrupt or was tampered with: push the checkpoint again") from None
    return image_id


# ---- garbage collection -------------------------------------------------------------------
def gc_imported(daemon: Any, *, at_start: bool = False) -> list[str]:
    """Remove the imported layer snapshots (`img-rmt-*`) that nothing uses any
    more: no checkpoint row names them and no snapshot stacks on them (a
    pulled sandbox's root, its checkpoints, a standby). Called when a sandbox
    is destroyed and at daemon start; `at_start` also removes the work files
    of transfers cut short (no transfer runs then). A chain a killed pull left
    half-imported is named by nothing, so it goes at the next start."""
    if at_start:
        shutil.rmtree(Path(daemon.state_dir) / "remote" / "tmp", ignore_errors=True)
    with _pull_lock:
        return _gc_imported_locked(daemon)


def _gc_imported_locked(daemon: Any) -> list[str]:
    removed: list[str] = []
    while True:  # a layer's parent is free once the layer is gone: top down
        infos = list(daemon.fs.walk())
        parents = {i.parent for i in infos if i.parent}
        free = [i.name for i in infos if i.name.startswith(IMPORTED_PREFIX) and i.name not in parents
                and i.name not in removed and daemon.store.fs_snapshot_refs(i.name) == 0]
        if not free:
            return removed
        for name in free:
            try:
                daemon.fs.remove(name)
            except deltafs.NotFound:
                pass
            removed.append(name)
