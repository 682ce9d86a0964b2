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


_GRPC_SERVER_FAULTS = {"INTERNAL", "UNKNOWN", "DATA_LOSS", "UNIMPLEMENTED"}  # gRPC's 5xx of a bug


def test_grpc_bodies_never_meet_a_server_fault(live_gateway):
    """The tenant gRPC API (issue 13: it skipped REST's validation): hypothesis builds Complete and
    Chat requests over every field's whole wire range (NaN and infinite floats, extreme integers,
    long stop lists, odd roles, empty everything) and none may end in a server-side fault."""
    import grpc
    from hypothesis import strategies as st

    from inferplane.v1 import inference_pb2, inference_pb2_grpc, worker_pb2

    floats = st.floats(width=32, allow_nan=True, allow_infinity=True)
    wild = st.builds(
        worker_pb2.SamplingParams,
        max_tokens=st.integers(0, 2**32 - 1) | st.integers(0, 300),
        temperature=floats, top_p=floats, top_k=st.integers(-(2**31), 2**31 - 1),
        seed=st.integers(0, 2**64 - 1), stop=st.lists(st.text(max_size=20), max_size=40),
        stop_token_ids=st.lists(st.integers(0, 2**32 - 1), max_size=300),
        ignore_eos=st.booleans(), logprobs=st.booleans())
    sane = st.builds(  # in range, so that requests also reach the worker and stream back
        worker_pb2.SamplingParams, max_tokens=st.integers(1, 16), temperature=st.floats(0, 2, width=32),
        top_p=st.floats(0, 1, width=32), top_k=st.integers(-1, 100), seed=st.integers(0, 2**64 - 1),
        stop=st.lists(st.text(min_size=1, max_size=5), max_size=3), ignore_eos=st.booleans(),
        logprobs=st.booleans())
    params = sane | wild
    text = st.text(max_size=200)
    models = st.sampled_from([SERVED_MODEL, SERVED_MODEL, "", "missing-model", "x" * 300])
    complete = st.builds(inference_pb2.CompleteRequest, model=models, prompt=text, params=params)
    chat = st.builds(inference_pb2.ChatRequest, model=models, params=params, messages=st.lists(
        st.builds(worker_pb2.ChatMessage, role=st.sampled_from(["user", "system", "assistant", "", "tool", "x"]),
                  content=text), max_size=5))
    metadata = (("authorization", f"Bearer {live_gateway.key}"),)
    seen: dict[str, int] = {}

    with grpc.insecure_channel(f"127.0.0.1:{live_gateway.grpc_port}") as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)

        @given(request=complete | chat)
        @settings(max_examples=120, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def run(request):
            call = stub.Complete if isinstance(request, inference_pb2.CompleteRequest) else stub.Chat
            try:
                for _ in call(request, metadata=metadata, timeout=60):
                    pass
                code = "OK"
            except grpc.RpcError as exc:
                code = exc.code().name
                assert code not in _GRPC_SERVER_FAULTS, f"{code}: {exc.details()} for {request}"
            seen[code] = seen.get(code, 0) + 1

        run()
    assert seen.get("OK", 0) > 0 and seen.get("INVALID_ARGUMENT", 0) > 0, seen  # both paths were exercised
