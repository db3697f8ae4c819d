"""Where CRIU images live between a dump and a restore: compressed,
de-duplicated, integrity-checked.

Layout under the store directory:

    chunks/ab/<blake3 hex>     one zstandard frame: a piece of an image file
    manifests/<id>.json        one checkpoint: its files, their chunks, digests
    logs/<id>/                 CRIU's dump.log (and restore logs) of that checkpoint
    tmp/                       work in progress; anything here is garbage

A checkpoint's image is a directory of files. Memory (`pages-N.img`) is
cut into chunks along the page map (`pagemap-*.img`): every run of pages
is cut at 64 KiB boundaries of its *virtual address*, so a page that changes
changes one chunk and a region that appears or goes away shifts no other
chunk -- an unchanged heap is stored once across checkpoints. Other files
(small metadata images) are stored whole, in 64 KiB chunks when large.
Chunks are keyed by the blake3 of their raw content; the manifest records
each file's blake3 and size, and its own digest over its canonical body.

Every write goes to tmp/ first and is renamed into place when complete, so
a crash leaves garbage, never a half-written chunk or manifest. `get`
checks the manifest's digest, every chunk's key and every file's digest
while it writes the image out, and removes what it wrote on any mismatch:
a corrupted image raises ImageCorrupted naming the checkpoint and never
reaches a restore. `gc` deletes chunks no manifest names.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import blake3
import zstandard

from .errors import AlreadyExists, ImageCorrupted, InvalidArgument, NotFound

__all__ = ["ImageStore", "Manifest", "FileEntry", "StoreStats", "chunk_spans", "parse_pagemap", "linked_remaps", "CHUNK_SIZE"]

CHUNK_SIZE = 64 * 1024
PAGE_SIZE = 4096
MANIFEST_VERSION = 1
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@:+=-]{0,200}$")
_HEX = re.compile(r"^[0-9a-f]{64}$")
_PE_PARENT = 1 << 0
_PE_PRESENT = 1 << 2


@dataclass(frozen=True)
class FileEntry:
    name: str
    size: int
    mode: int
    digest: str                          # blake3 of the whole file
    chunks: tuple[tuple[str, int], ...]  # (blake3 of the raw chunk, its length)


@dataclass(frozen=True)
class Manifest:
    checkpoint_id: str
    created: float
    files: tuple[FileEntry, ...]
    meta: dict  # type: ignore[type-arg]  # caller's data (options, sandbox, timings)
    digest: str  # blake3 over the canonical body
    # Bytes this checkpoint's `put` added to the store: its new (compressed)
    # chunks plus its manifest; chunks shared with earlier images cost
    # nothing. Kept in the manifest file beside the digest, not in the body:
    # an accounting figure, not state (a crabd restarted before sizing a
    # checkpoint reads it back); 0 for a manifest written without it.
    written: int = field(default=0, compare=False)

    @property
    def raw_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def chunk_keys(self) -> set[str]:
        return {k for f in self.files for k, _ in f.chunks}

    def body(self) -> dict:  # type: ignore[type-arg]
        return {"version": MANIFEST_VERSION, "checkpoint_id": self.checkpoint_id, "created": self.created,
                "meta": self.meta,
                "files": [{"name": f.name, "size": f.size, "mode": f.mode, "digest": f.digest,
                           "chunks": [list(c) for c in f.chunks]} for f in self.files]}

    @staticmethod
    def digest_of(body: dict) -> str:  # type: ignore[type-arg]
        return blake3.blake3(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass(frozen=True)
class StoreStats:
    checkpoints: int
    chunks: int
    stored_bytes: int   # compressed chunk bytes on disk
    raw_bytes: int      # sum of all checkpoints' image sizes


# --- pure chunking -------------------------------------------------------------------------------
def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        if i >= len(buf):
            raise ValueError("truncated varint")
        b = buf[i]
        i += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, i
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def _fields(msg: bytes) -> dict[int, int]:
    """Varint fields of a protobuf message (all a pagemap entry has)."""
    out: dict[int, int] = {}
    i = 0
    while i < len(msg):
        key, i = _varint(msg, i)
        num, wt = key >> 3, key & 7
        if wt == 0:
            out[num], i = _varint(msg, i)
        elif wt == 2:
            ln, i = _varint(msg, i)
            i += ln
        elif wt == 5:
            i += 4
        elif wt == 1:
            i += 8
        else:
            raise ValueError(f"unsupported wire type {wt}")
    return out


def _message(msg: bytes) -> dict[int, list[Any]]:
    """Every field of a protobuf message: varints and fixed as int,
    length-delimited as bytes (nested messages: parse them again)."""
    out: dict[int, list[Any]] = {}
    i = 0
    while i < len(msg):
        key, i = _varint(msg, i)
        num, wt = key >> 3, key & 7
        v: Any
        if wt == 0:
            v, i = _varint(msg, i)
        elif wt == 2:
            ln, i = _varint(msg, i)
            v, i = msg[i:i + ln], i + ln
        elif wt in (1, 5):
            n = 8 if wt == 1 else 4
            v, i = int.from_bytes(msg[i:i + n], "little"), i + n
        else:
            raise ValueError(f"unsupported wire type {wt}")
        out.setdefault(num, []).append(v)
    return out


def _image_entries(data: bytes) -> list[dict[int, list[Any]]]:
    """The entries of a CRIU image file: two magics, then size-prefixed messages."""
    i, out = 8, []
    while i + 4 <= len(data):
        (ln,) = struct.unpack_from("<I", data, i)
        out.append(_message(data[i + 4:i + 4 + ln]))
        i += 4 + ln
    return out


_REMAP_LINKED = 0  # RemapType.LINKED, CRIU's images/remap-file-path.proto


def linked_remaps(image_dir: str | os.PathLike[str]) -> dict[str, str]:
    """{old name: link name} of the files an image holds through CRIU's
    --link-remap (an open file whose name was unlinked, reopened on restore
    through a hard link CRIU made next to it), both as the dumped tasks saw
    them: remap-fpath.img's LINKED entries, their names from files.img."""
    d = Path(image_dir)
    try:
        remaps = _image_entries((d / "remap-fpath.img").read_bytes())
        files = _image_entries((d / "files.img").read_bytes())
    except FileNotFoundError:
        return {}
    names: dict[int, str] = {}
    for fe in files:
        for reg in fe.get(3, []):           # FileEntry.reg
            r = _message(reg)
            if r.get(1) and r.get(6):       # RegFileEntry.id, .name
                names[r[1][0]] = r[6][0].decode(errors="surrogateescape")
    out: dict[str, str] = {}
    for rp in remaps:                       # RemapFilePathEntry: orig_id, remap_id, remap_type
        orig, remap = rp.get(1, [None])[0], rp.get(2, [None])[0]
        if rp.get(3, [_REMAP_LINKED])[0] == _REMAP_LINKED and orig in names and remap in names:
            out[names[orig]] = names[remap]
    return out


def parse_pagemap(data: bytes) -> tuple[int, list[tuple[int, int]]]:
    """(pages_id, [(vaddr, nr_pages) of runs stored in pages-<id>.img, in file order]).
    Pure; raises ValueError on anything it does not understand."""
    i = 8  # CRIU image magics
    head = True
    pages_id = -1
    runs: list[tuple[int, int]] = []
    while i < len(data):
        if i + 4 > len(data):
            raise ValueError("truncated entry size")
        (ln,) = struct.unpack_from("<I", data, i)
        i += 4
        msg = data[i:i + ln]
        if len(msg) != ln:
            raise ValueError("truncated entry")
        i += ln
        f = _fields(msg)
        if head:
            pages_id = f.get(1, -1)
            head = False
            continue
        vaddr, nr = f.get(1, 0), f.get(2, 0)
        flags = f.get(4)
        if flags is None:
            present = not f.get(3, 0)
        else:
            present = bool(flags & _PE_PRESENT) and not flags & _PE_PARENT
        if present and nr:
            runs.append((vaddr, nr))
    if pages_id < 0:
        raise ValueError("no pagemap head")
    return pages_id, runs


def chunk_spans(size: int, runs: list[tuple[int, int]] | None = None,
                chunk: int = CHUNK_SIZE) -> list[tuple[int, int]]:
    """(offset, length) pieces of a file of `size` bytes. With `runs` (a
    pages image's page runs) pieces end at `chunk`-aligned virtual
    addresses and at run boundaries; otherwise fixed `chunk`-sized pieces.
    Pure."""
    spans: list[tuple[int, int]] = []
    if runs is not None and sum(n for _, n in runs) * PAGE_SIZE == size:
        off = 0
        for vaddr, nr in runs:
            end_va = vaddr + nr * PAGE_SIZE
            va = vaddr
            while va < end_va:
                nxt = min(end_va, (va // chunk + 1) * chunk)
                spans.append((off, nxt - va))
                off += nxt - va
                va = nxt
        return spans
    off = 0
    while off < size:
        spans.append((off, min(chunk, size - off)))
        off += chunk
    return spans


# --- the store -------------------------------------------------------------------------------------
class ImageStore:
    """Content-addressed, compressed store of CRIU image directories (see module doc)."""

    def __init__(self, root: str | os.PathLike[str], *, level: int = 3) -> None:
        self.root = Path(root)
        self.level = level
        for d in ("chunks", "manifests", "logs", "tmp"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    # paths
    def _chunk_path(self, key: str) -> Path:
        return self.root / "chunks" / key[:2] / key

    def _manifest_path(self, cid: str) -> Path:
        return self.root / "manifests" / f"{cid}.json"

    def log_dir(self, checkpoint_id: str) -> Path:
        """Where CRIU's logs of `checkpoint_id` are kept (next to its image)."""
        _check_id(checkpoint_id)
        return self.root / "logs" / checkpoint_id

    def tmpdir(self, prefix: str = "work-") -> Path:
        return Path(tempfile.mkdtemp(prefix=prefix, dir=self.root / "tmp"))

    # queries
    def exists(self, checkpoint_id: str) -> bool:
        _check_id(checkpoint_id)
        return self._manifest_path(checkpoint_id).is_file()

    def list(self) -> list[str]:
        return sorted(p.stem for p in (self.root / "manifests").glob("*.json"))

    def manifest(self, checkpoint_id: str) -> Manifest:
        _check_id(checkpoint_id)
        p = self._manifest_path(checkpoint_id)
        try:
            raw = p.read_bytes()
        except FileNotFoundError:
            raise NotFound(f"no process image for checkpoint {checkpoint_id!r}") from None
        try:
            doc = json.loads(raw)
            body = {k: doc[k] for k in ("version", "checkpoint_id", "created", "meta", "files")}
            if body["version"] != MANIFEST_VERSION or body["checkpoint_id"] != checkpoint_id:
                raise ValueError("wrong version or id")
            if Manifest.digest_of(body) != doc["digest"]:
                raise ValueError("manifest digest mismatch")
            files = tuple(FileEntry(f["name"], int(f["size"]), int(f["mode"]), f["digest"],
                                    tuple((str(k), int(n)) for k, n in f["chunks"])) for f in body["files"])
        except (ValueError, KeyError, TypeError) as e:
            raise ImageCorrupted(checkpoint_id, f"manifest {p}: {e}") from None
        for f in files:
            if not _safe_name(f.name) or any(not _HEX.match(k) for k, _ in f.chunks):
                raise ImageCorrupted(checkpoint_id, f"manifest {p}: bad entry {f.name!r}")
        chunk_bytes = doc.get("chunk_bytes")
        written = int(chunk_bytes) + len(raw) if isinstance(chunk_bytes, int) and chunk_bytes >= 0 else 0
        return Manifest(checkpoint_id, body["created"], files, body["meta"], doc["digest"], written=written)

    def stats(self) -> StoreStats:
        n = stored = 0
        for p in (self.root / "chunks").glob("*/*"):
            n += 1
            stored += p.stat().st_size
        ids = self.list()
        raw = 0
        for cid in ids:
            try:
                raw += self.manifest(cid).raw_bytes
            except ImageCorrupted:
                pass
        return StoreStats(len(ids), n, stored, raw)

    # writes
    def put(self, checkpoint_id: str, image_dir: str | os.PathLike[str], *, meta: dict | None = None,  # type: ignore[type-arg]
            logs: Sequence[str | os.PathLike[str]] = ()) -> Manifest:
        """Store the image in `image_dir` as `checkpoint_id`; copy `logs` next to it."""
        _check_id(checkpoint_id)
        image_dir = Path(image_dir)
        if self.exists(checkpoint_id):
            raise AlreadyExists(f"checkpoint {checkpoint_id!r} already has a process image")
        names = sorted(p.name for p in image_dir.iterdir() if p.is_file() and not p.is_symlink())
        runs_of: dict[str, list[tuple[int, int]]] = {}
        for n in names:
            if n.startswith("pagemap-") and n.endswith(".img"):
                try:
                    pid, runs = parse_pagemap((image_dir / n).read_bytes())
                    runs_of[f"pages-{pid}.img"] = runs
                except ValueError:
                    pass  # fixed-size chunks for its pages: still correct, less de-duplication
        cctx = zstandard.ZstdCompressor(level=self.level)
        files = []
        written = 0
        for n in names:
            p = image_dir / n
            st = p.stat()
            whole = blake3.blake3()
            chunks = []
            with open(p, "rb") as f:
                for off, ln in chunk_spans(st.st_size, runs_of.get(n)):
                    f.seek(off)
                    data = f.read(ln)
                    if len(data) != ln:
                        raise InvalidArgument(f"image file {p} changed while being stored")
                    whole.update(data)
                    key = blake3.blake3(data).hexdigest()
                    written += self._put_chunk(key, data, cctx)
                    chunks.append((key, ln))
            files.append(FileEntry(n, st.st_size, st.st_mode & 0o7777, whole.hexdigest(), tuple(chunks)))
        body_m = Manifest(checkpoint_id, time.time(), tuple(files), dict(meta or {}), "")
        body = body_m.body()
        digest = Manifest.digest_of(body)
        ld = self.log_dir(checkpoint_id)
        ld.mkdir(parents=True, exist_ok=True)
        for lg in logs:
            if os.path.isfile(lg):
                shutil.copyfile(lg, ld / os.path.basename(lg))
        doc = json.dumps({**body, "digest": digest, "chunk_bytes": written}).encode()
        _atomic_write(self._manifest_path(checkpoint_id), doc, self.root / "tmp")
        return Manifest(checkpoint_id, body["created"], tuple(files), body["meta"], digest,
                        written=written + len(doc))

    def _put_chunk(self, key: str, data: bytes, cctx: zstandard.ZstdCompressor) -> int:
        """Store one chunk unless the store has it; the bytes written."""
        p = self._chunk_path(key)
        if p.exists():
            # Refresh its age: a concurrent gc spares chunks younger than its
            # grace period, so one a put is about to reference survives.
            try:
                os.utime(p)
                return 0
            except FileNotFoundError:
                pass  # gc took it just now: write it again
        p.parent.mkdir(exist_ok=True)
        blob = cctx.compress(data)
        _atomic_write(p, blob, self.root / "tmp")
        return len(blob)

    # transfer (crabd.remote packs chunks into registry blobs and back)
    def chunk_frame(self, key: str) -> bytes:
        """A chunk as stored: one zstandard frame (what a transfer ships)."""
        if not _HEX.match(key):
            raise InvalidArgument(f"bad chunk key {key!r}")
        try:
            return self._chunk_path(key).read_bytes()
        except FileNotFoundError:
            raise NotFound(f"chunk {key[:16]}... is not in the store") from None

    def add_chunk_frame(self, key: str, frame: bytes, length: int) -> int:
        """Store a chunk received as a zstandard frame, after checking that it
        decodes to `length` bytes whose blake3 is `key`; the bytes written
        (0 when the store has it). Raises ImageCorrupted otherwise."""
        if not _HEX.match(key):
            raise InvalidArgument(f"bad chunk key {key!r}")
        try:
            data = zstandard.ZstdDecompressor().decompress(frame, max_output_size=max(length, 1))
        except zstandard.ZstdError as e:
            raise ImageCorrupted("(transfer)", f"chunk {key[:16]}... does not decode: {e}") from None
        if len(data) != length or blake3.blake3(data).hexdigest() != key:
            raise ImageCorrupted("(transfer)", f"chunk {key[:16]}... does not match its key")
        p = self._chunk_path(key)
        if p.exists():
            return 0
        p.parent.mkdir(exist_ok=True)
        _atomic_write(p, frame, self.root / "tmp")
        return len(frame)

    def adopt(self, checkpoint_id: str, doc: dict, *, meta: dict | None = None) -> Manifest:  # type: ignore[type-arg]
        """Store another store's manifest `doc` (checked against its own
        digest) as `checkpoint_id`; its chunks must be here already (see
        add_chunk_frame). The image is verified chunk by chunk before this
        returns; on a mismatch nothing stays."""
        _check_id(checkpoint_id)
        if self.exists(checkpoint_id):
            raise AlreadyExists(f"checkpoint {checkpoint_id!r} already has a process image")
        try:
            body = {k: doc[k] for k in ("version", "checkpoint_id", "created", "meta", "files")}
            ok = body["version"] == MANIFEST_VERSION and Manifest.digest_of(body) == doc["digest"]
        except (KeyError, TypeError) as e:
            raise ImageCorrupted(checkpoint_id, f"received manifest lacks {e}") from None
        if not ok:
            raise ImageCorrupted(checkpoint_id, "received manifest does not match its digest")
        body = {**body, "checkpoint_id": checkpoint_id, "meta": {**body["meta"], **(meta or {})}}
        raw = json.dumps({**body, "digest": Manifest.digest_of(body)}).encode()
        _atomic_write(self._manifest_path(checkpoint_id), raw, self.root / "tmp")
        try:
            return self.verify(checkpoint_id)
        except BaseException:
            self._manifest_path(checkpoint_id).unlink(missing_ok=True)
            raise

    def get(self, checkpoint_id: str, dest: str | os.PathLike[str]) -> Manifest:
        """Write the image into directory `dest`, checking every chunk and
        file digest on the way; only a fully verified image is returned.
        On any mismatch raises ImageCorrupted and removes what it wrote, so
        nothing of a corrupted image can reach a restore."""
        m = self.manifest(checkpoint_id)
        dctx = zstandard.ZstdDecompressor()
        dest = Path(dest)
        dest.mkdir(parents=True, exist_ok=True)
        written: list[Path] = []
        try:
            for f in m.files:
                path = dest / f.name
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                             f.mode & 0o777)
                written.append(path)
                h = blake3.blake3()
                total = 0
                with os.fdopen(fd, "wb") as out:
                    for data in self._file_chunks(m, f, dctx):
                        h.update(data)
                        total += len(data)
                        out.write(data)
                if total != f.size or h.hexdigest() != f.digest:
                    raise ImageCorrupted(checkpoint_id, f"file {f.name}: content does not match its digest")
        except BaseException:
            for path in written:
                path.unlink(missing_ok=True)
            raise
        return m

    def _file_chunks(self, m: Manifest, f: FileEntry, dctx: zstandard.ZstdDecompressor) -> Iterator[bytes]:
        """A file's chunks, each checked against its key."""
        for key, ln in f.chunks:
            p = self._chunk_path(key)
            try:
                data = dctx.decompress(p.read_bytes(), max_output_size=ln)
            except FileNotFoundError:
                raise ImageCorrupted(m.checkpoint_id, f"file {f.name}: chunk {key[:16]}... is missing") from None
            except zstandard.ZstdError as e:
                raise ImageCorrupted(m.checkpoint_id, f"file {f.name}: chunk {key[:16]}... does not decode: {e}") from None
            if len(data) != ln or blake3.blake3(data).hexdigest() != key:
                raise ImageCorrupted(m.checkpoint_id, f"file {f.name}: chunk {key[:16]}... does not match its key")
            yield data

    def verify(self, checkpoint_id: str) -> Manifest:
        """Check every chunk and file digest of a checkpoint without writing anything."""
        m = self.manifest(checkpoint_id)
        dctx = zstandard.ZstdDecompressor()
        for f in m.files:
            h = blake3.blake3()
            for data in self._file_chunks(m, f, dctx):
                h.update(data)
            if h.hexdigest() != f.digest:
                raise ImageCorrupted(checkpoint_id, f"file {f.name}: content does not match its digest")
        return m

    def remove(self, checkpoint_id: str) -> None:
        """Forget a checkpoint's image (its chunks go at the next gc)."""
        _check_id(checkpoint_id)
        try:
            self._manifest_path(checkpoint_id).unlink()
        except FileNotFoundError:
            raise NotFound(f"no process image for checkpoint {checkpoint_id!r}") from None
        shutil.rmtree(self.log_dir(checkpoint_id), ignore_errors=True)

    def gc(self, *, grace: float = 60.0) -> int:
        """Delete chunks no manifest names, and stale temp files; returns bytes freed.
        Chunks and temp files touched less than `grace` seconds ago are kept:
        a put in progress may be about to reference them."""
        with self._lock:
            live: set[str] = set()
            for cid in self.list():
                try:
                    live |= self.manifest(cid).chunk_keys()
                except ImageCorrupted:
                    # A corrupted manifest still pins what it names, when it can be read.
                    try:
                        doc = json.loads(self._manifest_path(cid).read_bytes())
                        live |= {str(k) for f in doc.get("files", []) for k, _ in f.get("chunks", [])}
                    except (ValueError, OSError, TypeError):
                        pass
            freed = 0
            now = time.time()
            for p in (self.root / "chunks").glob("*/*"):
                if p.name not in live:
                    try:
                        st = p.stat()
                        if now - st.st_mtime < grace:
                            continue  # maybe about to be referenced by a put in progress
                        p.unlink()
                        freed += st.st_size
                    except FileNotFoundError:
                        pass
            for p in (self.root / "tmp").iterdir():
                try:
                    if now - p.lstat().st_mtime >= grace:
                        if p.is_dir() and not p.is_symlink():
                            shutil.rmtree(p, ignore_errors=True)
                        else:
                            p.unlink()
                except FileNotFoundError:
                    pass
            return freed


def _check_id(cid: str) -> None:
    if not isinstance(cid, str) or not _ID.match(cid):
        raise InvalidArgument(f"checkpoint id {cid!r} is invalid: use 1-201 characters from [A-Za-z0-9._@:+=-], "
                              "starting with a letter or digit")


def _safe_name(name: str) -> bool:
    return bool(name) and "/" not in name and name not in (".", "..") and "\0" not in name


def _atomic_write(path: Path, data: bytes, tmp_dir: Path) -> None:
    fd, tmp = tempfile.mkstemp(dir=tmp_dir, prefix=".w-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
