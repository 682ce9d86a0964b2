"""Alert routing on SQLite and PostgreSQL: Alertmanager's webhook, storage and its transitions,
tenants' views, webhook management (admin API and CLI), and the signed, retried, restart-proof
delivery to tenants' receivers (an in-process httpx transport stands in for them here; the
end-to-end test in tests/e2e uses a real Alertmanager and a real HTTP receiver)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import httpx
import pytest
import sqlalchemy as sa

from inferplane.cli import main
from inferplane.control_plane import auth, tenants
from inferplane.control_plane.alerts.forwarder import AlertForwarder, ForwarderSettings
from inferplane.control_plane.alerts.webhooks import set_webhook
from inferplane.control_plane.gateway.rest import create_asgi_app
from inferplane.control_plane.gateway.server import Gateway, GatewaySettings
from inferplane.control_plane.orm import Alert, AlertDelivery

SECRET = "am-shared-secret-0123456789"
BOOTSTRAP = "ipadmin_" + "c" * 40
HOOK_SECRET = "acme-hook-secret-0123456789"
FAST = ForwarderSettings(base_delay=0.02, max_attempts=4, poll_interval=0.2, timeout=5)


@pytest.fixture
def gateway(db_url):
    gw = Gateway(GatewaySettings(db_url=db_url, bootstrap_key=BOOTSTRAP, alert_webhook_secret=SECRET))
    with gw.sessions.begin() as s:
        for tenant in ("acme", "globex"):
            tenants.create_tenant(s, tenant, actor="test")
        gw.keys_of = {t: auth.create_key(s, t, actor="test").secret for t in ("acme", "globex")}
        gw.admin_of = {t: auth.create_key(s, t, actor="test", scopes=["admin"]).secret for t in ("acme", "globex")}
    gw.keys.refresh()
    yield gw
    gw.engine.dispose()


def client(gw: Gateway) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(create_asgi_app(gw.context)), base_url="http://gw")


def alert(fingerprint: str, status: str = "firing", *, tenant: str | None = "acme",
          starts: str = "2026-12-01T10:00:00.123456789Z", **labels: str) -> dict:
    labels = {"alertname": "HighLatency", "severity": "warning", **labels}
    if tenant is not None:
        labels["tenant"] = tenant
    return {"status": status, "labels": labels, "annotations": {"summary": "p95 over the SLO"},
            "startsAt": starts, "endsAt": "2026-12-01T10:05:00Z" if status == "resolved" else "0001-01-01T00:00:00Z",
            "generatorURL": "http://prometheus/graph", "fingerprint": fingerprint}


def notification(*alerts: dict) -> dict:
    return {"version": "4", "groupKey": "{}:{}", "truncatedAlerts": 0, "status": alerts[0]["status"],
            "receiver": "inferplane", "groupLabels": {}, "commonLabels": {}, "commonAnnotations": {},
            "externalURL": "http://alertmanager", "alerts": list(alerts)}


async def post_alerts(gw: Gateway, *alerts: dict, secret: str | None = SECRET) -> httpx.Response:
    headers = {"Authorization": f"Bearer {secret}"} if secret else {}
    async with client(gw) as c:
        return await c.post("/alerts/v1/webhook", json=notification(*alerts), headers=headers)


def count(gw: Gateway, table) -> int:
    with gw.sessions() as s:
        return s.scalar(sa.select(sa.func.count()).select_from(table))


def deliveries(gw: Gateway) -> list[AlertDelivery]:
    with gw.sessions() as s:
        return list(s.scalars(sa.select(AlertDelivery).order_by(AlertDelivery.id)))


def add_hook(gw: Gateway, tenant: str = "acme", url: str = "http://receiver.test/hook") -> None:
    with gw.sessions.begin() as s:
        set_webhook(s, tenant, url, actor="test", secret=HOOK_SECRET)


class Receiver:
    """A tenant's webhook as an httpx transport: answers `codes` in turn (then 200), records calls."""

    def __init__(self, *codes: int) -> None:
        self.codes = list(codes)
        self.calls: list[httpx.Request] = []
        self.transport = httpx.MockTransport(self._handle)

    def _handle(self, request: httpx.Request) -> httpx.Response:
        self.calls.append(request)
        return httpx.Response(self.codes.pop(0) if self.codes else 200)


async def wait_for(predicate: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


# ---- the webhook ---------------------------------------------------------------------------------


async def test_the_webhook_needs_the_shared_secret(gateway):
    assert (await post_alerts(gateway, alert("a1"), secret=None)).status_code == 401
    wrong = await post_alerts(gateway, alert("a1"), secret="not-the-secret")
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_webhook_secret"
    assert count(gateway, Alert) == 0


async def test_without_a_configured_secret_the_webhook_says_so_with_a_503(tmp_path):
    gw = Gateway(GatewaySettings(db_url=f"sqlite:///{tmp_path / 'gw.db'}"))
    try:
        answer = await post_alerts(gw, alert("a1"))
        assert answer.status_code == 503 and "not configured" in answer.json()["error"]["message"]
    finally:
        gw.engine.dispose()


@pytest.mark.parametrize("breakage, param", [
    (lambda a: a.update(status="burning"), "alerts.1.status"),
    (lambda a: a.pop("fingerprint"), "alerts.1.fingerprint"),
    (lambda a: a["labels"].update(tenant=7), "alerts.1.labels.tenant"),
    (lambda a: a.update(startsAt="yesterday"), "alerts.1.startsAt"),
    (lambda a: a.update(fingerprint="a\x00b"), "alerts.1.fingerprint"),
    (lambda a: a.update(generatorURL="http://x/\x00"), "alerts.1.generatorURL"),
])
async def test_a_malformed_payload_is_a_400_naming_the_field_and_nothing_is_stored(gateway, breakage, param):
    add_hook(gateway)
    bad = alert("a2")
    breakage(bad)
    answer = await post_alerts(gateway, alert("a1"), bad)  # the first alert is fine: it must not be kept either
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param
    assert count(gateway, Alert) == 0 and count(gateway, AlertDelivery) == 0


async def test_a_body_that_is_not_json_or_not_version_4_is_a_400(gateway):
    async with client(gateway) as c:
        answer = await c.post("/alerts/v1/webhook", content=b"{nope", headers={"Authorization": f"Bearer {SECRET}"})
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "invalid_json"
    body = notification(alert("a1"))
    body["version"] = "5"
    async with client(gateway) as c:
        answer = await c.post("/alerts/v1/webhook", json=body, headers={"Authorization": f"Bearer {SECRET}"})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "version"
    assert count(gateway, Alert) == 0


# ---- storage and transitions ----------------------------------------------------------------------


async def test_firing_then_resolved_is_one_alert_and_two_deliveries(gateway):
    add_hook(gateway)
    assert (await post_alerts(gateway, alert("fp1"))).json() == {"received": 1, "transitions": 1, "deliveries": 1}
    # Alertmanager's repeat of a still-firing alert: no news, nothing enqueued
    assert (await post_alerts(gateway, alert("fp1"))).json()["deliveries"] == 0
    assert (await post_alerts(gateway, alert("fp1", "resolved"))).json()["deliveries"] == 1
    # a late retry of the firing notification does not reopen it
    assert (await post_alerts(gateway, alert("fp1"))).json()["deliveries"] == 0
    with gateway.sessions() as s:
        (row,) = s.scalars(sa.select(Alert)).all()
    assert row.status == "resolved" and row.tenant_id == "acme"
    assert row.starts_at == datetime(2026, 12, 1, 10, 0, 0, 123456, tzinfo=UTC)
    assert row.ends_at == datetime(2026, 12, 1, 10, 5, tzinfo=UTC)
    assert row.last_received_at >= row.first_received_at
    assert [(d.alert_status, d.state, d.webhook_url) for d in deliveries(gateway)] == [
        ("firing", "pending", "http://receiver.test/hook"), ("resolved", "pending", "http://receiver.test/hook")]
    # the same fingerprint firing again later is a new episode: one more delivery
    assert (await post_alerts(gateway, alert("fp1", starts="2026-12-02T08:00:00Z"))).json()["deliveries"] == 1
    assert count(gateway, Alert) == 1


async def test_platform_alerts_and_unknown_tenants_are_stored_without_a_tenant(gateway, caplog):
    add_hook(gateway)
    with caplog.at_level(logging.WARNING, logger="inferplane.control_plane.alerts.store"):
        answer = await post_alerts(gateway, alert("platform", tenant=None), alert("ghost", tenant="no-such-tenant"),
                                   alert("odd", tenant="acme\x00"))
    assert answer.status_code == 200 and answer.json() == {"received": 3, "transitions": 3, "deliveries": 0}
    with gateway.sessions() as s:
        assert {(a.fingerprint, a.tenant_id) for a in s.scalars(sa.select(Alert))} == {
            ("platform", None), ("ghost", None), ("odd", None)}
    assert "'no-such-tenant'" in caplog.text and "does not exist" in caplog.text


async def test_a_tenant_lists_its_own_alerts_only(gateway):
    await post_alerts(gateway, alert("acme-old", starts="2026-12-01T09:00:00Z"), alert("acme-new"),
                      alert("globex-1", tenant="globex"), alert("platform", tenant=None))
    await post_alerts(gateway, alert("acme-old", "resolved", starts="2026-12-01T09:00:00Z"))
    async with client(gateway) as c:
        def get(tenant: str, query: str = ""):
            return c.get(f"/v1/alerts{query}", headers={"Authorization": f"Bearer {gateway.keys_of[tenant]}"})

        acme = (await get("acme")).json()
        assert acme["tenant"] == "acme" and [a["fingerprint"] for a in acme["data"]] == ["acme-new", "acme-old"]
        assert acme["data"][0]["labels"]["tenant"] == "acme" and acme["data"][0]["deliveries"] == []
        assert [a["fingerprint"] for a in (await get("acme", "?status=resolved")).json()["data"]] == ["acme-old"]
        assert [a["fingerprint"] for a in (await get("globex")).json()["data"]] == ["globex-1"]
        bad = await get("acme", "?status=burning")
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "query.status"
        assert (await c.get("/v1/alerts")).status_code == 401


# ---- webhook management ---------------------------------------------------------------------------


async def test_the_admin_api_manages_webhooks_and_refuses_non_http_urls(gateway):
    async with client(gateway) as c:
        def put(key: str, tenant: str, **body):
            return c.put(f"/admin/v1/tenants/{tenant}/webhooks", json=body, headers={"Authorization": f"Bearer {key}"})

        for url in ("ftp://example.com/x", "file:///etc/passwd", "http://", "example.com/hook", "javascript:alert(1)"):
            refused = await put(BOOTSTRAP, "acme", url=url)
            assert refused.status_code == 422, (url, refused.text)
            assert refused.json()["error"]["param"] == "url" and refused.json()["error"]["message"].startswith("url:")
        short = await put(BOOTSTRAP, "acme", url="https://hooks.acme.test/a", secret="short")
        assert short.status_code == 422 and short.json()["error"]["param"] == "secret"
        assert (await put(gateway.admin_of["globex"], "acme", url="https://evil.test/")).status_code == 403
        assert (await put(gateway.keys_of["acme"], "acme", url="https://hooks.acme.test/a")).status_code == 403
        assert (await put(BOOTSTRAP, "nobody", url="https://hooks.acme.test/a")).status_code == 404
        assert (await put(BOOTSTRAP, "acme%00", url="https://hooks.acme.test/a")).status_code == 404

        created = await put(gateway.admin_of["acme"], "acme", url="https://hooks.acme.test/a")
        assert created.status_code == 201 and created.json()["secret"].startswith("whsec_")
        again = await put(BOOTSTRAP, "acme", url="https://hooks.acme.test/a", secret="x" * 20)
        assert again.status_code == 200 and "secret" not in again.json()
        listed = (await c.get("/admin/v1/tenants/acme/webhooks",
                              headers={"Authorization": f"Bearer {gateway.admin_of['acme']}"})).json()["data"]
        assert [w["url"] for w in listed] == ["https://hooks.acme.test/a"] and "secret" not in listed[0]
        hook_id = listed[0]["id"]
        assert (await c.delete(f"/admin/v1/tenants/acme/webhooks/{hook_id}",
                               headers={"Authorization": f"Bearer {gateway.admin_of['globex']}"})).status_code == 403
        assert (await c.delete(f"/admin/v1/tenants/acme/webhooks/{hook_id}",
                               headers={"Authorization": f"Bearer {BOOTSTRAP}"})).status_code == 200
        assert (await c.delete(f"/admin/v1/tenants/acme/webhooks/{hook_id}",
                               headers={"Authorization": f"Bearer {BOOTSTRAP}"})).status_code == 404


def test_the_cli_manages_webhooks_and_refuses_non_http_urls(db_url, capsys):
    db = ("--db-url", db_url)
    assert main(["tenants", "create", "acme", *db]) == 0
    capsys.readouterr()
    for url in ("ftp://example.com/x", "http://", "hooks.acme.test"):
        assert main(["tenants", "set-webhook", "acme", url, *db]) == 1
        assert "url:" in capsys.readouterr().err
    assert main(["tenants", "set-webhook", "acme", "https://hooks.acme.test/a", *db]) == 0
    out = capsys.readouterr().out
    assert "added webhook" in out and "whsec_" in out
    assert main(["tenants", "set-webhook", "acme", "https://hooks.acme.test/b", "--secret", "s" * 16, "--json",
                 *db]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["created"] is True and shown["secret"] is None  # a given secret is not echoed
    assert main(["tenants", "list-webhooks", "acme", "--json", *db]) == 0
    assert [w["url"] for w in json.loads(capsys.readouterr().out)] == ["https://hooks.acme.test/a",
                                                                       "https://hooks.acme.test/b"]
    assert main(["tenants", "remove-webhook", "acme", "https://hooks.acme.test/a", *db]) == 0
    assert main(["tenants", "remove-webhook", "acme", "99999999999999", *db]) == 1
    assert "no webhook" in capsys.readouterr().err


# ---- delivery -------------------------------------------------------------------------------------


async def test_a_failing_receiver_gets_the_signed_alert_on_the_third_attempt(gateway):
    add_hook(gateway)
    receiver = Receiver(500, 500)
    forwarder = AlertForwarder(gateway.sessions, FAST, transport=receiver.transport)
    gateway.context.alert_forwarder = forwarder
    forwarder.start()
    try:
        await post_alerts(gateway, alert("fp-retry"))
        await wait_for(lambda: deliveries(gateway)[0].state != "pending")
    finally:
        await forwarder.stop()
    (row,) = deliveries(gateway)
    assert (row.state, row.attempts, row.last_status_code, row.last_error) == ("delivered", 3, 200, None)
    assert row.delivered_at is not None and len(receiver.calls) == 3
    request = receiver.calls[-1]
    timestamp = request.headers["X-Inferplane-Timestamp"]
    expected = hmac.new(HOOK_SECRET.encode(), f"{timestamp}.".encode() + request.content, hashlib.sha256).hexdigest()
    assert request.headers["X-Inferplane-Signature"] == f"sha256={expected}"
    assert abs(int(timestamp) - datetime.now(UTC).timestamp()) < 300
    body = json.loads(request.content)
    assert body["fingerprint"] == "fp-retry" and body["status"] == "firing" and body["tenant"] == "acme"
    assert body["labels"]["alertname"] == "HighLatency" and body["endsAt"] is None
    assert body["startsAt"] == "2026-12-01T10:00:00.123456Z"
    async with client(gateway) as c:  # the tenant sees the delivery log with its alert: the outcome's class only
        listed = (await c.get("/v1/alerts", headers={"Authorization": f"Bearer {gateway.keys_of['acme']}"})).json()
    (log_entry,) = listed["data"][0]["deliveries"]
    assert (log_entry["state"], log_entry["attempts"], log_entry["outcome"]) == ("delivered", 3, "delivered")
    assert "last_status_code" not in log_entry and "last_error" not in log_entry


async def test_attempts_run_out_and_each_outcome_is_kept(gateway):
    add_hook(gateway)
    await post_alerts(gateway, alert("fp-down"))

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    forwarder = AlertForwarder(gateway.sessions, FAST, transport=httpx.MockTransport(refuse))
    forwarder.start()
    try:
        await wait_for(lambda: deliveries(gateway)[0].state != "pending")
    finally:
        await forwarder.stop()
    (row,) = deliveries(gateway)
    assert (row.state, row.attempts, row.last_status_code) == ("failed", FAST.max_attempts, None)
    assert "ConnectError" in row.last_error and row.next_attempt_at is None


async def test_resolved_is_never_delivered_before_firing(gateway):
    add_hook(gateway)
    receiver = Receiver(503, 503)
    await post_alerts(gateway, alert("fp-order"))
    await post_alerts(gateway, alert("fp-order", "resolved"))
    forwarder = AlertForwarder(gateway.sessions, FAST, transport=receiver.transport)
    forwarder.start()
    try:
        await wait_for(lambda: all(d.state == "delivered" for d in deliveries(gateway)))
    finally:
        await forwarder.stop()
    assert [json.loads(r.content)["status"] for r in receiver.calls] == ["firing"] * 3 + ["resolved"]


async def test_the_outbox_survives_a_restart(gateway, db_url):
    add_hook(gateway)
    first = Receiver(500)
    before = AlertForwarder(gateway.sessions, FAST, transport=first.transport)
    await post_alerts(gateway, alert("fp-restart"))  # no forwarder running: the row waits in the database
    assert await before.deliver_due() == 1  # one failed attempt, then the process "dies"
    await before.stop()
    (row,) = deliveries(gateway)
    assert (row.state, row.attempts, row.last_status_code) == ("pending", 1, 500)
    gateway.engine.dispose()

    restarted = Gateway(GatewaySettings(db_url=db_url, alert_webhook_secret=SECRET))
    try:
        receiver = Receiver()
        after = AlertForwarder(restarted.sessions, FAST, transport=receiver.transport)
        after.start()
        try:
            await wait_for(lambda: deliveries(restarted)[0].state == "delivered")
        finally:
            await after.stop()
        assert deliveries(restarted)[0].attempts == 2
        assert [json.loads(r.content)["fingerprint"] for r in receiver.calls] == ["fp-restart"]
    finally:
        restarted.engine.dispose()


async def test_a_pending_delivery_to_a_removed_webhook_fails_instead_of_going_out(gateway):
    add_hook(gateway)
    await post_alerts(gateway, alert("fp-removed"))
    with gateway.sessions.begin() as s:
        from inferplane.control_plane.alerts.webhooks import remove_webhook

        remove_webhook(s, "acme", "http://receiver.test/hook", actor="test")
    receiver = Receiver()
    assert await AlertForwarder(gateway.sessions, FAST, transport=receiver.transport).deliver_due() == 0
    (row,) = deliveries(gateway)
    assert row.state == "failed" and "removed" in row.last_error and row.webhook_id is None
    assert receiver.calls == []


def test_backoff_doubles_up_to_the_cap():
    forwarder = AlertForwarder(None, ForwarderSettings(base_delay=1.0, max_delay=10.0))  # type: ignore[arg-type]
    assert [forwarder.backoff(n) for n in range(1, 7)] == [1, 2, 4, 8, 10, 10]
    assert timedelta(seconds=forwarder.backoff(1)) == timedelta(seconds=1)


def test_the_gateway_reads_the_secret_from_a_file_or_the_environment(tmp_path, monkeypatch):
    import argparse

    from inferplane.control_plane.cli.gateway import configure, gateway_settings

    for name in ("INFERPLANE_ALERT_WEBHOOK_SECRET", "INFERPLANE_ALERT_WEBHOOK_SECRET_FILE"):
        monkeypatch.delenv(name, raising=False)

    def settings(*argv: str):
        parser = argparse.ArgumentParser()
        configure(parser)
        return gateway_settings(parser.parse_args(["--db-url", "sqlite://", *argv]))

    assert settings().alert_webhook_secret is None
    monkeypatch.setenv("INFERPLANE_ALERT_WEBHOOK_SECRET", "from-env")
    assert settings().alert_webhook_secret == "from-env"
    (tmp_path / "secret").write_text("from-file\n")
    chosen = settings("--alert-webhook-secret-file", str(tmp_path / "secret"), "--alert-max-attempts", "3",
                      "--alert-retry-base-seconds", "0.5")
    assert chosen.alert_webhook_secret == "from-file"
    assert (chosen.alert_max_attempts, chosen.alert_retry_base_delay) == (3, 0.5)


def test_the_docs_snippet_verifies_what_the_forwarder_signs():
    import re
    from pathlib import Path

    from inferplane.control_plane.alerts.signing import signature

    page = (Path(__file__).resolve().parents[2] / "docs" / "operations" / "alerts.md").read_text()
    snippet = re.search(r"```python\n(import hashlib, hmac, time\n.*?)```", page, re.S).group(1)
    scope: dict = {}
    exec(snippet, scope)  # noqa: S102 - our own docs
    body, ts = b'{"status":"firing"}', int(datetime.now(UTC).timestamp())
    headers = {"X-Inferplane-Timestamp": str(ts), "X-Inferplane-Signature": signature("s3cret", ts, body)}
    assert scope["verify"]("s3cret", headers, body) and not scope["verify"]("other", headers, body)
