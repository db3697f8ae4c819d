import pytest

from deltacr import capture_consistent


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        self.t += 1.0
        return self.t


def test_order_is_freeze_fs_dump_thaw():
    log = []
    cap = capture_consistent(lambda: log.append("freeze"), lambda: log.append("thaw"),
                             lambda: log.append("dump") or "img", lambda: log.append("fs") or "snap@1",
                             clock=Clock())
    assert log == ["freeze", "fs", "dump", "thaw"]
    assert cap.fs_result == "snap@1" and cap.dump_result == "img"
    assert cap.pause_seconds == 4.0 and cap.freeze_seconds == 1.0 and cap.fs_seconds == 1.0


def test_without_fs_commit():
    log = []
    cap = capture_consistent(lambda: log.append("freeze"), lambda: log.append("thaw"), lambda: 7)
    assert log == ["freeze", "thaw"] and cap.dump_result == 7 and cap.fs_result is None


def test_thaws_when_the_fs_commit_fails():
    log = []

    def fs():
        raise OSError("disk full")
    with pytest.raises(OSError):
        capture_consistent(lambda: log.append("freeze"), lambda: log.append("thaw"),
                           lambda: log.append("dump"), fs)
    assert log == ["freeze", "thaw"]


def test_dump_failure_thaws_and_reports_the_fs_commit():
    log = []

    def dump():
        raise RuntimeError("criu said no")
    with pytest.raises(RuntimeError) as ei:
        capture_consistent(lambda: log.append("freeze"), lambda: log.append("thaw"), dump, lambda: "snap@2")
    assert log == ["freeze", "thaw"]
    assert ei.value.fs_result == "snap@2"
