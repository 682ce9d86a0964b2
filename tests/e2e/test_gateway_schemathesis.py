"""Property-based tests of the live gateway against its own OpenAPI schema (schemathesis).

A real worker serves the tiny random model (with a tokenizer; `--max-model-len 256`, so any
generated `max_tokens` is either refused with a 400 or finishes quickly) behind a gateway process,
and every operation in `/openapi.json` gets generated requests carrying a valid tenant API key.
Requests for the completion endpoints are pointed at the served model, so generated sampling
parameters reach the worker instead of stopping at a 404.

Checks: no 5xx anywhere, and schemathesis' response checks (status codes, content types and
bodies as documented, invalid input rejected). Relaxed, because they fight OpenAI semantics:
`positive_data_acceptance` (a schema-valid body is still refused when the model does not exist,
the prompt is over the context length or a key lacks a scope: 400/403/404 are the right answers).
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from inferplane.bench.gateway_harness import SERVED_MODEL
from tests.e2e.single_worker import single_worker_gateway

pytestmark = pytest.mark.slow

_INFERENCE_PATHS = ("/v1/completions", "/v1/chat/completions")
_EXAMPLES = 25  # per operation and mode: 10 operations x 2 modes stay well under two minutes


@pytest.fixture(scope="module")
def live_gateway(tmp_path_factory):
    with single_worker_gateway(tmp_path_factory, max_num_seqs=16) as running:
        yield running.gateway
        assert running.gateway.stop() == 0, (running.logs / "gateway.log").read_text()


@pytest.fixture(scope="module")
def api_schema(live_gateway):
    return schemathesis.openapi.from_url(f"{live_gateway.base_url}/openapi.json")


def _exercise(operation, mode: GenerationMode, key: str) -> None:
    """Runs hypothesis over one operation. (schemathesis' `pytest.from_fixture` would do this per
    operation, but its lazy loader writes `Function._nodeid`, which pytest 9 no longer has.)"""

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def run(case):
        model = case.body.get("model") if isinstance(case.body, dict) else None
        if case.path in _INFERENCE_PATHS and isinstance(model, str) and model:  # "" may be the negative mutation
            case.body["model"] = SERVED_MODEL
        response = case.call_and_validate(headers={"Authorization": f"Bearer {key}"},
                                          excluded_checks=[positive_data_acceptance], timeout=60)
        assert response.status_code < 500, response.text

    run()


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_every_operation_answers_as_documented_and_never_with_a_5xx(api_schema, live_gateway, mode):
    failures, tested = [], []
    for result in api_schema.get_all_operations():
        operation = result.ok()
        try:
            _exercise(operation, mode, live_gateway.key)
        except Unsatisfiable:  # negative mode: nothing to break (only optional strings and paths)
            assert mode is GenerationMode.NEGATIVE, operation.label
            continue
        except Exception as exc:
            failures.append(f"{operation.label}: {exc}")
        tested.append(operation.label)
    assert "POST /v1/completions" in tested and "POST /v1/chat/completions" in tested
    assert not failures, "\n\n".join(failures)
