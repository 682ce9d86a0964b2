"""Issue 59: a key made through the database (`inferplane keys create`) works at once.

Before, the gateway refused it until its key cache's next refresh (up to a second). Now a request
with a key the cache does not hold makes the cache catch up once, off the event loop, and is
answered by what the database says. Requests waiting together share one refresh, and a flood of
made-up keys costs a bounded number of small reads.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from inferplane.control_plane import auth, tenants
from inferplane.control_plane.gateway.rest import create_asgi_app
from inferplane.control_plane.gateway.server import Gateway, GatewaySettings

pytestmark = pytest.mark.usefixtures("no_proxy")


@pytest.fixture
def gateway(tmp_path):
    # The periodic refresh never comes within the test: only a catch-up can make a new key known.
    gw = Gateway(GatewaySettings(db_url=f"sqlite:///{tmp_path / 'gw.db'}", key_refresh_interval=3600))
    with gw.sessions.begin() as s:
        tenants.create_tenant(s, "acme", actor="t")
    gw.keys.refresh(full=True)
    yield gw
    gw.engine.dispose()


async def test_a_key_made_in_the_database_works_at_once(gateway) -> None:
    with gateway.sessions.begin() as s:  # as `inferplane keys create` does: the database, not the gateway
        fresh = auth.create_key(s, "acme", actor="cli").secret
        admin = auth.create_key(s, "acme", actor="cli", scopes="admin").secret
    transport = httpx.ASGITransport(create_asgi_app(gateway.context))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=30) as http:
        assert (await http.get("/v1/models", headers={"Authorization": f"Bearer {fresh}"})).status_code == 200
        listed = await http.get("/admin/v1/keys", headers={"Authorization": f"Bearer {admin}"})
        assert listed.status_code == 200, listed.text
        # the fast path (completions) catches up as well: past authentication, the model is what is missing
        with gateway.sessions.begin() as s:
            newer = auth.create_key(s, "acme", actor="cli").secret
        answer = await http.post("/v1/completions", headers={"Authorization": f"Bearer {newer}"},
                                 json={"model": "none", "prompt": "hi"})
        assert answer.status_code == 404, answer.text
        # a key that is not in the database is still refused
        made_up = fresh[:-4] + "XXXX"
        assert (await http.get("/v1/models", headers={"Authorization": f"Bearer {made_up}"})).status_code == 401


async def test_made_up_keys_share_bounded_refreshes(gateway) -> None:
    transport = httpx.ASGITransport(create_asgi_app(gateway.context))
    before = gateway.keys.catch_ups
    started = time.monotonic()
    async with httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=30) as http:
        answers = await asyncio.gather(*(http.get("/v1/models", headers={
            "Authorization": f"Bearer ip_{i:016x}_{'s' * 32}"}) for i in range(60)))
    assert {a.status_code for a in answers} == {401}
    elapsed = time.monotonic() - started
    # at most one refresh per CATCH_UP_INTERVAL_S (and the one already running when the window opens)
    assert gateway.keys.catch_ups - before <= 2 + elapsed / auth.CATCH_UP_INTERVAL_S
    assert gateway.keys.catch_ups - before < 60
