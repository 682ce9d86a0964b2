"""Issue 53, item 9: `/v1/models` lists each id once, and the entry it lists is the one a request
for that id gets.

A tenant's private adapter keeps its name when the platform later registers a public adapter of
the same name (registry.claim_name: "a tenant's older name stays its own"), so the tenant's listing
showed that id twice. The catalog now lists, per name, what `Catalog.get` answers for it: a served
model over any adapter, the tenant's own adapter over the public one.
"""

from __future__ import annotations

import itertools

import httpx
import pytest

from inferplane.control_plane import auth, tenants
from inferplane.control_plane.gateway.catalog import AdapterRecord, Catalog, ServedModel
from inferplane.control_plane.gateway.rest import create_asgi_app
from inferplane.control_plane.gateway.server import Gateway, GatewaySettings

BASE_SHA = "b" * 64


def _adapter(name: str, owner: str | None, base_sha: str = BASE_SHA) -> AdapterRecord:
    return AdapterRecord(name=name, owner_tenant=owner, uri=f"file:///adapters/{owner}/{name}", sha256="a" * 64,
                         base_sha256=base_sha, created=0)


def _catalog(tokenizer) -> Catalog:
    catalog = Catalog()
    catalog.put(ServedModel(name="base", tokenizer=tokenizer, max_model_len=256, weights_sha256=frozenset({BASE_SHA})))
    catalog.put(ServedModel(name="shadowed", tokenizer=tokenizer, max_model_len=256))
    catalog.set_adapters([
        _adapter("bot", "acme"),  # acme's, registered first
        _adapter("bot", None),  # then the platform's public one of the same name
        _adapter("bot", "beta"),
        _adapter("shadowed", None),  # a served model's name: the served model wins
        _adapter("shadowed", "acme"),
        _adapter("orphan", "acme", base_sha="c" * 64),  # its base is not served: 404, not listed
        _adapter("orphan", None),  # ... and the public one does not stand in for acme's (get would not)
        _adapter("solo", "beta"),
    ])
    return catalog


@pytest.mark.parametrize("tenant", ["acme", "beta", "gamma", None])
def test_each_id_is_listed_once_as_get_answers_it(tokenizer, tenant: str | None) -> None:
    catalog = _catalog(tokenizer)
    listed = catalog.visible(tenant)
    names = [m.name for m in listed]
    assert len(names) == len(set(names)), names
    assert names == sorted(names)
    for model in listed:
        assert catalog.get(model.name, tenant) is model


def test_who_sees_which(tokenizer) -> None:
    catalog = _catalog(tokenizer)
    owners = {t: {m.name: m.owner_tenant for m in catalog.visible(t)} for t in ("acme", "beta", "gamma")}
    assert owners["acme"] == {"base": None, "shadowed": None, "bot": "acme"}
    assert owners["beta"] == {"base": None, "shadowed": None, "bot": "beta", "orphan": None, "solo": "beta"}
    assert owners["gamma"] == {"base": None, "shadowed": None, "bot": None, "orphan": None}


async def test_the_openai_listing(tmp_path, tokenizer) -> None:
    gw = Gateway(GatewaySettings(db_url=f"sqlite:///{tmp_path / 'gw.db'}"), catalog=_catalog(tokenizer))
    try:
        with gw.sessions.begin() as s:
            keys = {}
            for tenant in ("acme", "gamma"):
                tenants.create_tenant(s, tenant, actor="t")
                keys[tenant] = auth.create_key(s, tenant, actor="t").secret
        gw.keys.refresh()
        transport = httpx.ASGITransport(create_asgi_app(gw.context))
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            for tenant, key in keys.items():
                answer = await client.get("/v1/models", headers={"authorization": f"Bearer {key}"})
                ids = [card["id"] for card in answer.json()["data"]]
                assert [i for i, group in itertools.groupby(sorted(ids)) if len(list(group)) > 1] == [], ids
                bot = next(card for card in answer.json()["data"] if card["id"] == "bot")
                assert bot["owned_by"] == ("acme" if tenant == "acme" else "inferplane")
    finally:
        gw.engine.dispose()
