"""crabd.remote's pure parts and its client against httpx's mock transport;
layers written and applied in temporary directories (no registry, no root)."""

from __future__ import annotations

import base64
import hashlib
import io
import io as _io
import json
import os
import tarfile

import httpx
import pytest
import zstandard

from crabd.errors import IntegrityError, InvalidArgument, RegistryError
from crabd.remote.layers import apply_layer, member_paths, write_layer
from crabd.remote.oci import Registry, docker_credentials, parse_reference
from deltafs.tree import Change, diff_entries, scan


def test_references():
    r = parse_reference("127.0.0.1:5000/crabd/sb1:turn3")
    assert (r.host, r.repository, r.tag, r.digest) == ("127.0.0.1:5000", "crabd/sb1", "turn3", None)
    d = "sha256:" + "a" * 64
    r = parse_reference(f"reg.example.com/team/sb@{d}")
    assert r.tag is None and r.digest == d and r.target == d
    assert parse_reference("localhost/x").tag == "latest"
    for bad in ("crabd/sb1:1", "ubuntu", "reg.io/UPPER:1", f"reg.io/x@sha256:{'z' * 64}", "reg.io/x:bad tag"):
        with pytest.raises(InvalidArgument):
            parse_reference(bad)


def test_docker_config_credentials(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"auths": {"https://reg.io": {"auth": base64.b64encode(b"u:p:w").decode()}}}))
    assert docker_credentials("reg.io", cfg) == ("u", "p:w")
    assert docker_credentials("other.io", cfg) is None
    assert docker_credentials("reg.io", tmp_path / "missing.json") is None


def _registry(handler) -> Registry:  # type: ignore[no-untyped-def]
    return Registry("reg.io", auth="u:p", transport=httpx.MockTransport(handler))


def test_bearer_token_dance():
    seen = []

    def handler(req: httpx.Request) -> httpx.Response:
        seen.append((req.method, req.url.path, req.headers.get("authorization")))
        if req.url.path == "/token":
            assert req.headers["authorization"] == "Basic " + base64.b64encode(b"u:p").decode()
            assert req.url.params["scope"] == "repository:a/b:pull"
            return httpx.Response(200, json={"token": "T0K"})
        if req.headers.get("authorization") != "Bearer T0K":
            return httpx.Response(401, headers={"www-authenticate": 'Bearer realm="https://reg.io/token",'
                                                                    'service="reg",scope="repository:a/b:pull"'})
        return httpx.Response(200)

    with _registry(handler) as reg:
        assert reg.base == "https://reg.io"  # not localhost: TLS
        assert reg.has_blob("a/b", "sha256:" + "0" * 64)
        assert reg.has_blob("a/b", "sha256:" + "1" * 64)
    assert [p for _, p, _ in seen].count("/token") == 1  # the token is kept


def test_pull_checks_the_digest_and_an_unreachable_registry_is_clear():
    body = b"layer bytes"
    good = "sha256:" + hashlib.sha256(body).hexdigest()

    def handler(req: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body + (b"!" if req.url.path.endswith("1" * 64) else b""))

    with _registry(handler) as reg:
        buf = io.BytesIO()
        assert reg.pull_blob("a/b", good, buf) == len(body)
        with pytest.raises(IntegrityError):
            reg.pull_blob("a/b", "sha256:" + "1" * 64, io.BytesIO())

    def down(req: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused")

    with _registry(down) as reg, pytest.raises(RegistryError) as e:
        reg.has_blob("a/b", good)
    assert "unreachable" in e.value.message and e.value.fix


def test_whiteouts_and_link_groups():
    from deltafs.tree import Entry
    tree = {b"a": Entry(b"a", "file", 0o644, 0, 0, 1, 0, ino=7, nlink=2),
            b"b": Entry(b"b", "file", 0o644, 0, 0, 1, 0, ino=7, nlink=2),
            b"c": Entry(b"c", "file", 0o644, 0, 0, 1, 0, ino=8)}
    changes = [Change("added", b"a", "file", 1), Change("deleted", b"d", "dir", 0),
               Change("deleted", b"d/x", "file", 0), Change("deleted", b"e/f", "file", 0)]
    keep, wh = member_paths(changes, tree)
    assert keep == [b"a", b"b"]  # b shares a's inode: it goes too
    assert wh == [b".wh.d", b"e/.wh.f"]  # d/x is under d's whiteout


def _tree(root: str) -> dict:  # type: ignore[type-arg]
    return {p: (e.kind, e.mode, e.size, e.target) for p, e in scan(root).items() if p}


def test_layer_round_trip(tmp_path):
    old, new, dst, work = (tmp_path / n for n in ("old", "new", "dst", "work"))
    for d in (old, new, dst, work):
        d.mkdir()
    for d in (old, dst):
        (d / "gone").write_text("x")
        (d / "keep").write_text("k")
        (d / "dir").mkdir()
        (d / "dir" / "inner").write_text("i")
    (new / "keep").write_text("k")
    os.utime(new / "keep", ns=((old / "keep").stat().st_atime_ns, (old / "keep").stat().st_mtime_ns))
    (new / "dir").mkdir()
    os.utime(new / "dir", ns=((old / "dir").stat().st_atime_ns, (old / "dir").stat().st_mtime_ns))
    (new / "f").write_bytes(b"data")
    os.chmod(new / "f", 0o751)
    os.link(new / "f", new / "f2")
    os.symlink("/etc/passwd", new / "ln")
    os.mkfifo(new / "fifo")
    with open(new / "sparse", "wb") as f:
        f.truncate(8 << 20)
        f.write(b"head")
    paths, wh = member_paths(diff_entries(scan(str(old)), scan(str(new))), scan(str(new)))
    lf = write_layer(str(new), paths, wh, str(work))
    assert lf.digest == "sha256:" + hashlib.sha256(open(lf.path, "rb").read()).hexdigest()
    apply_layer(lf.path, str(dst))
    assert _tree(str(dst)) == _tree(str(new))
    assert (dst / "f").stat().st_ino == (dst / "f2").stat().st_ino
    assert (new / "sparse").stat().st_blocks * 512 < 1 << 20, "source not sparse"
    assert (dst / "sparse").stat().st_blocks * 512 < 1 << 20  # holes stay holes


def _layer(tmp_path, members) -> str:  # type: ignore[no-untyped-def]
    raw = _io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as t:
        for ti, data in members:
            t.addfile(ti, _io.BytesIO(data) if data is not None else None)
    p = tmp_path / "evil.tar.zst"
    p.write_bytes(zstandard.ZstdCompressor().compress(raw.getvalue()))
    return str(p)


def test_hostile_layers_are_refused_before_anything_is_written(tmp_path):
    dst = tmp_path / "dst"
    dst.mkdir()
    os.symlink("/tmp", dst / "out")
    f = tarfile.TarInfo("out/owned")
    f.size = 1
    with pytest.raises(IntegrityError):
        apply_layer(_layer(tmp_path, [(f, b"x")]), str(dst))  # below a symlink already in the tree
    link = tarfile.TarInfo("l")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc"
    g = tarfile.TarInfo("l/passwd")
    g.size = 1
    with pytest.raises(IntegrityError):
        apply_layer(_layer(tmp_path, [(link, None), (g, b"x")]), str(dst))  # below one the layer makes
    h = tarfile.TarInfo("../escape")
    h.size = 1
    with pytest.raises(IntegrityError):
        apply_layer(_layer(tmp_path, [(h, b"x")]), str(dst))
    assert sorted(os.listdir(dst)) == ["out"]


def test_chunks_move_between_image_stores(tmp_path):
    from deltacr import ImageStore
    from deltacr.errors import ImageCorrupted
    img = tmp_path / "img"
    img.mkdir()
    (img / "pages-1.img").write_bytes(os.urandom(200_000))
    (img / "core-1.img").write_bytes(b"core")
    a, b = ImageStore(tmp_path / "a"), ImageStore(tmp_path / "b")
    m = a.put("ck-1", img)
    keys = {k: n for f in m.files for k, n in f.chunks}
    k0 = next(iter(keys))
    with pytest.raises(ImageCorrupted):
        b.add_chunk_frame(k0, zstandard.ZstdCompressor().compress(b"not it"), keys[k0])
    for k, n in keys.items():
        b.add_chunk_frame(k, a.chunk_frame(k), n)
    doc = {**m.body(), "digest": m.digest}
    with pytest.raises(ImageCorrupted):
        b.adopt("x-1", {**doc, "created": 0.0})  # a body that does not match its digest
    got = b.adopt("rmt-1", doc)
    assert got.checkpoint_id == "rmt-1" and b.get("rmt-1", tmp_path / "out").files == m.files


def test_gc_of_imported_layers_keeps_what_something_uses(tmp_path):
    """Imported layers go top down once nothing stacks on them and no row names them."""
    from types import SimpleNamespace

    import deltafs as _deltafs
    from crabd.remote.transfer import IMPORTED_PREFIX, gc_imported

    class FakeFs:
        def __init__(self, snaps):
            self.snaps = dict(snaps)  # name -> parent

        def walk(self):
            return [SimpleNamespace(name=n, parent=p) for n, p in self.snaps.items()]

        def remove(self, name):
            if name not in self.snaps:
                raise _deltafs.NotFound(name)
            assert name not in self.snaps.values(), f"{name} still has children"
            del self.snaps[name]

    r = [IMPORTED_PREFIX + c * 8 for c in "abcde"]
    fs = FakeFs({r[0]: None, r[1]: r[0], r[2]: r[1],   # a chain nothing uses any more
                 r[3]: None, "root-1": r[3],             # a pulled sandbox's root stacks on r3
                 r[4]: None, "img-busybox": None})       # r4: named by a checkpoint row; an image
    refs = {r[4]: 1}
    store = SimpleNamespace(fs_snapshot_refs=lambda n: refs.get(n, 0))
    (tmp_path / "remote" / "tmp" / "xfer-1").mkdir(parents=True)
    daemon = SimpleNamespace(fs=fs, store=store, state_dir=tmp_path)
    assert gc_imported(daemon) == [r[2], r[1], r[0]]
    assert set(fs.snaps) == {r[3], "root-1", r[4], "img-busybox"}
    assert (tmp_path / "remote" / "tmp" / "xfer-1").exists()  # a transfer may be running
    del fs.snaps["root-1"]
    refs.clear()
    assert sorted(gc_imported(daemon, at_start=True)) == sorted([r[3], r[4]])
    assert set(fs.snaps) == {"img-busybox"}
    assert not (tmp_path / "remote" / "tmp").exists()
