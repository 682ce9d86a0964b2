"""LoRA adapters through the OpenAI API, end to end: registered in the registry, served under their
own model ids by a real worker of their base (SmolLM2), listed with `parent` for the keys that may
use them, private to their tenant (404 as for an unknown name), counted in usage per adapter, and
rolled to a new version's weights."""

from __future__ import annotations

import httpx
import openai
import pytest

from inferplane.api.model_config import read_model_config
from inferplane.api.model_resolution import builtin_model_path
from inferplane.bench.gateway_harness import free_port, start_worker, stop_worker, wait_serving
from inferplane.bench.lora import write_random_adapter
from inferplane.control_plane import auth, registry, tenants
from inferplane.control_plane.gateway.catalog import ServedModel
from inferplane.control_plane.gateway.rest import create_asgi_app
from inferplane.control_plane.gateway.server import Gateway, GatewaySettings
from inferplane.control_plane.routing import Deployment, StaticEndpointSource
from inferplane.control_plane.usage import query_usage
from inferplane.v1 import worker_pb2

pytestmark = pytest.mark.slow  # a worker process loads SmolLM2
BASE = "smollm2"
PROMPT = "The capital of France is"
ADMIN_KEY = "ip_admin_test_bootstrap_key_0123456789"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """Three random adapters strong enough to change SmolLM2's answer, and what each answers
    (the offline engine: tests/worker/test_lora.py holds it equal to each merged model)."""
    from inferplane import LLM, SamplingParams
    from inferplane.worker.lora import LoraRequest

    root = tmp_path_factory.mktemp("adapters")
    config = read_model_config(builtin_model_path("smollm2-135m"))
    folders = {name: write_random_adapter(root / name, config, 8, ["q_proj", "v_proj", "down_proj"], seed=seed,
                                          b_scale=0.5)
               for name, seed in (("acme-bot", 1), ("support-v1", 2), ("support-v2", 3))}
    llm = LLM("smollm2-135m", device="cpu", dtype="float32", max_loras=2)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    answers = {None: llm.generate(PROMPT, params)[0].text}
    for name, folder in folders.items():
        answers[name] = llm.generate(PROMPT, params, lora_request=LoraRequest(name, str(folder)))[0].text
    assert len(set(answers.values())) == 4, answers  # every adapter changes the answer
    return root, folders, answers


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    address = f"127.0.0.1:{free_port()}"
    log = tmp_path_factory.mktemp("logs") / "worker.log"
    proc = start_worker("smollm2-135m", int(address.rsplit(":", 1)[1]), "--dtype", "float32", "--max-loras", "2",
                        "--max-lora-rank", "8", "--served-model-name", BASE, log_path=str(log))
    try:
        wait_serving(address, proc, timeout=300)
        import grpc

        from inferplane.v1 import worker_pb2_grpc

        with grpc.insecure_channel(address) as channel:
            info = worker_pb2_grpc.WorkerStub(channel).Info(worker_pb2.InfoRequest(), timeout=60)
        yield address, info
    finally:
        stop_worker(proc)


@pytest.fixture
def gateway(worker, adapters, tmp_path):
    """SmolLM2 registered and served (as the cluster sync publishes it: with its registry digest)."""
    address, info = worker
    root, _, _ = adapters
    gw = Gateway(GatewaySettings(db_url=f"sqlite:///{tmp_path / 'gw.db'}", model_roots=(str(root),),
                                 bootstrap_key=ADMIN_KEY))
    with gw.sessions.begin() as session:
        base = registry.register_model(session, "smollm2-135m", actor="test")
    gw.catalog.put(ServedModel.from_info(BASE, info, weights_sha256=frozenset({base.sha256})))
    gw.router.set_route(BASE, [Deployment("smollm2", StaticEndpointSource([address]))])
    yield gw
    gw.engine.dispose()


def new_key(gw: Gateway, tenant: str) -> str:
    with gw.sessions.begin() as session:
        tenants.create_tenant(session, tenant, actor="test")
        key = auth.create_key(session, tenant, actor="test").secret
    gw.keys.refresh()
    return key


def client(gw: Gateway, key: str) -> openai.AsyncOpenAI:
    transport = httpx.ASGITransport(create_asgi_app(gw.context))
    return openai.AsyncOpenAI(base_url="http://gw/v1", api_key=key, timeout=300, max_retries=0,
                              http_client=httpx.AsyncClient(transport=transport, base_url="http://gw"))


async def admin_post(gw: Gateway, path: str, body: dict) -> httpx.Response:
    transport = httpx.ASGITransport(create_asgi_app(gw.context), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=300) as http:
        return await http.post(path, json=body, headers={"authorization": f"Bearer {ADMIN_KEY}"})


async def complete(c: openai.AsyncOpenAI, model: str) -> str:
    answer = await c.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True})
    assert answer.model == model
    return answer.choices[0].text


async def test_adapters_are_served_listed_isolated_counted_and_rolled(gateway, adapters) -> None:
    root, folders, answers = adapters
    acme, globex = new_key(gateway, "acme"), new_key(gateway, "globex")
    with gateway.sessions.begin() as session:  # a tenant's private adapter, as its admin registers it
        registry.register_adapter(session, folders["acme-bot"], actor="key:acme", base="smollm2-135m",
                                  owner_tenant_id="acme")
    # the platform's public adapter, through the admin API (served at once: the API refreshes the catalog)
    response = await admin_post(gateway, "/admin/v1/adapters", {"source": str(folders["support-v1"]),
                                                                "base": "smollm2-135m", "name": "support"})
    assert response.status_code == 201, response.text
    assert (response.json()["kind"], response.json()["base_model"]) == ("adapter", "smollm2-135m:1")
    refused = await admin_post(gateway, "/admin/v1/adapters", {"source": str(folders["support-v1"]),
                                                               "base": "no-such-model"})
    assert refused.status_code == 404
    gateway.adapters.refresh()

    async with client(gateway, acme) as c:
        cards = {m.id: m for m in (await c.models.list()).data}
        assert set(cards) == {BASE, "acme-bot", "support"}
        assert cards["acme-bot"].model_extra["parent"] == BASE and cards["support"].model_extra["parent"] == BASE
        assert await complete(c, BASE) == answers[None]
        assert await complete(c, "acme-bot") == answers["acme-bot"]
        assert await complete(c, "support") == answers["support-v1"]
    async with client(gateway, globex) as c:
        assert {m.id for m in (await c.models.list()).data} == {BASE, "support"}
        with pytest.raises(openai.NotFoundError) as hidden:
            await complete(c, "acme-bot")
        with pytest.raises(openai.NotFoundError) as unknown:
            await complete(c, "acme-botx")
        assert hidden.value.message.replace("acme-bot", "X") == unknown.value.message.replace("acme-botx", "X")
        assert await complete(c, "support") == answers["support-v1"]

    gateway.usage.flush()
    with gateway.sessions() as session:
        assert sum(r.requests for r in query_usage(session, "acme", model="acme-bot")) == 1
        assert sum(r.requests for r in query_usage(session, "acme", model="support")) == 1
        assert sum(r.requests for r in query_usage(session, "globex", model="support")) == 1

    # version 2 of "support" while version 1's answers stream: those finish on version 1, the
    # requests after the switch run version 2, and none fails
    async with client(gateway, globex) as c:
        streams = [await c.completions.create(model="support", prompt=PROMPT, max_tokens=8, temperature=0,
                                              stream=True, extra_body={"ignore_eos": True}) for _ in range(3)]
        firsts = [await anext(aiter(s)) for s in streams]  # each is running on a replica now
        with gateway.sessions.begin() as session:
            v2 = registry.register_adapter(session, folders["support-v2"], actor="test", base="smollm2-135m",
                                           name="support")
        assert v2.version == "2"
        gateway.adapters.refresh()
        after = [await complete(c, "support") for _ in range(2)]
        before = []
        for first, stream in zip(firsts, streams, strict=True):
            before.append(first.choices[0].text + "".join([chunk.choices[0].text async for chunk in stream
                                                           if chunk.choices]))
    assert before == [answers["support-v1"]] * 3 and after == [answers["support-v2"]] * 2


async def test_an_adapter_above_the_replicas_rank_is_a_400_naming_the_model_field(gateway, adapters) -> None:
    """The registry cannot know a deployment's maxLoraRank; the replica refuses the adapter at request
    time with a 400 whose param is the request's `model` (the adapter), not an internal error."""
    root, _, _ = adapters
    config = read_model_config(builtin_model_path("smollm2-135m"))
    wide = write_random_adapter(root / "wide-bot", config, 16, ["q_proj"], seed=9)  # the worker's max: 8
    with gateway.sessions.begin() as session:
        registry.register_adapter(session, wide, actor="test", base="smollm2-135m")
    gateway.adapters.refresh()
    async with client(gateway, new_key(gateway, "initech")) as c:
        for _ in range(2):  # the second refused from the worker's memory of the first
            with pytest.raises(openai.BadRequestError) as err:
                await complete(c, "wide-bot")
            body = err.value.body
            assert body["param"] == "model", body
            assert "adapter 'wide-bot'" in body["message"] and "rank 16, above max_lora_rank 8" in body["message"]
