import json
import os
import struct

import pytest

from deltacr import (CHUNK_SIZE, AlreadyExists, ImageCorrupted, ImageStore, InvalidArgument, NotFound, chunk_spans,
                     parse_pagemap)
from deltacr.store import linked_remaps
from deltacr.testing import pagemap_image, pb_varint

PAGE = 4096


def write_image(d, runs, fill, extra=b"core"):
    """A fake CRIU image: pagemap-1.img naming pages-1.img, plus a metadata file."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "pagemap-1.img").write_bytes(pagemap_image(1, runs))
    pages = bytearray()
    for va, nr in runs:
        for i in range(nr):
            pages += fill(va + i * PAGE)
    (d / "pages-1.img").write_bytes(bytes(pages))
    (d / "core-1.img").write_bytes(extra)
    return d


def page_of(va: int) -> bytes:
    return os.urandom(8) * 0 + (va.to_bytes(8, "little") * (PAGE // 8))


def test_parse_pagemap_keeps_present_runs_in_order():
    data = pagemap_image(2, [(0x400000, 3), (0x7F0000000000, 1)])
    assert parse_pagemap(data) == (2, [(0x400000, 3), (0x7F0000000000, 1)])
    lazy_parent = pagemap_image(1, [(0x1000, 1)], flags=1)  # PE_PARENT: pages live in the parent image
    assert parse_pagemap(lazy_parent) == (1, [])
    with pytest.raises(ValueError):
        parse_pagemap(data[:-3])


def test_chunk_spans_follow_virtual_addresses():
    runs = [(0x10000 - PAGE, 3), (0x100000, 16)]  # crosses a 64 KiB boundary, then one aligned chunk
    spans = chunk_spans(19 * PAGE, runs)
    assert spans == [(0, PAGE), (PAGE, 2 * PAGE), (3 * PAGE, 16 * PAGE)]
    assert chunk_spans(10, None) == [(0, 10)]
    assert chunk_spans(CHUNK_SIZE + 1, None) == [(0, CHUNK_SIZE), (CHUNK_SIZE, 1)]
    # runs that do not add up to the file: fixed-size fallback
    assert chunk_spans(2 * CHUNK_SIZE, [(0, 1)]) == [(0, CHUNK_SIZE), (CHUNK_SIZE, CHUNK_SIZE)]


def test_put_get_round_trip(tmp_path):
    img = write_image(tmp_path / "img", [(0x400000, 40), (0x900000, 2)], page_of)
    store = ImageStore(tmp_path / "store")
    m = store.put("sb-1@1", img, meta={"sandbox_id": "sb-1"})
    assert m.raw_bytes == sum(p.stat().st_size for p in img.iterdir())
    out = tmp_path / "out"
    m2 = store.get("sb-1@1", out)
    assert m2.digest == m.digest and m2.meta == {"sandbox_id": "sb-1"}
    for p in img.iterdir():
        assert (out / p.name).read_bytes() == p.read_bytes()
    assert store.list() == ["sb-1@1"] and store.exists("sb-1@1")


def test_unchanged_heap_is_stored_once_even_when_a_region_appears(tmp_path):
    store = ImageStore(tmp_path / "store", level=1)
    runs = [(0x400000, 256)]  # 1 MiB heap
    store.put("c1", write_image(tmp_path / "a", runs, page_of))
    after_one = store.stats().stored_bytes
    # Next checkpoint: a new region *before* the heap (shifts every file offset)
    # and one changed page in the heap.
    runs2 = [(0x200000, 4), (0x400000, 256)]

    def fill2(va):
        return b"\xAB" * PAGE if va == 0x400000 + 100 * PAGE else page_of(va)
    m2 = store.put("c2", write_image(tmp_path / "b", runs2, fill2))
    added = store.stats().stored_bytes - after_one
    assert added < after_one * 0.2, (added, after_one)
    # `written` is what this put added: its new chunks plus its manifest
    manifest = len(store._manifest_path("c2").read_bytes())
    assert m2.written == added + manifest, (m2.written, added, manifest)
    # and it is read back (a restarted crabd sizes the checkpoint by it, not by its raw bytes)
    assert store.manifest("c2").written == m2.written
    assert ImageStore(tmp_path / "store", level=1).manifest("c1").written > 0


def test_corrupted_chunk_is_refused_before_anything_is_written(tmp_path):
    store = ImageStore(tmp_path / "store")
    store.put("c1", write_image(tmp_path / "a", [(0x400000, 64)], page_of))
    m = store.manifest("c1")
    pages = next(f for f in m.files if f.name == "pages-1.img")
    p = store._chunk_path(pages.chunks[-1][0])
    data = bytearray(p.read_bytes())
    data[-5] ^= 0xFF
    p.write_bytes(bytes(data))
    out = tmp_path / "out"
    with pytest.raises(ImageCorrupted, match="c1"):
        store.get("c1", out)
    assert not out.exists() or not any(out.iterdir())
    with pytest.raises(ImageCorrupted):
        store.verify("c1")


def test_missing_chunk_and_tampered_manifest_are_refused(tmp_path):
    store = ImageStore(tmp_path / "store")
    store.put("c1", write_image(tmp_path / "a", [(0x400000, 4)], page_of))
    store.put("c2", write_image(tmp_path / "b", [(0x800000, 4)], lambda va: b"\x01" * PAGE, extra=b"other"))
    m = store.manifest("c1")
    store._chunk_path(m.files[0].chunks[0][0]).unlink()
    with pytest.raises(ImageCorrupted, match="missing"):
        store.get("c1", tmp_path / "o1")
    mp = store.root / "manifests" / "c2.json"
    doc = json.loads(mp.read_text())
    doc["files"][0]["size"] += 1
    mp.write_text(json.dumps(doc))
    with pytest.raises(ImageCorrupted, match="digest"):
        store.get("c2", tmp_path / "o2")


def test_gc_deletes_only_unreferenced_chunks(tmp_path):
    store = ImageStore(tmp_path / "store")
    store.put("c1", write_image(tmp_path / "a", [(0x400000, 32)], page_of))
    store.put("c2", write_image(tmp_path / "b", [(0x400000, 32)], lambda va: b"\x07" * PAGE, extra=b"x"))
    before = store.stats()
    assert store.gc(grace=0) == 0
    store.remove("c2")
    freed = store.gc(grace=0)
    assert freed > 0 and store.stats().chunks < before.chunks
    store.get("c1", tmp_path / "out")  # still whole
    with pytest.raises(NotFound):
        store.manifest("c2")


def test_ids_and_duplicates(tmp_path):
    store = ImageStore(tmp_path / "store")
    img = write_image(tmp_path / "a", [(0x400000, 1)], page_of)
    store.put("c1", img, logs=[tmp_path / "missing.log"])
    with pytest.raises(AlreadyExists):
        store.put("c1", img)
    for bad in ("../x", "", "a/b", ".hidden"):
        with pytest.raises(InvalidArgument):
            store.put(bad, img)


def test_logs_are_kept_next_to_the_image(tmp_path):
    store = ImageStore(tmp_path / "store")
    log = tmp_path / "dump.log"
    log.write_text("(00.1) Dumping finished successfully\n")
    store.put("c1", write_image(tmp_path / "a", [(0x400000, 1)], page_of), logs=[log])
    assert (store.log_dir("c1") / "dump.log").read_text().startswith("(00.1)")


def _pb(fields: list[tuple[int, object]]) -> bytes:
    out = b""
    for num, v in fields:
        if isinstance(v, int):
            out += pb_varint(num << 3) + pb_varint(v)
        else:
            data = v.encode() if isinstance(v, str) else v
            out += pb_varint(num << 3 | 2) + pb_varint(len(data)) + data
    return out


def _img(entries: list[bytes]) -> bytes:
    return struct.pack("<II", 0x54564319, 0x12345678) + b"".join(struct.pack("<I", len(e)) + e for e in entries)


def _reg(fid: int, name: str) -> bytes:
    reg = _pb([(1, fid), (2, 0), (3, 0), (5, _pb([(1, 0)])), (6, name)])
    return _pb([(1, 1), (2, fid), (3, reg)])


def test_linked_remaps_pairs_each_old_name_with_crius_link(tmp_path):
    # what CRIU 4.1.1 writes for zdtm unlink_fstat03 (--link-remap): the old
    # name, the link it made, and a ghost file (type 1) that is no link
    (tmp_path / "files.img").write_bytes(_img([_reg(7, "/zdtm-run/unlink_fstat03.test"),
                                               _reg(9, "/zdtm-run/link_remap.9"), _reg(11, "/tmp/ghost")]))
    (tmp_path / "remap-fpath.img").write_bytes(_img([_pb([(1, 7), (2, 9), (3, 0)]), _pb([(1, 11), (2, 12), (3, 1)])]))
    assert linked_remaps(tmp_path) == {"/zdtm-run/unlink_fstat03.test": "/zdtm-run/link_remap.9"}


def test_linked_remaps_of_an_image_without_remaps(tmp_path):
    (tmp_path / "files.img").write_bytes(_img([_reg(7, "/x")]))
    assert linked_remaps(tmp_path) == {}
