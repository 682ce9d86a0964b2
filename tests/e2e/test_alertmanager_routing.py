"""A real Alertmanager routes an alert through the control plane to the right tenant's webhook.

Alertmanager (Debian's prometheus-alertmanager) runs on loopback with a webhook receiver pointing
at an in-process gateway's `/alerts/v1/webhook`, authenticated with the shared secret read from a
`credentials_file` (as deploy/monitoring/alertmanager.yml does). Two tenants each have a webhook
served by a small HTTP server in this test; acme's answers 500 to its first two calls. An alert
posted to Alertmanager's API with `tenant: acme` must reach acme's receiver, validly signed, on the
third attempt, and nothing may reach globex's; `GET /v1/alerts` shows it to acme only. Resolving
it in Alertmanager delivers the resolution too. The delivery latency (posting to Alertmanager →
the receiver's successful call) is printed, not asserted: timing on a shared machine is no test.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import subprocess
import threading
import time
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import yaml

from inferplane.bench.gateway_harness import free_port
from inferplane.control_plane import auth, tenants
from inferplane.control_plane.alerts.webhooks import set_webhook
from inferplane.control_plane.gateway.server import Gateway, GatewaySettings
from tests.services import installed

log = logging.getLogger(__name__)

SECRET = "e2e-alertmanager-secret-0123456789"
HOOK_SECRETS = {"acme": "acme-receiver-secret-0123456789", "globex": "globex-receiver-secret-0123456789"}
WAIT = 90.0  # seconds: generous, for a busy shared machine


def alertmanager_binary() -> str:
    return installed("prometheus-alertmanager", "alertmanager", package="prometheus-alertmanager")


class Receivers:
    """Tenants' webhooks on one loopback HTTP server: `/<tenant>`; the first `failures[tenant]`
    calls of a tenant are answered 500. Records (monotonic time, tenant, headers, body, status)."""

    def __init__(self, failures: dict[str, int]) -> None:
        self.failures = dict(failures)
        self.calls: list[tuple[float, str, dict[str, str], bytes, int]] = []
        self.lock = threading.Lock()
        receivers = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                tenant = self.path.strip("/")
                with receivers.lock:
                    failing = receivers.failures.get(tenant, 0) > 0
                    if failing:
                        receivers.failures[tenant] -= 1
                    status = 500 if failing else 200
                    receivers.calls.append((time.monotonic(), tenant, dict(self.headers.items()), body, status))
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def of(self, tenant: str) -> list[tuple[float, str, dict[str, str], bytes, int]]:
        with self.lock:
            return [c for c in self.calls if c[1] == tenant]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def alertmanager_config(gateway_port: int, secret_file: Path) -> dict:
    return {
        "route": {"receiver": "inferplane", "group_by": ["alertname", "tenant"], "group_wait": "1s",
                  "group_interval": "1s", "repeat_interval": "1h"},
        "receivers": [{"name": "inferplane", "webhook_configs": [{
            "url": f"http://127.0.0.1:{gateway_port}/alerts/v1/webhook", "send_resolved": True,
            "http_config": {"authorization": {"type": "Bearer", "credentials_file": str(secret_file)}}}]}],
    }


async def wait_until(what: str, predicate, logs: Path, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}; Alertmanager's log:\n{logs.read_text()[-3000:]}")
        await asyncio.sleep(0.05)


def signed_correctly(headers: dict[str, str], body: bytes, secret: str) -> bool:
    timestamp = headers["X-Inferplane-Timestamp"]
    expected = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(headers["X-Inferplane-Signature"], f"sha256={expected}") and \
        abs(time.time() - int(timestamp)) < 300


async def test_an_alert_reaches_its_tenant_through_a_real_alertmanager(tmp_path: Path) -> None:
    binary = alertmanager_binary()
    gateway_port, am_port = free_port(), free_port()
    # The receivers listen on loopback, which the gateway refuses by default: allowed explicitly.
    gw = Gateway(GatewaySettings(db_url=f"sqlite:///{tmp_path / 'gw.db'}", port=gateway_port,
                                 alert_webhook_secret=SECRET, alert_retry_base_delay=0.2, alert_poll_interval=1.0,
                                 outbound_allow=("127.0.0.1/32",)))
    receivers = Receivers({"acme": 2})
    with gw.sessions.begin() as s:
        keys = {}
        for tenant in ("acme", "globex"):
            tenants.create_tenant(s, tenant, actor="test")
            keys[tenant] = auth.create_key(s, tenant, actor="test").secret
            set_webhook(s, tenant, f"{receivers.url}/{tenant}", actor="test", secret=HOOK_SECRETS[tenant],
                        outbound=gw.context.outbound)
    gw.keys.refresh()
    secret_file = tmp_path / "alertmanager-secret"
    secret_file.write_text(SECRET + "\n")
    config = tmp_path / "alertmanager.yml"
    config.write_text(yaml.safe_dump(alertmanager_config(gateway_port, secret_file)))
    am_log = tmp_path / "alertmanager.log"
    await gw.start()
    with am_log.open("wb") as out:
        am = subprocess.Popen([binary, f"--config.file={config}", f"--storage.path={tmp_path / 'am-data'}",
                               f"--web.listen-address=127.0.0.1:{am_port}", "--cluster.listen-address=",
                               "--log.level=debug"], stdout=out, stderr=subprocess.STDOUT)
    am_url = f"http://127.0.0.1:{am_port}"
    try:
        async with httpx.AsyncClient(timeout=10) as http:
            async def ready() -> bool:
                try:
                    return (await http.get(f"{am_url}/-/ready")).status_code == 200
                except httpx.HTTPError:
                    return False

            deadline = time.monotonic() + WAIT
            while not await ready():
                assert am.poll() is None, f"Alertmanager exited:\n{am_log.read_text()[-3000:]}"
                assert time.monotonic() < deadline, f"Alertmanager never got ready:\n{am_log.read_text()[-3000:]}"
                await asyncio.sleep(0.1)

            labels = {"alertname": "InferplaneE2ETest", "tenant": "acme", "severity": "critical"}
            posted_at = time.monotonic()
            started = datetime.now(UTC).isoformat()
            answer = await http.post(f"{am_url}/api/v2/alerts", json=[{
                "labels": labels, "annotations": {"summary": "end-to-end alert routing"},
                "startsAt": started, "generatorURL": "http://prometheus.test/graph"}])
            assert answer.status_code == 200, answer.text

            def delivered(status: str) -> bool:
                return any(c[4] == 200 and json.loads(c[3])["status"] == status for c in receivers.of("acme"))

            await wait_until("acme's receiver to accept the firing alert", lambda: delivered("firing"), am_log)
            calls = receivers.of("acme")
            latency = calls[-1][0] - posted_at
            print(f"\nalert delivery latency (Alertmanager POST -> tenant receiver 2xx, 3rd attempt): {latency:.2f} s")
            log.warning("alert delivery latency: %.2f s", latency)

            assert [c[4] for c in calls] == [500, 500, 200]
            for _, _, headers, body, _ in calls:
                assert signed_correctly(headers, body, HOOK_SECRETS["acme"])
            assert len({c[2]["X-Inferplane-Delivery"] for c in calls}) == 1  # one delivery, three attempts
            body = json.loads(calls[-1][3])
            assert body["status"] == "firing" and body["tenant"] == "acme" and body["labels"] == labels
            assert body["annotations"] == {"summary": "end-to-end alert routing"}
            assert receivers.of("globex") == []

            async def listed(tenant: str) -> list[dict]:
                answer = await http.get(f"http://127.0.0.1:{gateway_port}/v1/alerts",
                                        headers={"Authorization": f"Bearer {keys[tenant]}"})
                assert answer.status_code == 200, answer.text
                return answer.json()["data"]

            (mine,) = await listed("acme")
            assert mine["fingerprint"] == body["fingerprint"] and mine["labels"] == labels
            assert [(d["state"], d["attempts"], d["outcome"]) for d in mine["deliveries"]] == [
                ("delivered", 3, "delivered")]
            assert await listed("globex") == []

            # Resolving it in Alertmanager (endsAt now) sends the resolution through the same path.
            answer = await http.post(f"{am_url}/api/v2/alerts", json=[{
                "labels": labels, "annotations": {"summary": "end-to-end alert routing"},
                "startsAt": started, "endsAt": datetime.now(UTC).isoformat()}])
            assert answer.status_code == 200, answer.text
            await wait_until("acme's receiver to accept the resolution", lambda: delivered("resolved"), am_log)
            (mine,) = await listed("acme")
            assert mine["status"] == "resolved" and [d["alert_status"] for d in mine["deliveries"]] == [
                "firing", "resolved"]
            assert receivers.of("globex") == []
    finally:
        am.terminate()
        try:
            am.wait(timeout=10)
        except subprocess.TimeoutExpired:
            am.kill()
            am.wait()
        await gw.stop()
        gw.engine.dispose()
        receivers.close()
