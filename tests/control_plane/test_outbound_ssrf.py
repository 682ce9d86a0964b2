"""Requests that tenants and admins steer do not reach internal addresses, nor tell what answers there.

A tenant admin chooses webhook URLs and a platform admin http(s) model sources; before this, both
reached the gateway's loopback (`http://127.0.0.1:PORT/`, `http://0x7f000001:PORT/`), and the delivery
log (`GET /v1/alerts`, any key of the tenant) or the registration error told a closed port (`ConnectError`)
from an open one (`HTTP 401`): a port scanner. Everything here is real: HTTP receivers on loopback,
httpx, the gateway's forwarder and registry. The one stand-in is a DNS answer (`rebinding_dns`),
passed to the guarded transport as its resolver, because making a real name resolve to 127.0.0.1
at delivery time needs a DNS server this test does not own.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import socket
import threading
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from inferplane.cli import main
from inferplane.control_plane import auth, tenants
from inferplane.control_plane.alerts.forwarder import AlertForwarder, ForwarderSettings
from inferplane.control_plane.alerts.webhooks import set_webhook
from inferplane.control_plane.gateway.rest import create_asgi_app
from inferplane.control_plane.gateway.server import Gateway, GatewaySettings
from inferplane.control_plane.orm import AlertDelivery
from inferplane.control_plane.outbound import GuardedAsyncTransport, OutboundPolicy, is_public, literal_address

SECRET = "am-shared-secret-0123456789"
BOOTSTRAP = "ipadmin_" + "d" * 40
HOOK_SECRET = "acme-hook-secret-0123456789"
LOOPBACK_ONLY = ("127.0.0.1/32",)
# What a tenant sees of one delivery: the outcome's class, never the receiver's status or the error.
TENANT_FIELDS = {"id", "webhook_url", "alert_status", "state", "outcome", "attempts", "created_at",
                 "next_attempt_at", "delivered_at"}


class Receiver:
    """An HTTP server on loopback that records every request; paths under /deny answer 401, like an
    internal service wanting credentials, the rest 200."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", "0")))
                with receiver.lock:
                    receiver.requests.append((self.command, self.path, dict(self.headers.items())))
                self.send_response(401 if self.path.startswith("/deny") else 200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_GET = do_POST = _answer  # noqa: N815 - http.server's names

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def received(self) -> list[tuple[str, str, dict[str, str]]]:
        with self.lock:
            return list(self.requests)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


@pytest.fixture
def closed_port() -> int:
    """A loopback port nothing listens on (bound once to get a free number, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def make_gateway(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator:
    monkeypatch.setenv("INFERPLANE_MODEL_CACHE", str(tmp_path / "model-cache"))
    made: list[Gateway] = []

    def make(allow: Sequence[str] = ()) -> Gateway:
        gw = Gateway(GatewaySettings(db_url=f"sqlite:///{tmp_path / f'gw{len(made)}.db'}", bootstrap_key=BOOTSTRAP,
                                     alert_webhook_secret=SECRET, outbound_allow=tuple(allow)))
        with gw.sessions.begin() as s:
            tenants.create_tenant(s, "acme", actor="test")
            gw.tenant_key = auth.create_key(s, "acme", actor="test").secret
            gw.tenant_admin = auth.create_key(s, "acme", actor="test", scopes=["admin"]).secret
        gw.keys.refresh()
        made.append(gw)
        return gw

    yield make
    for gw in made:
        gw.engine.dispose()


async def call(gw: Gateway, method: str, path: str, key: str, **kwargs) -> httpx.Response:
    transport = httpx.ASGITransport(create_asgi_app(gw.context))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
        return await c.request(method, path, headers={"Authorization": f"Bearer {key}"}, **kwargs)


async def put_hook(gw: Gateway, url: str, key: str = BOOTSTRAP) -> httpx.Response:
    return await call(gw, "PUT", "/admin/v1/tenants/acme/webhooks", key, json={"url": url, "secret": HOOK_SECRET})


def add_hook_unchecked(gw: Gateway, url: str) -> None:
    """A webhook row as one set before this check existed (or before the allow-list was narrowed):
    registered under a policy that allows everything internal, delivered under the gateway's own."""
    everything = OutboundPolicy.parse(["0.0.0.0/0", "::/0"])
    with gw.sessions.begin() as s:
        set_webhook(s, "acme", url, actor="test", secret=HOOK_SECRET, outbound=everything)


async def fire(gw: Gateway, fingerprint: str = "fp-1") -> None:
    body = {"version": "4", "groupKey": "{}:{}", "status": "firing", "receiver": "inferplane", "groupLabels": {},
            "commonLabels": {}, "commonAnnotations": {}, "externalURL": "http://alertmanager",
            "alerts": [{"status": "firing", "labels": {"alertname": "HighLatency", "tenant": "acme"},
                        "startsAt": "2026-12-01T10:00:00Z", "fingerprint": fingerprint}]}
    answer = await call(gw, "POST", "/alerts/v1/webhook", SECRET, json=body)
    assert answer.status_code == 200, answer.text


async def deliver_once(gw: Gateway, forwarder: AlertForwarder | None = None) -> None:
    """One pass of the forwarder (the gateway's own unless given): every due delivery attempted once."""
    forwarder = forwarder or gw.alert_forwarder
    assert forwarder is not None
    try:
        await forwarder.deliver_due()
    finally:
        await forwarder.stop()


def rows(gw: Gateway) -> list[AlertDelivery]:
    with gw.sessions() as s:
        return list(s.scalars(sa.select(AlertDelivery).order_by(AlertDelivery.id)))


async def tenant_view(gw: Gateway) -> list[dict]:
    answer = await call(gw, "GET", "/v1/alerts", gw.tenant_key)
    assert answer.status_code == 200, answer.text
    return [d for a in answer.json()["data"] for d in a["deliveries"]]


def rebinding_dns(answers: dict[str, list[str]]):
    """A resolver whose answers an attacker controls: the name resolved to something public when the
    webhook was set, and to these addresses now."""
    def resolve(host: str, port: int) -> list[str]:
        if host in answers:
            return answers[host]
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    return resolve


# ---- registration ---------------------------------------------------------------------------------


@pytest.mark.parametrize("host", [
    "127.0.0.1", "0x7f000001", "2130706433", "127.1", "0177.0.0.1", "[::1]", "[::ffff:127.0.0.1]",
    "169.254.169.254", "10.0.0.5", "172.16.0.1", "192.168.1.1", "100.64.0.1", "0.0.0.0", "224.0.0.1",
    "[fd00::1]", "[fe80::1]", "[::]",
])
async def test_a_literal_internal_address_is_refused_at_registration_naming_the_field(make_gateway, host):
    gw = make_gateway()
    for key in (BOOTSTRAP, gw.tenant_admin):
        answer = await put_hook(gw, f"http://{host}:8080/hook", key)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert (error["param"], error["code"]) == ("url", "address_not_allowed")
        assert error["message"].startswith("url:") and "internal address" in error["message"]
    listed = await call(gw, "GET", "/admin/v1/tenants/acme/webhooks", BOOTSTRAP)
    assert listed.json()["data"] == []


async def test_names_and_public_addresses_are_accepted_at_registration(make_gateway):
    gw = make_gateway()
    for url in ("https://hooks.acme.example/a", "http://localhost:8080/b", "http://8.8.8.8/c",
                "http://[2606:4700::1111]/d"):
        answer = await put_hook(gw, url)
        assert answer.status_code == 201, (url, answer.text)


async def test_an_allow_listed_address_is_accepted_at_registration(make_gateway):
    gw = make_gateway(allow=["10.20.0.0/16", "127.0.0.1"])
    for url in ("http://10.20.3.4/hook", "http://127.0.0.1:9000/hook", "http://0x7f000001:9000/hook"):
        assert (await put_hook(gw, url)).status_code == 201, url
    assert (await put_hook(gw, "http://10.21.0.1/hook")).status_code == 400


def test_the_cli_refuses_the_same_urls_unless_the_variable_allows_them(tmp_path, monkeypatch, capsys):
    db = ("--db-url", f"sqlite:///{tmp_path / 'cli.db'}")
    monkeypatch.delenv("INFERPLANE_OUTBOUND_ALLOW", raising=False)
    assert main(["tenants", "create", "acme", *db]) == 0
    assert main(["tenants", "set-webhook", "acme", "http://0x7f000001:9000/hook", *db]) == 1
    assert "internal address" in capsys.readouterr().err
    monkeypatch.setenv("INFERPLANE_OUTBOUND_ALLOW", "127.0.0.0/8")
    assert main(["tenants", "set-webhook", "acme", "http://0x7f000001:9000/hook", *db]) == 0


# ---- delivery -------------------------------------------------------------------------------------


async def test_a_loopback_webhook_is_refused_when_delivering_and_nothing_arrives(make_gateway, receiver):
    gw = make_gateway()
    port = receiver.port
    for host in ("127.0.0.1", "0x7f000001", "2130706433", "127.1"):  # numeric forms resolve to loopback too
        add_hook_unchecked(gw, f"http://{host}:{port}/{host}")
    assert (await put_hook(gw, f"http://localhost:{port}/localhost")).status_code == 201  # a name: checked later
    await fire(gw)
    await deliver_once(gw)
    assert receiver.received() == []
    assert [(r.state, r.attempts, r.next_attempt_at) for r in rows(gw)] == [("failed", 1, None)] * 5
    assert {d["outcome"] for d in await tenant_view(gw)} == {"refused"}


async def test_a_name_that_rebinds_to_loopback_is_refused_at_connect_time(make_gateway, receiver):
    gw = make_gateway()
    # Set while the names were nobody's business (registration does not resolve names) ...
    for name in ("rebind.acme.test", "mixed.acme.test"):
        assert (await put_hook(gw, f"http://{name}:{receiver.port}/hook")).status_code == 201
    await fire(gw)
    # ... and answering loopback at delivery; one internal answer among public ones is enough.
    dns = rebinding_dns({"rebind.acme.test": ["127.0.0.1"], "mixed.acme.test": ["93.184.215.14", "127.0.0.1"]})
    forwarder = AlertForwarder(gw.sessions, ForwarderSettings(),
                               transport=GuardedAsyncTransport(gw.context.outbound, resolver=dns))
    await deliver_once(gw, forwarder)
    assert receiver.received() == []
    assert [d["outcome"] for d in await tenant_view(gw)] == ["refused", "refused"]


async def test_an_allow_listed_receiver_gets_its_delivery(make_gateway, receiver):
    gw = make_gateway(allow=LOOPBACK_ONLY)
    assert (await put_hook(gw, f"http://127.0.0.1:{receiver.port}/hook")).status_code == 201
    await fire(gw)
    await deliver_once(gw)
    ((method, path, headers),) = receiver.received()
    assert (method, path) == ("POST", "/hook") and "X-Inferplane-Signature" in headers
    assert [d["outcome"] for d in await tenant_view(gw)] == ["delivered"]


async def test_an_allow_listed_name_connects_to_the_address_it_was_checked_at_with_its_own_host_header(
        make_gateway, receiver):
    gw = make_gateway()
    assert (await put_hook(gw, f"http://hooks.onprem.test:{receiver.port}/hook")).status_code == 201
    await fire(gw)
    allowed = OutboundPolicy.parse(["hooks.onprem.test"])
    dns = rebinding_dns({"hooks.onprem.test": ["127.0.0.1"]})
    await deliver_once(gw, AlertForwarder(gw.sessions, ForwarderSettings(),
                                          transport=GuardedAsyncTransport(allowed, resolver=dns)))
    ((_, _, headers),) = receiver.received()
    assert headers["Host"] == f"hooks.onprem.test:{receiver.port}"
    assert [d["outcome"] for d in await tenant_view(gw)] == ["delivered"]


async def test_tenants_see_the_outcome_class_and_the_operator_keeps_the_reason(make_gateway, receiver, closed_port,
                                                                               caplog):
    gw = make_gateway(allow=LOOPBACK_ONLY)
    for url in (f"http://127.0.0.1:{receiver.port}/deny", f"http://127.0.0.1:{closed_port}/hook"):
        assert (await put_hook(gw, url)).status_code == 201
    add_hook_unchecked(gw, f"http://10.255.255.1:{receiver.port}/hook")  # not allowed: refused, not contacted
    await fire(gw)
    with caplog.at_level(logging.INFO, logger="inferplane.control_plane.alerts.forwarder"):
        await deliver_once(gw)
    assert [p for _, p, _ in receiver.received()] == ["/deny"]

    answered_401, port_closed, refused = await tenant_view(gw)
    for entry in (answered_401, port_closed, refused):
        assert set(entry) == TENANT_FIELDS
    assert [e["outcome"] for e in (answered_401, port_closed, refused)] == ["failed", "failed", "refused"]
    # An open port answering 401 and a closed port look the same, but for their URLs and times.
    def comparable(entry: dict) -> dict:
        return {k: v for k, v in entry.items() if k not in ("id", "webhook_url", "created_at", "next_attempt_at")}
    assert comparable(answered_401) == comparable(port_closed) == {
        "alert_status": "firing", "state": "pending", "outcome": "failed", "attempts": 1, "delivered_at": None}

    # The operator's record: the database row and the log keep what happened.
    row_401, row_closed, row_refused = rows(gw)
    assert (row_401.last_status_code, row_401.last_error) == (401, "HTTP 401")
    assert "ConnectError" in row_closed.last_error
    assert "10.255.255.1" in row_refused.last_error and row_refused.state == "failed"
    assert "HTTP 401" in caplog.text and "10.255.255.1" in caplog.text


# ---- model registration ---------------------------------------------------------------------------


async def test_model_registration_errors_do_not_tell_a_closed_port_from_a_401(make_gateway, receiver, closed_port,
                                                                             caplog):
    gw = make_gateway(allow=LOOPBACK_ONLY)  # the sources are on loopback: allowed, so both are really fetched
    sources = [f"http://127.0.0.1:{closed_port}/model.gguf", f"http://127.0.0.1:{receiver.port}/deny/model.gguf"]
    messages = []
    with caplog.at_level(logging.WARNING, logger="inferplane.control_plane.registry"):
        for source in sources:
            answer = await call(gw, "POST", "/admin/v1/models", BOOTSTRAP, json={"source": source, "name": "remote"})
            assert answer.status_code == 400, answer.text
            messages.append(answer.json()["error"]["message"].replace(source, "<url>"))
    assert messages == ["cannot fetch the model from <url>"] * 2
    assert [p for _, p, _ in receiver.received()] == ["/deny/model.gguf"]
    assert "HTTP 401" in caplog.text and "ConnectError" in caplog.text  # the reason, for the operator


async def test_model_registration_refuses_internal_sources_without_the_allow_list(make_gateway, receiver):
    gw = make_gateway()
    for host in ("127.0.0.1", "0x7f000001", "localhost"):
        source = f"http://{host}:{receiver.port}/deny/model.gguf"
        answer = await call(gw, "POST", "/admin/v1/models", BOOTSTRAP, json={"source": source, "name": "remote"})
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["message"].startswith(f"cannot fetch the model from {source}: ")
        assert "internal address" in answer.json()["error"]["message"]
    assert receiver.received() == []
    assert (await call(gw, "GET", "/admin/v1/models", BOOTSTRAP)).json()["data"] == []


# ---- the policy and its setting -------------------------------------------------------------------


@pytest.mark.parametrize("address, public", [
    ("8.8.8.8", True), ("2606:4700::1111", True), ("::ffff:8.8.8.8", True), ("2002:808:808::", True),
    ("127.0.0.1", False), ("10.1.2.3", False), ("172.31.255.255", False), ("192.168.0.1", False),
    ("100.64.0.1", False), ("100.127.255.254", False), ("169.254.169.254", False), ("0.0.0.0", False),
    ("224.0.0.251", False), ("239.255.255.250", False), ("240.0.0.1", False), ("255.255.255.255", False),
    ("192.0.2.1", False), ("198.18.0.1", False), ("::1", False), ("::", False), ("fd12:3456::1", False),
    ("fe80::1", False), ("fec0::1", False), ("ff02::1", False), ("::ffff:127.0.0.1", False),
    ("::ffff:169.254.169.254", False), ("2002:7f00:1::", False), ("2002:a00:1::", False), ("64:ff9b::7f00:1", False),
    ("2001:db8::1", False),
])
def test_only_public_unicast_addresses_pass_by_default(address, public):
    ip = ipaddress.ip_address(address)
    assert is_public(ip) is public
    assert OutboundPolicy().refused_address("h", [address]) == (None if public else address)


@pytest.mark.parametrize("host, address", [
    ("0x7f000001", "127.0.0.1"), ("2130706433", "127.0.0.1"), ("127.1", "127.0.0.1"), ("0177.0.0.1", "127.0.0.1"),
    ("0x7f.1", "127.0.0.1"), ("[::1]", "::1"), ("10.0.0.1.", "10.0.0.1"), ("hooks.example", None),
    ("deadbeef", None), ("1e3", None),
])
def test_every_numeric_spelling_is_read_as_the_address_it_names(host, address):
    found = literal_address(host)
    assert (str(found) if found is not None else None) == address


def test_the_allow_list_takes_cidrs_addresses_and_names():
    policy = OutboundPolicy.parse(["10.20.0.0/16", "127.0.0.1", "fd00::/8", "Hooks.Corp.Example.", "*.svc.local"])
    assert policy.refused_address("x", ["10.20.9.9", "127.0.0.1", "::ffff:127.0.0.1", "fd00::5"]) is None
    assert policy.refused_address("x", ["10.20.9.9", "10.21.0.1"]) == "10.21.0.1"
    assert policy.refused_address("hooks.corp.example", ["169.254.169.254"]) is None  # a name admits its answers
    assert policy.refused_address("a.b.svc.local", ["10.99.0.1"]) is None
    assert policy.refused_address("svc.local", ["10.99.0.1"]) == "10.99.0.1"
    for bad in ("10.1.2.3/8", "not a host", "300.1.2.3/32", "http://x"):
        with pytest.raises(ValueError, match="outbound allow-list entry"):
            OutboundPolicy.parse([bad])


def test_the_gateway_reads_the_allow_list_from_its_flag_or_the_environment(monkeypatch):
    from inferplane.control_plane.cli.gateway import UsageError, configure, gateway_settings

    def settings(*argv: str):
        parser = argparse.ArgumentParser()
        configure(parser)
        return gateway_settings(parser.parse_args(["--db-url", "sqlite://", *argv]))

    monkeypatch.delenv("INFERPLANE_OUTBOUND_ALLOW", raising=False)
    assert settings().outbound_allow == ()
    assert settings("--outbound-allow", "10.0.0.0/8", "--outbound-allow", "hooks.corp.example").outbound_allow == (
        "10.0.0.0/8", "hooks.corp.example")
    monkeypatch.setenv("INFERPLANE_OUTBOUND_ALLOW", "10.0.0.0/8, 127.0.0.1 *.corp.example")
    assert settings().outbound_allow == ("10.0.0.0/8", "127.0.0.1", "*.corp.example")
    with pytest.raises(UsageError, match="--outbound-allow"):
        settings("--outbound-allow", "10.1.2.3/8")
