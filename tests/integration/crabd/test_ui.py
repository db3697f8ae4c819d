"""The operator view (crabd/ui) in a real browser: Debian's Chromium driven
by Playwright (the system browser by path; Playwright's own download is not
used), against a live daemon with real sandboxes.

One daemon for the module (TCP with an admin token and two owners, the /proc
inspector: these tests are about the page, not turn classification), one
browser. The admin's page goes through `crabd ui` (the forwarder a local
operator uses); the owner's straight to the daemon's TCP listener. Each view
is screenshotted into $CRABD_UI_SHOTS (default /tmp/crabd-ui-shots)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from security_daemon import ADMIN, ALICE, BOB, As, security_daemon  # noqa: E402

pytestmark = pytest.mark.needs("runc", "criu", "bpf", "busybox", "browser")

SHOTS = Path(os.environ.get("CRABD_UI_SHOTS", "/tmp/crabd-ui-shots"))
HOSTILE_CMD = "echo '<script>window.__pwned=1</script>' > /root/x; echo done"
HOSTILE_FILE = "<img src=x onerror=window.__pwned=2>.txt"
HOSTILE_KEY = "<script>window.__pwned=3</script>"


@pytest.fixture(scope="module")
def live(runtime, busybox_image) -> Iterator[tuple[Any, str]]:
    with security_daemon(runtime) as (d, base):
        yield d, base


@pytest.fixture(scope="module")
def forwarder(live) -> Iterator[str]:
    """`crabd ui` on the daemon's socket: the URL it prints."""
    from crabd.testing import CRABD
    d, _ = live
    p = subprocess.Popen([CRABD, "ui", "--socket", str(d.socket)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    try:
        line = p.stdout.readline() if p.stdout else ""
        m = re.search(r"(http://127\.0\.0\.1:\d+/ui/login#token=\S+)", line)
        assert m, f"crabd ui printed {line!r}; stderr: {p.stderr.read() if p.stderr and p.poll() is not None else ''}"
        yield m.group(1)
    finally:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(10)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright
    exe = shutil.which("chromium")
    if exe is None:
        pytest.fail("Debian's chromium is missing: run scripts/setup-host (it installs chromium)", pytrace=False)
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=exe, args=["--no-sandbox"])  # root: Chromium's sandbox refuses
        yield b
        b.close()


@pytest.fixture
def page(browser) -> Iterator[Any]:
    ctx = browser.new_context(viewport={"width": 1400, "height": 900})
    pg = ctx.new_page()
    pg.dialogs: list[str] = []  # an alert() would be an injection that ran
    pg.on("dialog", lambda dlg: (pg.dialogs.append(dlg.message), dlg.dismiss()))
    pg.set_default_timeout(20_000)
    yield pg
    ctx.close()


def admin(base: str) -> As:
    return As(base, ADMIN)


def wait_for(pred: Any, timeout: float = 30.0, what: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what or pred}")


def settled(api: As, sid: str) -> None:
    """Every checkpoint of the sandbox committed (its capture runs after the reply)."""
    wait_for(lambda: all(c["state"] == "committed" for c in api.ok("GET", f"/v1/sandboxes/{sid}/checkpoints")["checkpoints"]),
             what=f"{sid}'s captures")


def one_turn_sandbox(api: As, name: str, cmd: str) -> str:
    """A busybox sandbox named `name` after one turn `cmd`, its capture done."""
    sid = api.ok("POST", "/v1/sandboxes", json={"image": "busybox", "name": name})["id"]
    api.ok("POST", f"/v1/sandboxes/{sid}/exec", json={"cmd": cmd})
    settled(api, sid)
    return sid


def show_host(page: Any, forwarder: str, sid: str) -> None:
    """The host view, loaded through the forwarder, with `sid`'s row drawn."""
    page.goto(forwarder)
    page.wait_for_selector(f"#host-table tr[data-sandbox='{sid}']")


def not_injected(pg: Any) -> None:
    assert pg.dialogs == [], pg.dialogs
    assert pg.evaluate("window.__pwned === undefined"), "markup from the daemon's data ran as script"


def test_tree_after_rollback_and_fork_then_rollback_through_the_page(live, forwarder, page) -> None:
    d, base = live
    api = admin(base)
    sb = api.ok("POST", "/v1/sandboxes", json={"image": "busybox", "name": "ui-tree"})
    sid = sb["id"]
    for i in range(3):
        api.ok("POST", f"/v1/sandboxes/{sid}/exec", json={"cmd": f"echo {i} > /root/f{i}"})
    settled(api, sid)
    api.ok("POST", f"/v1/sandboxes/{sid}/rollback", json={"checkpoint": 1})   # branch 1 from #1
    api.ok("POST", f"/v1/sandboxes/{sid}/exec", json={"cmd": "echo b1 > /root/g"})
    settled(api, sid)
    forks = api.ok("POST", f"/v1/checkpoints/{sid}-2/fork", json={"count": 2})["sandboxes"]
    assert len(forks) == 2

    show_host(page, forwarder, sid)
    page.screenshot(path=str(SHOTS / "host.png"), full_page=True)
    page.click(f"#host-table tr[data-sandbox='{sid}'] a")
    page.wait_for_selector(f"#sb-tree tr[data-checkpoint='{sid}-4']")
    tree = page.inner_text("#sb-tree")
    assert "2 branches" in tree and "2 forks" in tree, tree
    assert "branch 1 from #1" in tree, tree
    head = page.locator("#sb-tree tr.head")
    assert head.count() == 1 and head.get_attribute("data-checkpoint") == f"{sid}-4"
    for f in forks:  # each fork hangs off checkpoint #2, as a link to it
        assert page.locator(f"#sb-tree tr[data-checkpoint='{sid}-2'] a[href='#/sb/{f}']").count() == 1
    # The abandoned branch-0 checkpoints (#2, #3) are off the head's line.
    assert page.locator(f"#sb-tree tr.gone[data-checkpoint='{sid}-3']").count() == 1
    page.screenshot(path=str(SHOTS / "sandbox.png"), full_page=True)

    # Diff, paged, between #0 and #3: the three files of branch 0.
    page.select_option("#diff-from", f"{sid}-0")
    page.select_option("#diff-to", f"{sid}-3")
    page.click("#sb-diff button")
    page.wait_for_selector("#diff-out table")
    out = page.inner_text("#diff-out")
    assert "/root/f0" in out and "/root/f2" in out and "added" in out, out

    # Rollback through the page: the dialog says what is left behind; the
    # same API call as the CLI moves the head, seen without a reload.
    page.click(f"#sb-tree tr[data-checkpoint='{sid}-2'] button:text('rollback')")
    page.wait_for_selector("#dialog:not([hidden]) #confirm")
    dialog = page.inner_text("#dialog")
    # The head's line is #0-#1-#4; #2 meets it at #1: only #4 is left behind.
    assert "Left behind on the current line: 1 checkpoint(s)" in dialog and "#4 (turn 4" in dialog, dialog
    assert "NOT undone" in dialog
    # What the inspector saw leave the sandbox: turn 4 only; turn 1 is #2's own past.
    seen = page.inner_text("#seen-not-undone")
    assert f"turn 4 ({sid}-4)" in seen and "turn 1 (" not in seen, seen
    page.screenshot(path=str(SHOTS / "rollback-confirm.png"))
    page.click("#dialog #confirm")
    wait_for(lambda: api.ok("GET", f"/v1/sandboxes/{sid}")["branch"] == 2, what="the page's rollback")
    page.wait_for_selector(f"#sb-tree tr.head[data-checkpoint='{sid}-2']")
    # The new branch has no checkpoint yet: the head row says where it goes on.
    assert "★ head → b2" in page.inner_text(f"#sb-tree tr[data-checkpoint='{sid}-2']")
    not_injected(page)


def test_preview_of_a_cross_branch_rollback_lists_only_what_it_leaves_behind(live) -> None:
    """A rollback to a checkpoint on another branch does not undo what was
    made after the two lines split on the head's side; what was made on the
    target's own line (its ancestors) is in the target's past, not "not undone".
    The preview says what the rollback's reply then says."""
    d, base = live
    api = admin(base)
    sid = api.ok("POST", "/v1/sandboxes", json={"image": "busybox", "name": "ui-preview"})["id"]
    api.ok("POST", f"/v1/sandboxes/{sid}/exec", json={"cmd": "echo 1 > /root/f1"})      # turn 1 -> #1
    ancestor = api.ok("POST", f"/v1/sandboxes/{sid}/effects/intent", json={"op": "mail.send", "key": "before",
                                                                                   "args": {"to": "a"}})
    api.ok("POST", f"/v1/effects/{ancestor['effect']['id']}/commit", json={})           # made from #1, branch 0
    for i in (2, 3):
        api.ok("POST", f"/v1/sandboxes/{sid}/exec", json={"cmd": f"echo {i} > /root/f{i}"})
    settled(api, sid)
    api.ok("POST", f"/v1/sandboxes/{sid}/rollback", json={"checkpoint": 1})               # branch 1 from #1
    after = api.ok("POST", f"/v1/sandboxes/{sid}/effects/intent", json={"op": "mail.send", "key": "after",
                                                                                "args": {"to": "b"}})
    api.ok("POST", f"/v1/effects/{after['effect']['id']}/commit", json={})              # made from #1, branch 1
    api.ok("POST", f"/v1/sandboxes/{sid}/exec", json={"cmd": "echo b1 > /root/g"})      # turn 4 -> #4
    settled(api, sid)

    pv = api.ok("GET", f"/v1/sandboxes/{sid}/rollback/preview", params={"checkpoint": f"{sid}-3"})
    assert [c["id"] for c in pv["lost"]] == [f"{sid}-4"]
    # The /proc inspector cannot see connections: every turn "may have reached
    # the outside". Of those only turn 4 is off the target's line; turn 1 is
    # one of #3's ancestors.
    assert [(e["checkpoint"], e["turn"]) for e in pv["effects_not_undone"]] == [(f"{sid}-4", 4)], pv
    assert [e["id"] for e in pv["ledger"]["committed_after"]] == [after["effect"]["id"]], pv["ledger"]
    assert pv["meets"] == f"{sid}-1"   # where the head's line joins #3's
    r = api.ok("POST", f"/v1/sandboxes/{sid}/rollback", json={"checkpoint": f"{sid}-3"})
    assert r["effects_not_undone"] == pv["effects_not_undone"] and r["ledger"] == pv["ledger"]
    api.ok("DELETE", f"/v1/sandboxes/{sid}")


def test_live_death_and_recovery_appear_without_reload(live, forwarder, page) -> None:
    d, base = live
    api = admin(base)
    sid = one_turn_sandbox(api, "ui-death", "echo x > /root/x")
    show_host(page, forwarder, sid)
    page.wait_for_selector("#live:text('live')")
    page.evaluate("window.__same_page = true")
    pid = api.ok("GET", f"/v1/sandboxes/{sid}")["pid"]
    os.kill(pid, signal.SIGKILL)
    page.wait_for_selector(f"#events li:has-text('sandbox.died {sid}')", timeout=30_000)
    page.wait_for_selector(f"#events li:has-text('sandbox.rolled_back {sid}')", timeout=60_000)
    page.wait_for_selector(f"#host-table tr[data-sandbox='{sid}'] td.state-running")
    assert page.evaluate("window.__same_page === true"), "the page reloaded"
    page.screenshot(path=str(SHOTS / "death-recovered.png"), full_page=True)


def test_owner_sees_only_own_sandboxes(live, page) -> None:
    d, base = live
    alice, bob = As(base, ALICE), As(base, BOB)
    mine = alice.ok("POST", "/v1/sandboxes", json={"image": "busybox", "name": "ui-alice"})["id"]
    theirs = bob.ok("POST", "/v1/sandboxes", json={"image": "busybox", "name": "ui-bob"})["id"]
    bob.ok("POST", f"/v1/sandboxes/{theirs}/exec", json={"cmd": "echo bob-secret-cmd"})

    # Without a token: the page sends to the token form; the API says 401.
    r = httpx.get(base + "/ui/", follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/ui/login"
    assert httpx.get(base + "/ui/static/ui.js").status_code == 303
    assert httpx.get(base + "/v1/host").status_code == 401
    assert httpx.get(base + "/ui/login").status_code == 200

    page.goto(f"{base}/ui/login#token={ALICE}")
    page.wait_for_selector(f"#host-table tr[data-sandbox='{mine}']")
    html = page.content()
    assert theirs not in html and "ui-bob" not in html and "bob-secret-cmd" not in html
    rows = page.locator("#host-table tbody tr")
    ids = {rows.nth(i).get_attribute("data-sandbox") for i in range(rows.count())}
    assert ids == {mine}, ids
    page.screenshot(path=str(SHOTS / "owner-host.png"), full_page=True)
    # Bob's sandbox by URL: as unknown as an id that does not exist.
    page.goto(f"{base}/ui/#/sb/{theirs}")
    page.wait_for_selector("#main .error")
    assert "not_found" in page.inner_text("#main .error")
    assert "bob-secret-cmd" not in page.content()


def test_hostile_command_file_and_effect_show_as_text(live, forwarder, page) -> None:
    d, base = live
    api = admin(base)
    sid = api.ok("POST", "/v1/sandboxes", json={"image": "busybox", "name": "ui-hostile"})["id"]
    api.ok("POST", f"/v1/sandboxes/{sid}/exec", json={"cmd": ["sh", "-c", 'echo x > "/root/$1"', "sh", HOSTILE_FILE]})
    api.ok("POST", f"/v1/sandboxes/{sid}/exec", json={"cmd": HOSTILE_CMD})
    eff = api.ok("POST", f"/v1/sandboxes/{sid}/effects/intent", json={"op": "<b>mail.send</b>", "key": HOSTILE_KEY})
    api.ok("POST", f"/v1/effects/{eff['effect']['id']}/commit", json={})
    settled(api, sid)

    show_host(page, forwarder, sid)
    page.goto(forwarder.split("/ui/login")[0] + f"/ui/#/sb/{sid}")
    page.wait_for_selector("#sb-turns tbody tr")
    assert HOSTILE_CMD in page.inner_text("#sb-turns")
    assert HOSTILE_KEY in page.inner_text("#sb-effects") and "<b>mail.send</b>" in page.inner_text("#sb-effects")
    page.select_option("#diff-from", f"{sid}-0")
    page.select_option("#diff-to", f"{sid}-1")
    page.click("#sb-diff button")
    page.wait_for_selector("#diff-out table")
    assert "/root/" + HOSTILE_FILE in page.inner_text("#diff-out")
    # Only the page's own script element; no <img> from the data.
    assert page.locator("script").count() == 1 and page.locator("main img").count() == 0
    page.screenshot(path=str(SHOTS / "hostile.png"), full_page=True)
    not_injected(page)


def test_sandbox_view_loads_with_one_request(live, forwarder, page) -> None:
    """A fresh load of the sandbox view asks the API once for what it draws
    (GET /v1/sandboxes/{sid}/view), then opens the event stream; its events
    list is filled from that reply (no separate backlog request), and an
    event after the load still refreshes the view."""
    d, base = live
    api = admin(base)
    sid = one_turn_sandbox(api, "ui-one", "echo one > /root/one")
    show_host(page, forwarder, sid)
    page.goto(forwarder.split("/ui/login")[0] + f"/ui/#/sb/{sid}")
    page.wait_for_selector("#sb-turns tbody tr")
    seen: list[str] = []
    page.on("request", lambda r: seen.append(r.url.split("//", 1)[1].split("/", 1)[1]))
    page.reload()   # a fresh load of the sandbox view itself
    page.wait_for_selector("#sb-turns tbody tr")
    page.wait_for_selector("#live:text('live')")
    page.wait_for_selector(f"#events li:has-text('turn.ended {sid}')")
    calls = [u for u in seen if u.startswith("v1/")]
    # (a refresh an unrelated event queues may add more views; never another kind of request)
    assert [u.split("?")[0] for u in calls[:2]] == [f"v1/sandboxes/{sid}/view", "v1/events"], calls
    assert "follow=true" in calls[1] and all(u.startswith(f"v1/sandboxes/{sid}/view") for u in calls[2:]), calls
    assert "echo one > /root/one" in page.inner_text("#sb-turns")
    api.ok("POST", f"/v1/sandboxes/{sid}/exec", json={"cmd": "echo two > /root/two"})
    page.wait_for_selector("#sb-turns tbody tr:has-text('echo two')")
    api.ok("DELETE", f"/v1/sandboxes/{sid}")
