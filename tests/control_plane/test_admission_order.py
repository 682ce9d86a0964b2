"""Issue 53, class 6: refused work is not free, and a prompt's work leaves the event loop.

Before, the gateway tokenized a prompt on its event loop before any limit was applied: a key
limited to 5 requests a minute sent 18-28 one-megabyte prompts in 15 s, each a 400 (too long),
none a 429, while another tenant's p95 went from 40 ms to over a second; the gRPC API took a 3 MiB
prompt (1.4 s, /healthz 0.9 s meanwhile). Now, on REST (completions, chat, embeddings) and gRPC
alike, through a real gateway on loopback ports in front of a real gRPC worker:

- a request is charged to its key's requests per minute before its prompt is read: a limited key's
  prompts that are refused (400) still count, and once its limit is spent it gets 429s, also for
  prompts that would have been refused, without its prompt being tokenized;
- a prompt with more bytes than the context can hold tokens of is refused without tokenizing it
  (prompt_bound.py), while one under that bound is still tokenized and counted;
- a large prompt's chat template and tokenizing run on a thread, and the loop answers /healthz
  while a prompt is being tokenized;
- a gRPC message over the REST body limit is refused by the server.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, fields
from pathlib import Path

import grpc
import httpx
import pytest

from inferplane.api.tokenizer import TextTokenizer
from inferplane.bench.gateway_harness import free_port
from inferplane.control_plane import auth, tenants
from inferplane.control_plane.gateway.catalog import ServedModel
from inferplane.control_plane.gateway.server import Gateway, GatewaySettings
from inferplane.control_plane.routing import Deployment, StaticEndpointSource
from inferplane.v1 import inference_pb2, inference_pb2_grpc, worker_pb2
from tests.control_plane.fake_worker import RecordingWorker, serve

pytestmark = pytest.mark.usefixtures("no_proxy")

CONTEXT = 256  # "m" and "e"; the tiny tokenizer: a token stands for at most 4 bytes, so 1,020 bytes fit at most
BIG_CONTEXT = 100_000  # "big" and "ebig": large prompts that fit
LIMIT = 2  # the limited key's requests per minute
OVER = "word " * 120  # 600 characters: under the byte bound, over the context once tokenized
HUGE = "word " * 10_000  # 50,000 characters: over the byte bound
LARGE = "word " * 4_000  # 20,000 characters: tokenized on a thread, fits the big context
PATIENCE = 30.0


@dataclass(eq=False)
class RecordingTokenizer(TextTokenizer):
    """The tiny model's tokenizer, recording which thread renders and tokenizes; `hold` makes the
    tokenizing of a large text wait (at most PATIENCE) until it is set."""

    calls: list[tuple[str, int]] = field(default_factory=list)
    hold: threading.Event | None = None
    entered: threading.Event = field(default_factory=threading.Event)
    finished: threading.Event = field(default_factory=threading.Event)

    @classmethod
    def of(cls, base: TextTokenizer) -> RecordingTokenizer:
        return cls(**{f.name: getattr(base, f.name) for f in fields(TextTokenizer) if f.init})

    def _record(self, name: str, size: int) -> None:
        self.calls.append((name, threading.get_ident()))
        if self.hold is not None and size > 10_000:
            self.entered.set()
            self.hold.wait(PATIENCE)
            self.finished.set()

    def encode(self, text: str) -> list[int]:
        self._record("encode", len(text))
        return super().encode(text)

    def encode_inputs(self, texts):
        self._record("encode_inputs", sum(len(t) for t in texts))
        return super().encode_inputs(texts)

    def apply_chat_template(self, messages, *args, **kwargs) -> str:
        self._record("apply_chat_template", 0)
        return super().apply_chat_template(messages, *args, **kwargs)

    def tokenized(self) -> int:
        return sum(1 for name, _ in self.calls if name != "apply_chat_template")


@dataclass
class Served:
    gateway: Gateway
    tokenizer: RecordingTokenizer
    limited: str
    free: str
    base_url: str
    grpc_address: str
    loop_thread: int


@pytest.fixture
async def served(tmp_path: Path, tokenizer) -> AsyncIterator[Served]:
    worker = RecordingWorker(tokenizer)
    server, address = await serve(worker)
    port, grpc_port = free_port(), free_port()
    gw = Gateway(GatewaySettings(db_url=f"sqlite:///{tmp_path / 'gw.db'}", port=port, grpc_port=grpc_port,
                                 drain_grace_seconds=1))
    with gw.sessions.begin() as s:
        tenants.create_tenant(s, "t", actor="test")
        limited = auth.create_key(s, "t", actor="test", requests_per_minute=LIMIT).secret
        free = auth.create_key(s, "t", actor="test").secret
    recording = RecordingTokenizer.of(tokenizer)
    for name, context, kind in [("m", CONTEXT, "generate"), ("big", BIG_CONTEXT, "generate"),
                                ("e", CONTEXT, "embedding"), ("ebig", BIG_CONTEXT, "embedding")]:
        gw.catalog.put(ServedModel(name=name, tokenizer=recording, max_model_len=context, kind=kind,  # type: ignore[arg-type]
                                   dimensions=8 if kind == "embedding" else None))
        gw.router.set_route(name, [Deployment(f"d-{name}", StaticEndpointSource([address]))])
    await gw.start()
    try:
        yield Served(gw, recording, limited, free, f"http://127.0.0.1:{port}", f"127.0.0.1:{grpc_port}",
                     threading.get_ident())
    finally:
        if recording.hold is not None:
            recording.hold.set()
        await gw.stop()
        await server.stop(None)


def _body(endpoint: str, model: str, text: str) -> tuple[str, dict]:
    if endpoint == "completions":
        return "/v1/completions", {"model": model, "prompt": text, "max_tokens": 1}
    if endpoint == "chat":
        return "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": text}],
                                        "max_tokens": 1}
    return "/v1/embeddings", {"model": "e" if model == "m" else "ebig", "input": text}


async def _post(s: Served, key: str, endpoint: str, text: str, model: str = "m") -> httpx.Response:
    path, body = _body(endpoint, model, text)
    async with httpx.AsyncClient(base_url=s.base_url, timeout=PATIENCE) as client:
        return await client.post(path, json=body, headers={"authorization": f"Bearer {key}"})


async def _grpc(s: Served, key: str, method: str, text: str, model: str = "m") -> grpc.StatusCode:
    """The call's status code (OK when it was answered)."""
    options = [("grpc.max_send_message_length", 64 << 20)]
    metadata = [("authorization", f"Bearer {key}")]
    async with grpc.aio.insecure_channel(s.grpc_address, options=options) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        try:
            if method == "Embed":
                await stub.Embed(inference_pb2.EmbeddingsRequest(model="e" if model == "m" else "ebig", texts=[text]),
                                 metadata=metadata, timeout=PATIENCE)
            else:
                call = stub.Complete(inference_pb2.CompleteRequest(model=model, prompt=text),
                                     metadata=metadata, timeout=PATIENCE) if method == "Complete" else \
                    stub.Chat(inference_pb2.ChatRequest(model=model, messages=[
                        worker_pb2.ChatMessage(role="user", content=text)]), metadata=metadata, timeout=PATIENCE)
                async for _ in call:
                    pass
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


# -- limits before work ------------------------------------------------------------------------------


@pytest.mark.parametrize("endpoint", ["completions", "chat", "embeddings"])
@pytest.mark.parametrize("text", [OVER, HUGE], ids=["tokenized-then-refused", "over-the-byte-bound"])
async def test_a_limited_keys_refused_prompts_count_and_then_it_gets_429(served: Served, endpoint: str,
                                                                         text: str) -> None:
    for _ in range(LIMIT):
        refused = await _post(served, served.limited, endpoint, text)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["code"] == "context_length_exceeded"
    tokenized = served.tokenizer.tokenized()
    for prompt in (text, "hi"):  # a prompt that would be refused, then one that would be served
        limited = await _post(served, served.limited, endpoint, prompt)
        assert limited.status_code == 429, limited.text
        assert limited.json()["error"]["code"] == "rate_limit_exceeded" and "retry-after" in limited.headers
    assert served.tokenizer.tokenized() == tokenized  # a 429 reads no prompt


@pytest.mark.parametrize("method", ["Complete", "Chat", "Embed"])
async def test_the_grpc_api_charges_the_request_before_its_prompt(served: Served, method: str) -> None:
    codes = [await _grpc(served, served.limited, method, prompt) for prompt in [HUGE] * (LIMIT + 1) + ["hi"]]
    assert codes == [grpc.StatusCode.INVALID_ARGUMENT] * LIMIT + [grpc.StatusCode.RESOURCE_EXHAUSTED] * 2


# -- a prompt that cannot fit is not tokenized ---------------------------------------------------------


@pytest.mark.parametrize("endpoint", ["completions", "chat", "embeddings"])
async def test_a_prompt_over_the_byte_bound_is_refused_without_tokenizing(served: Served, endpoint: str) -> None:
    refused = await _post(served, served.free, endpoint, HUGE)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert error["param"] == {"completions": "prompt", "chat": "messages", "embeddings": "input"}[endpoint]
    assert served.tokenizer.tokenized() == 0
    # Under the bound, the prompt is tokenized to be counted: the same refusal, with its tokens.
    refused = await _post(served, served.free, endpoint, OVER)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
    assert served.tokenizer.tokenized() == 1


async def test_a_list_of_prompts_and_grpc_are_bounded_alike(served: Served) -> None:
    async with httpx.AsyncClient(base_url=served.base_url, timeout=PATIENCE) as client:
        refused = await client.post("/v1/completions", json={"model": "m", "prompt": ["hi", HUGE], "max_tokens": 1},
                                    headers={"authorization": f"Bearer {served.free}"})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded", refused.text
    assert await _grpc(served, served.free, "Complete", HUGE) == grpc.StatusCode.INVALID_ARGUMENT
    assert served.tokenizer.tokenized() == 0


# -- the work leaves the loop --------------------------------------------------------------------------


async def test_large_prompts_are_rendered_and_tokenized_off_the_event_loop(served: Served) -> None:
    for endpoint in ("completions", "chat", "embeddings"):
        answer = await _post(served, served.free, endpoint, LARGE, model="big")
        assert answer.status_code != 400, answer.text  # it fits (the fake worker has no Embed: 503 there)
    for method in ("Complete", "Chat", "Embed"):
        assert await _grpc(served, served.free, method, LARGE, model="big") != grpc.StatusCode.INVALID_ARGUMENT
    names = {name for name, _ in served.tokenizer.calls}
    assert names == {"encode", "encode_inputs", "apply_chat_template"}, served.tokenizer.calls
    on_the_loop = [name for name, thread in served.tokenizer.calls if thread == served.loop_thread]
    assert not on_the_loop, on_the_loop


async def test_the_loop_answers_healthz_while_a_prompt_is_tokenized(served: Served) -> None:
    served.tokenizer.hold = threading.Event()
    request = asyncio.create_task(_post(served, served.free, "completions", LARGE, model="big"))
    try:
        assert await asyncio.to_thread(served.tokenizer.entered.wait, PATIENCE)
        async with httpx.AsyncClient(base_url=served.base_url, timeout=PATIENCE) as client:
            assert (await client.get("/healthz")).status_code == 200
        # Answered while the tokenizer was still at work (had it held the loop, /healthz would have
        # waited for it to give up).
        assert not served.tokenizer.finished.is_set()
    finally:
        served.tokenizer.hold.set()
    assert (await request).status_code == 200


# -- gRPC messages are bounded as REST bodies are --------------------------------------------------------


@pytest.mark.parametrize("method", ["Complete", "Embed"])
async def test_a_grpc_message_over_the_body_limit_is_refused(served: Served, method: str) -> None:
    limit = served.gateway.context.max_body_bytes
    assert await _grpc(served, served.free, method, "w" * (2 * limit)) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert served.tokenizer.tokenized() == 0
    # Just under the limit: taken, and refused for its length.
    assert await _grpc(served, served.free, method, "w" * (limit - 1024)) == grpc.StatusCode.INVALID_ARGUMENT
