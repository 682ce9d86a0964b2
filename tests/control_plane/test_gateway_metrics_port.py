"""Issue 53: the gateway's /metrics names tenants, key ids and private adapters, so it is served on
its own listener (`--metrics-port`, for Prometheus only) and never on the API port, where anyone who
can reach the API (every tenant) could read it, credential or not."""

from __future__ import annotations

import argparse
import socket
from pathlib import Path

import httpx
import pytest

from inferplane.bench.gateway_harness import free_port
from inferplane.control_plane.cli import gateway as cli
from inferplane.control_plane.gateway.rest import create_asgi_app
from inferplane.control_plane.gateway.server import Gateway, GatewaySettings

BOOTSTRAP = "bootstrap-admin-key-for-tests"
TENANT_SERIES = 'tenant="acme"'


def _named_series(gw: Gateway) -> None:
    """What the request path records: a key's admission, a tenant's billed tokens on a private adapter."""
    gw.context.metrics.key_admission("acme", "0123456789abcdef", "admitted")
    gw.context.metrics.billed("acme", "acme-private-adapter", prompt_tokens=3, completion_tokens=5)


@pytest.mark.parametrize("credential", [None, BOOTSTRAP, "ip_0123456789abcdef_" + "x" * 43])
async def test_the_api_port_serves_no_metrics(tmp_path: Path, credential: str | None) -> None:
    gw = Gateway(GatewaySettings(db_url=f"sqlite:///{tmp_path / 'gw.db'}", bootstrap_key=BOOTSTRAP))
    try:
        _named_series(gw)
        headers = {"authorization": f"Bearer {credential}"} if credential else {}
        transport = httpx.ASGITransport(create_asgi_app(gw.context))
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            for path in ("/metrics", "/metrics/", "/v1/../metrics"):
                answer = await client.get(path, headers=headers)
                assert answer.status_code == 404, (path, answer.status_code)
                assert "acme" not in answer.text and "0123456789abcdef" not in answer.text
    finally:
        gw.engine.dispose()


async def test_the_metrics_listener_serves_them_and_nothing_else(tmp_path: Path) -> None:
    port = free_port()
    gw = Gateway(GatewaySettings(db_url=f"sqlite:///{tmp_path / 'gw.db'}", port=port, metrics_port=0,
                                 bootstrap_key=BOOTSTRAP))
    await gw.start()
    try:
        _named_series(gw)
        assert gw.metrics_port not in (None, 0, port)
        async with httpx.AsyncClient(timeout=30) as client:
            scraped = await client.get(f"http://127.0.0.1:{gw.metrics_port}/metrics")
            assert scraped.status_code == 200 and scraped.headers["content-type"].startswith("text/plain")
            assert TENANT_SERIES in scraped.text and "acme-private-adapter" in scraped.text
            assert "inferplane_database_up" in scraped.text  # the platform collector's families too
            for path in ("/", "/v1/models", "/admin/v1/tenants", "/healthz"):
                other = await client.get(f"http://127.0.0.1:{gw.metrics_port}{path}",
                                         headers={"authorization": f"Bearer {BOOTSTRAP}"})
                assert other.status_code == 404, path
            api = await client.get(f"http://127.0.0.1:{port}/metrics")
            assert api.status_code == 404 and TENANT_SERIES not in api.text
            assert (await client.get(f"http://127.0.0.1:{port}/healthz")).status_code == 200
    finally:
        await gw.stop()
    with pytest.raises(httpx.ConnectError):  # stopped with the gateway
        httpx.get(f"http://127.0.0.1:{gw.metrics_port}/metrics", timeout=5)


async def test_no_metrics_listener_unless_asked(tmp_path: Path) -> None:
    gw = Gateway(GatewaySettings(db_url=f"sqlite:///{tmp_path / 'gw.db'}", port=free_port()))
    await gw.start()
    try:
        assert gw.metrics_port is None
    finally:
        await gw.stop()


async def test_a_taken_metrics_port_fails_the_start(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        gw = Gateway(GatewaySettings(db_url=f"sqlite:///{tmp_path / 'gw.db'}", port=free_port(),
                                     metrics_port=taken.getsockname()[1]))
        with pytest.raises((OSError, SystemExit)):
            await gw.start()
        await gw.stop()


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.configure(parser)
    return parser.parse_args(list(argv))


def test_the_cli_option(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("INFERPLANE_METRICS_PORT", raising=False)
    assert cli.gateway_settings(_parse()).metrics_port == cli.DEFAULT_METRICS_PORT
    assert cli.gateway_settings(_parse("--metrics-port", "9200")).metrics_port == 9200
    assert cli.gateway_settings(_parse("--metrics-port", "0")).metrics_port is None  # 0: off, as a worker's
    monkeypatch.setenv("INFERPLANE_METRICS_PORT", "9300")
    assert cli.gateway_settings(_parse()).metrics_port == 9300
    for refused in (["--metrics-port", "70000"], ["--metrics-port", "-1"], ["--port", "9300"]):
        with pytest.raises(cli.UsageError, match="--metrics-port"):
            cli.gateway_settings(_parse(*refused))
