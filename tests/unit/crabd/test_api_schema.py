"""The API's schema says what the server enforces (issue 19, item 7), in
process and without root: every request body schemathesis generates from
/openapi.json, schema-valid or not, is accepted by the real FastAPI app
exactly when the document's own JSON Schema accepts it. A schema-valid body
answered 422 `invalid_argument` (the server checking a rule the schema does
not state), or a schema-invalid one let through, fails with the body.

The daemon behind the app is a mock: a body that passes validation reaches
it and fails there (500), which counts as accepted; only the validation
layer is under test. The live-daemon versions, with real ids, are
tests/integration/crabd/test_api_fuzz.py. About 20 s on the loaded 2-core host (schemathesis's
generation dominates)."""

from __future__ import annotations

import json
from typing import Any
from unittest import mock

import jsonschema_rs
import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, Phase, given, settings

from crabd.api import make_app

TOKEN = "admin-token-0123456789"
# Path parameters that pass the schema's own patterns.
PATH = {"sid": "sb-0123456789", "cid": "sb-0123456789-1", "eid": "ef-1", "op": "email.send"}
EXAMPLES = 10


@pytest.fixture(scope="module")
def app() -> Any:
    # push, pull and migrate are crabd.remote's functions, not the daemon's: a
    # body that passes validation would reach a registry (or a daemon's
    # socket) named by generated text
    with mock.patch("crabd.remote.transfer.push_checkpoint"), mock.patch("crabd.remote.transfer.pull_sandbox"), \
            mock.patch("crabd.remote.migrate.migrate_sandbox", new=mock.AsyncMock(return_value={})):
        return make_app(mock.MagicMock(), token=TOKEN)


@pytest.fixture(scope="module")
def client(app: Any) -> Any:
    with TestClient(app, base_url="http://crabd", raise_server_exceptions=False) as c:
        yield c


def _body_operations(spec: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    out = []
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            content = op.get("requestBody", {}).get("content", {}).get("application/json")
            if content:
                out.append((method, path, content["schema"]))
    return out


def _accepted(client: Any, method: str, path: str, body: Any) -> tuple[bool, str]:
    url = path.format(**{k: v for k, v in PATH.items() if "{" + k + "}" in path})
    r = client.request(method.upper(), url, content=json.dumps(body).encode(),
                       headers={"authorization": f"Bearer {TOKEN}", "content-type": "application/json"})
    refused = r.status_code == 422 and r.json().get("error", {}).get("code") == "invalid_argument"
    return not refused, r.text[:300]


def test_every_operation_with_a_body_is_covered(app: Any) -> None:
    ops = {(m, p) for m, p, _ in _body_operations(app.openapi())}
    assert ("post", "/v1/checkpoints/{cid}/fork") in ops and ("post", "/v1/sandboxes") in ops
    assert len(ops) >= 12, sorted(ops)


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_generated_bodies_are_accepted_exactly_when_the_schema_accepts_them(app: Any, client: Any,
                                                                          mode: str) -> None:
    spec = app.openapi()
    schema = schemathesis.openapi.from_dict(spec)
    gen = schemathesis.GenerationMode.POSITIVE if mode == "positive" else schemathesis.GenerationMode.NEGATIVE
    wrong: list[str] = []
    checked = 0
    for method, path, body_schema in _body_operations(spec):
        validator = jsonschema_rs.validator_for({**body_schema, "components": spec["components"]})
        op = schema[path][method.upper()]
        fixed = {k: v for k, v in PATH.items() if "{" + k + "}" in path}

        @settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy(gen, path_parameters=fixed))
        def run(case: Any) -> None:
            nonlocal checked
            body = case.body
            if not isinstance(body, (dict, list, str, int, float, bool)) and body is not None:
                return  # no body generated (NOT_SET)
            valid = validator.is_valid(body)
            ok, text = _accepted(client, method, path, body)
            checked += 1
            if ok != valid:
                wrong.append(f"{method.upper()} {path} {json.dumps(body)[:200]}: schema says "
                             f"{'valid' if valid else 'invalid'}, server {'accepted' if ok else 'refused'}: {text}")

        try:
            run()
        except Exception as e:  # hypothesis: no negative body exists for a schema without constraints
            if mode == "positive" or "Unsatisfiable" not in type(e).__name__:
                raise
    assert checked > 30, checked
    assert not wrong, "\n".join(wrong[:10])


@pytest.mark.parametrize("method, path, body, accepted", [
    ("post", "/v1/checkpoints/{cid}/fork", {"count": 62.0}, True),  # JSON Schema's integer
    ("post", "/v1/checkpoints/{cid}/fork", {"count": 62.5}, False),
    ("post", "/v1/checkpoints/{cid}/fork", {"count": True}, False),
    ("post", "/v1/checkpoints/{cid}/fork", {"count": 65}, False),
    ("post", "/v1/sandboxes", {"image": "Busybox"}, False),          # names are lower case
    ("post", "/v1/sandboxes", {"image": "busybox", "name": "a/b"}, False),
    ("post", "/v1/sandboxes", {"image": "busybox", "limits": {"pids": 64.0}}, True),
    ("post", "/v1/sandboxes/{sid}/exec", {"cmd": []}, False),
    ("post", "/v1/sandboxes/{sid}/exec", {"cmd": ""}, False),
    ("post", "/v1/sandboxes/{sid}/exec", {"cmd": ["true"], "env": {"A=B": "x"}}, False),
    ("post", "/v1/sandboxes/{sid}/exec", {"cmd": ["a\u0000b"]}, False),
    ("post", "/v1/sandboxes/{sid}/rollback", {"checkpoint": 3.0}, True),
    ("put", "/v1/sandboxes/{sid}/budget", {"turns": 2.0, "cost": 1}, True),
    ("put", "/v1/sandboxes/{sid}/budget", {"turns": "2"}, False),
])
def test_the_cases_the_fuzzer_found_agree_with_the_schema(app: Any, client: Any, method: str, path: str,
                                                         body: Any, accepted: bool) -> None:
    spec = app.openapi()
    schema = spec["paths"][path][method]["requestBody"]["content"]["application/json"]["schema"]
    assert jsonschema_rs.validator_for({**schema, "components": spec["components"]}).is_valid(body) is accepted
    assert _accepted(client, method, path, body)[0] is accepted


def test_links_lead_from_creates_to_the_operations_that_take_their_ids(app: Any) -> None:
    spec = app.openapi()
    ops = {op["operationId"]: (m, p) for p, o in spec["paths"].items() for m, op in o.items()}
    created = spec["paths"]["/v1/sandboxes"]["post"]["responses"]["201"]["links"]
    assert {"exec", "get_sandbox", "create_checkpoint", "rollback", "intent", "set_budget"} <= set(created)
    assert created["exec"]["parameters"] == {"sid": "$response.body#/id"}
    ck = spec["paths"]["/v1/sandboxes/{sid}/checkpoints"]["post"]["responses"]["201"]["links"]
    assert ck["diff"]["parameters"] == {"a": "$response.body#/id", "b": "$response.body#/id"}
    assert ck["rollback"]["requestBody"] == {"checkpoint": "$response.body#/id"}
    intent = spec["paths"]["/v1/sandboxes/{sid}/effects/intent"]["post"]["responses"]["200"]["links"]
    assert set(intent) == {"effect_commit", "effect_fail", "effect_unknown", "reconcile", "get_effect"}
    for producer in (created, ck, intent):
        assert all(link["operationId"] in ops for link in producer.values())


def test_cpu_quota_under_the_kernels_minimum_is_refused_as_invalid() -> None:
    """cpus=0.002 (a 200 us quota) passed validation and failed in runc's
    cgroup write: a 500 that test_api_fuzz's stateful run found. The smallest
    quota the kernel takes is 1 ms of the 100 ms period: cpus 0.01."""
    import pydantic

    from crabd.api import LimitsIn
    with pytest.raises(pydantic.ValidationError):
        LimitsIn(cpus=0.002)
    assert LimitsIn(cpus=0.01).cpus == 0.01
