"""Event record layout: Python mirror of struct event, decoding, program text."""

import ctypes

from ebpf._events import (ARG_LEN, AT_FDCWD, RawEvent, EventKind, decode, defines, program_text)


def raw(kind, **kw) -> bytes:
    r = RawEvent()
    r.kind = int(kind)
    r.tag, r.pid, r.tid, r.ts = 3, 100, 101, 42
    r.dfd = r.dfd2 = AT_FDCWD
    for k, v in kw.items():
        if k in ("path", "path2"):
            buf = (ctypes.c_char * len(v)).from_buffer_copy(v)
            ctypes.memmove(ctypes.addressof(r) + getattr(RawEvent, k).offset, buf, len(v))
        elif k == "addr":
            for i, b in enumerate(v):
                r.addr[i] = b
        else:
            setattr(r, k, v)
    return bytes(r)


def test_struct_size_matches_c_layout():
    # ts; tag kind pid tid; ret arg; dfd dfd2; family port; nargs fsmagic fsmode; addr; comm; paths
    assert ctypes.sizeof(RawEvent) == 8 + 16 + 16 + 8 + 4 + 12 + 16 + 16 + 512


def test_decode_file_event():
    ev = decode(raw(EventKind.RENAME, path=b"a.txt\0", path2=b"/app/b.txt\0", dfd2=5))
    assert (ev.kind, ev.path, ev.path2, ev.dfd2, ev.pid, ev.tid, ev.tag) == (
        EventKind.RENAME, "a.txt", "/app/b.txt", 5, 100, 101, 3)


def test_decode_exec_argv_slots():
    blob = b"".join(a.ljust(ARG_LEN, b"\0") for a in (b"git", b"push", b"origin"))
    ev = decode(raw(EventKind.EXEC_ARGS, path=b"/usr/bin/git\0", path2=blob, nargs=3))
    assert ev.argv == ("git", "push", "origin")
    assert ev.path == "/usr/bin/git"


def test_decode_inet_and_unix_addresses():
    ev = decode(raw(EventKind.CONNECT, family=2, port=8080, addr=bytes([10, 251, 0, 2])))
    assert (ev.addr, ev.port) == ("10.251.0.2", 8080)
    ev6 = decode(raw(EventKind.CONNECT, family=10, port=443, addr=bytes(15) + b"\x01"))
    assert ev6.addr == "::1"
    abstract = decode(raw(EventKind.CONNECT, family=1, path=b"\0name\0"))
    assert abstract.path == "@name"


def test_program_text_defines_every_kind_and_is_printable():
    text = program_text()
    for k in EventKind:
        assert f"#define EV_{k.name} ({int(k)})" in text
    assert "TRACEPOINT_PROBE(syscalls, sys_enter_openat)" in text
    assert "#define FOLLOW_PIDS (0)" in text
    assert "#define FOLLOW_PIDS (1)" in program_text(follow_pids=True)
    assert defines()["OPEN_WRITE_FLAGS"] & 0o1


def test_cli_prints_program(capsys):
    from ebpf.inspector import main
    assert main(["--print-program"]) == 0
    assert "BPF_RINGBUF_OUTPUT(events" in capsys.readouterr().out


def test_write_counters_can_be_compiled_out():
    assert "#define COUNT_WRITES (1)" in program_text()
    assert "#define COUNT_WRITES (0)" in program_text(count_writes=False)
    assert "#if COUNT_WRITES" in program_text()


def test_landed_scope():
    from ebpf._events import landed_scope
    assert landed_scope(0x9FA0, 0o100644) == "kernel"     # proc
    assert landed_scope(0x01021994, 0o100644) == "tmpfs"
    assert landed_scope(0x01021994, 0o020666) is None     # /dev/null: a device node on tmpfs
    assert landed_scope(0xEF53, 0o100644) is None         # ext4: the snapshot holds it
    assert landed_scope(0, 0) is None                     # unknown
    from ebpf._events import FS_UNLINKED
    assert landed_scope(0x9123683E, 0o100644 | FS_UNLINKED) == "held"  # btrfs, deleted while held open
    assert landed_scope(0x01021994, 0o100644 | FS_UNLINKED) == "tmpfs"  # a memfd: memory either way


def test_effects_with_names_that_are_not_utf8_serialize():
    # zdtm sk-unix-rel binds a unix path with no NUL: the bytes read after it
    # are stack garbage, decoded with surrogate escapes like any name
    from ebpf import Effects, Sample, SocketRecord
    ev = decode(raw(EventKind.BIND, family=1, path=b"sk-unix-rel.test\x98\xfe"))
    assert ev.path == "sk-unix-rel.test\udc98\udcfe"
    unix = Sample()
    unix.add(ev.path)
    eff = Effects(sandbox_id="sb", turn=1, source="bpf-cgroup",
                  listening=[SocketRecord(pid=1, address=ev.path, alive=True)])
    eff.connections.unix = unix
    text = eff.model_dump_json()  # raised PydanticSerializationError (surrogates not allowed)
    assert "sk-unix-rel.test\\\\x98\\\\xfe" in text
    assert eff.model_dump(mode="json")["listening"][0]["address"] == "sk-unix-rel.test\\x98\\xfe"
    assert Effects.model_validate_json(text).connections.unix.sample == ["sk-unix-rel.test\\x98\\xfe"]
    # and the plan's reasons, which quote the address, are text that encodes too
    from ebpf import classify
    reasons = classify(eff).reasons
    assert any("sk-unix-rel.test\\x98\\xfe" in r for r in reasons), reasons
    "; ".join(reasons).encode("utf-8")
    # the serializer changes no schema
    assert Effects.model_json_schema(mode="serialization") == Effects.model_json_schema(mode="validation")
