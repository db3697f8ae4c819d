"""Integrity seals of checkpoints: made at commit, checked before use.

Part of `crabd.daemon`; a collaborator of the daemon holding the snapshot
store, the metadata store and the CRIU image store. The store calls
`seal_row` while it commits a checkpoint (`Store.sealer`): the seals of its
snapshot (`deltafs.seal`) and of its process image (the manifest digest) go
into the row, which the store's keyed digest covers. `verify` runs before a
rollback, fork, diff or standby uses a checkpoint: nothing of a tampered one
is mounted or deserialized.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from ..errors import NotFound
from ..store import CheckpointRow, Store
from .names import is_image_snapshot

log = logging.getLogger("crabd")

__all__ = ["Integrity"]


class Integrity:
    def __init__(self, fs: Any, store: Store, images: Any) -> None:
        self.fs = fs            # the deltafs snapshotter
        self.store = store
        self.images = images    # deltacr.ImageStore
        self._lock = threading.Lock()
        self._img_seals: dict[str, dict[str, Any]] = {}  # image snapshot -> its seal, made once per daemon
        self._img_verified: set[str] = set()  # overlay image snapshots whose seal was checked

    def seal_row(self, row: CheckpointRow) -> dict[str, Any] | None:
        """Seals of a checkpoint being committed (the store calls this): its
        snapshot's (deltafs.seal) and its process image's manifest digest.
        What it shares with its parent (a SKIP turn, an FS turn's inherited
        image, a fork's initial state) keeps the parent's seal: sealed once,
        when first committed."""
        from deltafs.seal import seal
        parent = None
        if row.parent:
            try:
                parent = self.store.get_checkpoint(row.parent)
            except NotFound:
                parent = None
        ps = (parent.seals or {}) if parent is not None else {}
        out: dict[str, Any] = {}
        if row.fs_snapshot:
            if parent is not None and parent.fs_snapshot == row.fs_snapshot and "fs" in ps:
                out["fs"] = ps["fs"]
            elif is_image_snapshot(row.fs_snapshot):
                out["fs"] = self.image_seal(row.fs_snapshot)
            else:
                out["fs"] = seal(self.fs, row.fs_snapshot)
        if row.proc_image:
            if parent is not None and parent.proc_image == row.proc_image and "proc" in ps:
                out["proc"] = ps["proc"]
            else:
                out["proc"] = self.images.manifest(row.proc_image).digest
        return out or None

    def image_seal(self, name: str) -> dict[str, Any]:
        """The seal of an image snapshot: made once per daemon (an overlay
        image layer is the whole image: hashing it takes a while)."""
        from deltafs.seal import seal
        with self._lock:
            cached = self._img_seals.get(name)
        if cached is None:
            cached = seal(self.fs, name)
            with self._lock:
                cached = self._img_seals.setdefault(name, cached)
        return cached

    def verify(self, ck: CheckpointRow, processes: bool = True) -> None:
        """Refuse a checkpoint whose row, layer(s) or process image changed
        since its commit (IntegrityError naming it). The row's keyed digest
        first (it covers the seals); then its snapshot's seal -- on overlay,
        every ancestor's too, as their layers are the lower layers of its
        mount; then (`processes`) its process image: the manifest digest
        against the seal and every chunk against its content key. Nothing
        of an image is deserialized before this passed. Checkpoints from
        before seals existed (no `seals`) are checked by digest only."""
        from deltacr.errors import DeltacrError
        from deltafs.seal import SealBroken, check_seal
        from ..store import IntegrityError
        fix = (f"the checkpoint's stored state was modified outside crabd: roll back to or fork another "
               f"checkpoint (GET /v1/sandboxes/{ck.sandbox_id}/checkpoints), and delete {ck.id}")
        self.store.verify(ck)
        line = [ck]
        if self.fs.driver == "overlay":
            cid, seen = ck.parent, {ck.id}
            while cid and cid not in seen:
                seen.add(cid)
                try:
                    c = self.store.get_checkpoint(cid)
                except NotFound:
                    break  # retired: its layer is covered no more (README)
                if c.state == "committed":
                    try:
                        self.store.verify(c)
                    except IntegrityError as e:
                        raise IntegrityError(f"checkpoint {ck.id}: its ancestor {c.id} is tampered: {e.message}",
                                             fix=fix) from None
                    line.append(c)
                cid = c.parent
        checked: set[str] = set()
        for c in line:
            seal = (c.seals or {}).get("fs")
            if not c.fs_snapshot or seal is None or c.fs_snapshot in checked:
                continue
            checked.add(c.fs_snapshot)
            img = self.fs.driver == "overlay" and is_image_snapshot(c.fs_snapshot)
            if img and c.fs_snapshot in self._img_verified:
                continue  # a whole image layer: hashed once per daemon (README)
            try:
                res = check_seal(self.fs, c.fs_snapshot, seal)
            except SealBroken as e:
                raise IntegrityError(f"checkpoint {ck.id}: its files are not what was committed: {e}",
                                     fix=fix) from None
            if res != "ok":
                log.info("checkpoint %s: %s", ck.id, res)
            elif img:
                self._img_verified.add(c.fs_snapshot)
        seal = (ck.seals or {}).get("proc")
        if processes and ck.proc_image and seal is not None:
            try:
                m = self.images.manifest(ck.proc_image)
                if m.digest != seal:
                    raise IntegrityError(f"checkpoint {ck.id}: its process image {ck.proc_image} is not the one "
                                         f"committed (manifest digest differs)", fix=fix)
                self.images.verify(ck.proc_image)
            except DeltacrError as e:
                raise IntegrityError(f"checkpoint {ck.id}: its process image is damaged: {e}", fix=fix) from None
