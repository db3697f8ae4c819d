"""schemathesis against the OpenAPI document of a live daemon (over TCP,
with an owner's token): for every operation, schema-valid (positive) and
schema-violating (negative) requests; no answer may be a 5xx, and every
answer must match the document (declared status, content type, body
schema). Ids are random and, for the operations where it is safe, also
those of a real sandbox and its checkpoints, so exec, rollback, diff and
checkpoint reach the runtime with generated bodies. A second, stateful run
follows the schema's OpenAPI links from creates to the operations that take
their ids, and also checks that no schema-valid request is refused as
malformed (the schema says what the server enforces).

Deterministic and bounded: hypothesis is derandomized with a fixed number
of examples per operation and mode (EXAMPLES), no example database. The
request count is printed (pytest -s) and recorded in docs/operations/security.md."""

from __future__ import annotations

import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,
                                               status_code_conformance)

sys.path.insert(0, str(Path(__file__).parent))
from security_daemon import ALICE, As, security_daemon  # noqa: E402

pytestmark = pytest.mark.needs("runc", "criu", "bpf", "busybox")

EXAMPLES = {"positive": 5, "negative": 5, "real": 5}
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
# Operations never pointed at the real sandbox: they would remove it, or
# fork it up to 64 times per example.
NOT_ON_REAL = {("DELETE", "/v1/sandboxes/{sid}"), ("POST", "/v1/checkpoints/{cid}/fork"),
               ("DELETE", "/v1/checkpoints/{cid}")}


@pytest.fixture(scope="module")
def live(runtime, busybox_image):
    with security_daemon(runtime) as (d, base):
        yield d, base


# Push, pull and migrate talk to the OCI registry a request names (migrate
# also to the daemon socket it names): a generated host has none, and the
# answer is then a 502 registry_error by design. Their request validation is
# in tests/unit/crabd/test_api_schema.py, their behaviour against a real
# registry in test_registry.py and test_migrate.py.
REMOTE = ("/v1/checkpoints/{cid}/push", "/v1/sandboxes/pull", "/v1/sandboxes/{sid}/migrate")


def _without_remote(spec: dict[str, Any]) -> dict[str, Any]:
    """The spec without push and pull, and without the links to them."""
    import copy
    out = copy.deepcopy(spec)
    gone = {op.get("operationId") for p in REMOTE for op in out["paths"].get(p, {}).values()}
    out["paths"] = {p: v for p, v in out["paths"].items() if p not in REMOTE}
    for ops in out["paths"].values():
        for op in ops.values():
            for resp in (op.get("responses") or {}).values():
                links = resp.get("links") if isinstance(resp, dict) else None
                if links:
                    resp["links"] = {k: v for k, v in links.items()
                                     if v.get("operationId") not in gone and k not in gone}
    return out


def _cap_exec(case: Any) -> Any:
    # A generated shell string could in principle be a command that never
    # ends: keep every exec on the real sandbox short.
    if isinstance(case.body, dict) and "cmd" in case.body:
        case.body["timeout"] = 5
    return case


def test_schemathesis_no_5xx_and_responses_match_the_schema(live: Any) -> None:
    d, base = live
    alice = As(base, ALICE)
    spec = alice.ok("GET", "/openapi.json")
    sid = alice.ok("POST", "/v1/sandboxes", json={"image": "busybox"})["id"]
    ck = alice.ok("POST", f"/v1/sandboxes/{sid}/checkpoints")["id"]
    real = {"sid": sid, "cid": ck, "a": f"{sid}-0", "b": ck}

    schema = schemathesis.openapi.from_dict(_without_remote(spec))
    session = requests.Session()
    headers = {"authorization": f"Bearer {ALICE}"}
    statuses: Counter[int] = Counter()
    per_op: Counter[str] = Counter()
    ops = 0
    spent: dict[str, float] = {}

    for result in schema.get_all_operations():
        op = result.ok()
        ops += 1
        label = f"{op.method.upper()} {op.path}"
        fixed_query = {"follow": "false"} if op.path == "/v1/events" else None  # not the endless stream
        runs: list[tuple[str, Any]] = [
            ("positive", op.as_strategy(schemathesis.GenerationMode.POSITIVE, query=fixed_query)),
            ("negative", op.as_strategy(schemathesis.GenerationMode.NEGATIVE, query=fixed_query)),
        ]
        names = [n for n in real if "{" + n + "}" in op.path]
        if names and (op.method.upper(), op.path) not in NOT_ON_REAL:
            fixed = {n: real[n] for n in names}
            runs.append(("real", op.as_strategy(schemathesis.GenerationMode.POSITIVE, path_parameters=fixed,
                                                query=fixed_query).map(_cap_exec)))

        for mode, strategy in runs:
            @settings(max_examples=EXAMPLES[mode], derandomize=True, database=None, deadline=None,
                      phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
            @given(case=strategy)
            def run(case: Any) -> None:
                resp = case.call(base_url=base, session=session, headers=headers, timeout=120)
                statuses[resp.status_code] += 1
                per_op[label] += 1
                case.validate_response(resp, checks=CHECKS, headers=headers)

            t0 = time.monotonic()
            try:
                run()
            except Unsatisfiable:
                if mode != "negative":
                    raise
                continue  # no parameter or body to violate (e.g. GET /v1/health)
            except Exception as e:
                raise AssertionError(f"{label} ({mode}): {e}\n--- daemon log tail:\n"
                                     f"{d.log.read_text()[-3000:]}") from e
            spent[f"{label} ({mode})"] = time.monotonic() - t0

    total = sum(statuses.values())
    for k, v in sorted(spent.items(), key=lambda kv: -kv[1])[:8]:
        print(f"  {v:6.2f} s  {k}")
    print(f"\nschemathesis: {ops} operations, {total} requests, statuses {dict(sorted(statuses.items()))}")
    assert ops >= 12, f"only {ops} operations in /openapi.json"
    assert not [s for s in statuses if s >= 500], statuses
    # The fuzz really reached the routes (not only 401/404 at the door).
    assert statuses[200] + statuses[201] > 0 and statuses[422] > 0, statuses
    assert all(per_op[f"{o.ok().method.upper()} {o.ok().path}"] > 0 for o in schema.get_all_operations())
    # The real sandbox survived the fuzz and still answers. The fuzz may have
    # set a low budget on it (PUT .../budget): lift every limit first.
    alice.ok("PUT", f"/v1/sandboxes/{sid}/budget",
             json={"turns": None, "wall_s": None, "cost": None, "retries": None})
    assert alice.ok("POST", f"/v1/sandboxes/{sid}/exec", json={"cmd": ["echo", "ok"]})["stdout"] == "ok\n"


# --- stateful: sequences that follow the schema's links ------------------------------------------
# 25 scenarios of up to 10 steps: ~230 requests, ~40 s here (sandbox creates dominate).
STATEFUL = {"scenarios": 40, "steps": 10}


def _positive_422(response: Any, case: Any) -> None:
    """A schema-valid request refused as malformed: the server enforced a
    rule the schema does not state (issue 19, item 7)."""
    if response.status_code != 422:
        return
    meta = getattr(case, "meta", None)
    if meta is not None and not meta.generation.mode.is_positive:
        return
    code = response.json().get("error", {}).get("code")
    assert code != "invalid_argument", (
        f"{case.method} {case.formatted_path} body={case.body!r}: schema-valid, refused: {response.text[:300]}")


def test_stateful_links_reach_real_sandboxes_checkpoints_and_effects(live: Any) -> None:
    """schemathesis's state machine over the schema's OpenAPI links
    (crabd.api.PRODUCERS): a create's id feeds exec, checkpoints, rollback,
    fork, diff and the effects routes, so the generated requests reach the
    core logic with real ids. Same checks as above, plus: no schema-valid
    request is a 422 `invalid_argument`."""
    d, base = live
    alice = As(base, ALICE)
    spec = alice.ok("GET", "/openapi.json")
    schema = schemathesis.openapi.from_dict(_without_remote(spec))
    session = requests.Session()
    headers = {"authorization": f"Bearer {ALICE}"}
    statuses: dict[str, Counter[int]] = {}
    created: list[str] = []

    class Fuzz(schema.as_state_machine()):  # type: ignore[misc]
        def before_call(self, case: Any) -> None:
            body = case.body if isinstance(case.body, dict) else None
            if case.path == "/v1/sandboxes" and case.method.upper() == "POST" and body is not None:
                body["image"] = "busybox"  # the one image this daemon has; names stay generated
                body.pop("name", None)     # a taken name is a 409 that stops the scenario's chain
            if body is not None and "cmd" in body and case.path.endswith("/exec"):
                body["timeout"] = 5        # keep generated commands short
            count = body.get("count") if case.path == "/v1/checkpoints/{cid}/fork" and body else None
            if isinstance(count, (int, float)) and not isinstance(count, bool) and count > 2:
                body["count"] = 2          # a fork costs a sandbox per copy
            if case.path == "/v1/events":
                case.query = {**(case.query or {}), "follow": "false"}

        def get_call_kwargs(self, case: Any) -> dict[str, Any]:
            return {"base_url": base, "session": session, "headers": headers, "timeout": 60}

        def after_call(self, response: Any, case: Any) -> None:
            statuses.setdefault(f"{case.method.upper()} {case.path}", Counter())[response.status_code] += 1
            if case.path == "/v1/sandboxes" and response.status_code == 201:
                created.append(response.json()["id"])

        def validate_response(self, response: Any, case: Any, additional_checks: Any = None, **kw: Any) -> None:
            case.validate_response(response, checks=CHECKS, headers=headers)
            _positive_422(response, case)

    t0 = time.monotonic()
    try:
        Fuzz.run(settings=settings(max_examples=STATEFUL["scenarios"], stateful_step_count=STATEFUL["steps"],
                                   derandomize=True, database=None, deadline=None, phases=[Phase.generate],
                                   suppress_health_check=list(HealthCheck)))
    except Exception as e:
        raise AssertionError(f"{e}\n--- daemon log tail:\n{d.log.read_text()[-3000:]}") from e
    finally:
        for sid in created:  # a scenario's sandboxes, and forks of them, go with the daemon
            alice("DELETE", f"/v1/sandboxes/{sid}")
    took = time.monotonic() - t0

    reached = sorted(op for op, c in statuses.items() if "{" in op and any(s != 404 for s in c))
    total = sum(sum(c.values()) for c in statuses.values())
    for op, c in sorted(statuses.items()):
        print(f"  {op:48s} {dict(sorted(c.items()))}")
    print(f"\nstateful: {total} requests in {took:.1f} s; {len(reached)} operations with ids answered other than 404")
    assert not [s for c in statuses.values() for s in c if s >= 500], statuses
    # The links did their job: real ids reached the operations that take them.
    for op in ("POST /v1/sandboxes/{sid}/exec", "POST /v1/sandboxes/{sid}/checkpoints", "GET /v1/sandboxes/{sid}"):
        assert op in reached, (op, statuses.get(op))
    assert len(reached) >= 10, reached
