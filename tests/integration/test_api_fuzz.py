"""schemathesis against the OpenAPI document of a live daemon (over TCP,
with an owner's token): for every operation, schema-valid (positive) and
schema-violating (negative) requests; no answer may be a 5xx, and every
answer must match the document (declared status, content type, body
schema). Ids are random and, for the operations where it is safe, also
those of a real sandbox and its checkpoints, so exec, rollback, diff and
checkpoint reach the runtime with generated bodies.

Deterministic and bounded: hypothesis is derandomized with a fixed number
of examples per operation and mode (EXAMPLES), no example database. The
request count is printed (pytest -s) and recorded in README.md."""

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

    schema = schemathesis.openapi.from_dict(spec)
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
