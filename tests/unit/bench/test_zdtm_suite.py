"""The zdtm conformance bench's pure parts (bench/zdtm.py): upstream's test
lists and start arguments read from its Makefile, .desc parsing and the
tests upstream's runner would skip, the verdict of an output file, and the
JSON summary `crabd bench zdtm --json` prints."""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

import pytest

from bench import zdtm
from bench.zdtm import Outcome, ZdtmTest

ROOT = Path(__file__).resolve().parents[3]

# A cut-down copy of test/zdtm/static/Makefile's shape (CRIU 4.1.1).
MAKEFILE = """\
LIBDIR	:= ../lib

TST_NOFILE	:=				\\
		pipe00				\\
		pid00				\\
		arm-neon00			\\
		sk-unix-listen02		\\
#		jobctl00			\\

ifeq ($(call pkg-config-check,libbpf),y)
TST_NOFILE	+=				\\
		bpf_hash			\\
endif

TST_FILE	=				\\
		write_read00			\\
		fifo				\\

TST_DIR		=				\\
		cwd00				\\

TST		=				\\
		$(TST_NOFILE)			\\
		$(TST_FILE)			\\
		$(TST_DIR)			\\
		env00				\\
		umask00				\\

$(TST_FILE:%=%.pid):	%.pid:	%
	$(<D)/$(<F) --pidfile=$@ --outfile=$<.out --filename=$<.test

env00.pid:	env00
	$(<D)/$(<F) --pidfile=$@ --outfile=$<.out --envname=ENV_00_TEST
umask00.pid:	umask00
	$(<D)/$(<F) --pidfile=$@ --outfile=$<.out --mask=0345
"""

DESCS = {
    "pipe00": None,
    "pid00": "{'flags': 'suid'}\n",
    "arm-neon00": "{'arch': 'aarch64', 'flags': 'noauto'}",
    "sk-unix-listen02": "{'flags': 'crfail'}",
    "write_read00": "",
    "fifo": "{'feature': 'mnt_id', 'opts': '--tcp-established'}",
    "env00": "{'flags': 'suid'}",
    "umask00": "{'x': 'a' or 'b'}",   # an expression, as mnt_ext_dev.desc has
}


def _tests(features=lambda f: True) -> dict[str, ZdtmTest]:
    return {t.name: t for t in zdtm.select_tests(MAKEFILE, DESCS, arch="x86_64", features=features)}


def test_lists_from_the_makefile_skip_comments_and_optional_appends() -> None:
    lists = zdtm._make_lists(MAKEFILE)
    assert lists["TST_NOFILE"] == ["pipe00", "pid00", "arm-neon00", "sk-unix-listen02"]  # no jobctl00, no bpf_hash
    assert lists["TST_FILE"] == ["write_read00", "fifo"]
    assert "env00" in lists["TST"]


def test_start_arguments_by_makefile_group_and_own_rules() -> None:
    t = _tests()
    assert t["pipe00"].args == ["--pidfile=pipe00.pid", "--outfile=pipe00.out"]
    assert t["write_read00"].args == ["--pidfile=write_read00.pid", "--outfile=write_read00.out",
                                      "--filename=write_read00.test"]
    assert t["env00"].args == ["--pidfile=env00.pid", "--outfile=env00.out", "--envname=ENV_00_TEST"]
    assert "cwd00" not in t  # TST_DIR: mount and cgroup tests, not run
    assert zdtm.test_args("x", "TST_DIR_FILE") == ["--pidfile=x.pid", "--outfile=x.out", "--dirname=x.dir.test",
                                                   "--filename=x.test"]


def test_desc_flags_decide_what_runs() -> None:
    t = _tests()
    assert t["pipe00"].skip is None and t["pipe00"].desc == {}
    assert t["write_read00"].skip is None  # an empty .desc
    assert t["pid00"].skip is None and t["pid00"].flags == ["suid"]
    assert t["arm-neon00"].skip == "arch aarch64 only"
    assert t["sk-unix-listen02"].skip.startswith("crfail")
    assert t["umask00"].skip.startswith(".desc is not a literal")
    assert t["fifo"].criu_opts == ["--tcp-established"]
    no_mnt_id = _tests(features=lambda f: f != "mnt_id")
    assert no_mnt_id["fifo"].skip == "criu check --feature mnt_id fails on this host"


def test_noauto_without_arch_is_skipped_too() -> None:
    t = ZdtmTest("x", [], desc={"flags": "suid noauto"})
    assert zdtm.skip_reason(t, "x86_64", lambda f: True).startswith("noauto")


def test_upstream_uid_only_for_non_suid_tests_and_only_when_asked() -> None:
    t = _tests()
    assert t["pipe00"].env() == {}
    assert t["pipe00"].env(upstream_uid=True) == zdtm.UNPRIVILEGED_ENV
    assert t["pid00"].env(upstream_uid=True) == {}


def test_parse_desc_rejects_non_dicts() -> None:
    assert zdtm.parse_desc("  \n") == {}
    with pytest.raises(ValueError):
        zdtm.parse_desc("['suid']")
    with pytest.raises(ValueError):
        zdtm.parse_desc("{'flags': __import__('os')}")


@pytest.mark.parametrize("text,ok,reason", [
    ("PASS\n", True, "PASS"),
    ("12:00:01.1: 42: PASS\n", True, "PASS"),
    ("12:00:01.1: 42: pipe content differs\n12:00:01.2: 42: FAIL: pipe00.c:80: bad data\n", False,
     "12:00:01.2: 42: FAIL: pipe00.c:80: bad data"),
    ("PASS\nsome later line\n", False, "some later line"),   # upstream reads the last line only
    ("", False, "empty output file"),
])
def test_verdict_reads_the_last_line(text: str, ok: bool, reason: str) -> None:
    assert zdtm.verdict(text) == (ok, reason)


def test_verdict_without_a_file() -> None:
    ok, why = zdtm.verdict(None)
    assert not ok and "gone" in why


def test_summary_counts_over_native_passes_and_lists_host_limited() -> None:
    tests = [ZdtmTest("a", []), ZdtmTest("b", []), ZdtmTest("c", []), ZdtmTest("d", [], skip="noauto: by hand")]
    outs = [Outcome("a", "native", True, "PASS"), Outcome("a", "dump_continue", True, "PASS"),
            Outcome("a", "auto_recovery", True, "PASS"), Outcome("a", "rollback", True, "PASS"),
            Outcome("a", "fork", True, "PASS"),
            Outcome("b", "native", True, "PASS"), Outcome("b", "dump_continue", True, "PASS"),
            Outcome("b", "auto_recovery", False, "process image not captured: Can't get rlimit"),
            Outcome("b", "rollback", False, "processes not restored (fs)"), Outcome("b", "fork", True, "PASS"),
            Outcome("c", "native", False, "did not start (exit 1): Operation not permitted")]
    s = zdtm.summarize(tests, outs)
    assert s["tests"] == 3 and s["native_pass"] == 2
    assert s["variants"] == {"dump_continue": {"pass": 2, "run": 2}, "auto_recovery": {"pass": 1, "run": 2},
                             "rollback": {"pass": 1, "run": 2}, "fork": {"pass": 2, "run": 2}}
    assert s["failures"] == [
        {"test": "b", "variant": "auto_recovery", "reason": "process image not captured: Can't get rlimit"},
        {"test": "b", "variant": "rollback", "reason": "processes not restored (fs)"}]
    assert {h["test"]: h["reason"] for h in s["host_limited"]} == {
        "d": "noauto: by hand", "c": "fails natively in a crabd sandbox: did not start (exit 1): Operation not permitted"}
    assert len(s["results"]) == len(outs)
    rows = dict(zdtm.table_rows(s))
    assert rows["auto_recovery"] == "1 / 2" and rows["pass natively"] == "2"
    md = zdtm.report_md(s, ["crabd", "bench", "zdtm"])
    assert "| b | rollback | processes not restored (fs) |" in md and "`crabd bench zdtm`" in md


def test_sources_digest_from_showsrc() -> None:
    show = ("Package: criu\nVersion: 4.1.1-1\nChecksums-Sha256:\n"
            " 12206f74ab852907156db8fdf1fb2a40ebbc897d28c133a2cbe804fab13f8b62 2806 criu_4.1.1-1.dsc\n"
            " f80a66cb3726bb2116266d4759ce3bcbfab7abdb6b6d430bf20dd41911717afe 1021136 criu_4.1.1.orig.tar.xz\n"
            "Files:\n b76fc936ca0591d50d299348b03875e9 2806 criu_4.1.1-1.dsc\n")
    assert zdtm._sources_sha256(show, "criu_4.1.1.orig.tar.xz") == \
        "f80a66cb3726bb2116266d4759ce3bcbfab7abdb6b6d430bf20dd41911717afe"
    assert zdtm._sources_sha256(show, "criu_4.1.1-1.debian.tar.xz") is None


def test_start_failure_and_step_outputs() -> None:
    out = "@@nostart exit 1\n10:00:00.1: 13: ERR: sched_prio00.c:51: Can't set prio 0 (errno = 13)\n\n"
    assert zdtm.start_failure(out) == "did not start (exit 1): 10:00:00.1: 13: ERR: sched_prio00.c:51: " \
                                      "Can't set prio 0 (errno = 13)"
    assert zdtm.start_failure("@@nostart exit 2\n") == "did not start (exit 2): no message"
    assert zdtm.read_verdict("@@gone\n") == (False, "the test process is gone (not restored)")
    ok, why = zdtm.read_verdict("@@noout\nwaiting\n")
    assert not ok and why.startswith("no verdict") and why.endswith("waiting")
    assert zdtm.read_verdict("PASS\n") == (True, "PASS")


def test_an_interrupted_test_is_not_a_result_and_issue_tests_run_first() -> None:
    v = list(zdtm.VARIANTS)
    assert zdtm.complete([Outcome("a", "native", False, "x")], v)
    assert not zdtm.complete([Outcome("a", "native", True), Outcome("a", "dump_continue", True)], v)
    assert zdtm.complete([Outcome("a", x, True) for x in v], v)
    names = [t.name for t in zdtm.order([ZdtmTest(n, []) for n in ("aaa", "pipe00", "stopped", "pid00")])]
    assert names == ["stopped", "pid00", "pipe00", "aaa"]


def test_arch_may_list_several() -> None:
    t = zdtm.ZdtmTest("rtc", [], {"arch": "x86_64 aarch64 arm ppc64"})
    assert zdtm.skip_reason(t, "x86_64", lambda f: True) is None
    assert zdtm.skip_reason(t, "s390x", lambda f: True) == "arch x86_64 aarch64 arm ppc64 only"


def test_a_reqrst_test_failing_natively_says_it_needs_a_restore_with_upstream_options() -> None:
    close0 = ZdtmTest("socket-tcp-close0", [], {"dopts": "--tcp-established", "ropts": "--tcp-close",
                                                "flags": "reqrst "})
    s = zdtm.summarize([close0], [Outcome("socket-tcp-close0", "native", False, "FAIL: Server socket isn't closed")])
    assert s["host_limited"] == [{"test": "socket-tcp-close0", "reason":
                                  "reqrst: upstream runs it only with a restore, with its CRIU options "
                                  "(--tcp-established --tcp-close); natively it fails: "
                                  "FAIL: Server socket isn't closed"}]


def test_share_runs_fork_dump_continue_and_rollback_on_one_sandbox_after_the_rest() -> None:
    calls: list[tuple[str, ...]] = []

    class Steps(zdtm.Suite):
        def __init__(self) -> None:  # no daemon: the steps below stand in for the sandbox ones
            self.share, self.stop = True, threading.Event()

        def client(self):  # type: ignore[override]
            return contextlib.nullcontext(None)

        def native(self, c, t):  # type: ignore[override]
            calls.append(("native",))
            return Outcome(t.name, "native", t.name != "bad", "PASS")

        def checkpointed(self, c, t, v):  # type: ignore[override]
            calls.append((v,))
            return Outcome(t.name, v, True, "PASS")

        def shared(self, c, t, variants):  # type: ignore[override]
            calls.append(tuple(variants))
            return [Outcome(t.name, v, True, "PASS") for v in variants]

    outs = Steps().run_test(ZdtmTest("a", []), list(zdtm.VARIANTS))
    assert calls == [("native",), ("auto_recovery",), ("fork", "dump_continue", "rollback")]
    assert zdtm.complete(outs, list(zdtm.VARIANTS))
    calls.clear()
    assert [o.variant for o in Steps().run_test(ZdtmTest("bad", []), list(zdtm.VARIANTS))] == ["native"]
    assert calls == [("native",)]


def test_hang_guards_scale_with_the_load_per_cpu_within_bounds():
    assert zdtm.load_factor(0.5, 2) == 1.0           # an idle host: the base guard
    assert zdtm.load_factor(14.0, 2) == 6.0          # capped: a real hang still ends
    assert zdtm.load_factor(6.0, 2) == 3.0
    assert zdtm.guard(90.0, 3.0) == 270.0
    assert zdtm.load_env("poll", 3.0) == {"ZDTM_DELTA": "15"}
    assert zdtm.load_env("pipe00", 3.0) == {}


def test_no_verdict_names_the_wait_it_gave():
    ok, why = zdtm.read_verdict("@@noout 90\nwaiting\n")
    assert not ok and why.startswith("no verdict 90 s after SIGTERM") and why.endswith("waiting")
