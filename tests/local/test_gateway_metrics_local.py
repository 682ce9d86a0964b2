"""Issue 53, `inferplane up`: the gateway's /metrics is on its own listener there too, and what
names it (run.json, `inferplane status`, `inferplane monitoring scrape-config`) points at that
listener, never at the API port."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from inferplane.bench.gateway_harness import free_port
from inferplane.cli import main
from inferplane.cli.monitoring import scrape_config
from inferplane.local import runstate
from inferplane.local.platform import LocalPlatform


@pytest.fixture
async def platform_with(tmp_path: Path):
    started: list[LocalPlatform] = []

    async def start(**kwargs) -> LocalPlatform:
        platform = LocalPlatform(tmp_path / "home", [], "127.0.0.1", free_port(), None, **kwargs)
        started.append(platform)
        await platform.start()
        return platform

    yield start
    for platform in started:
        await platform.stop()


async def test_the_gateways_metrics_are_on_their_own_port(platform_with, capsys: pytest.CaptureFixture[str]) -> None:
    platform = await platform_with()  # the default: a free port
    state = platform.run_state()
    url = state["gateway"]["metrics"]
    assert url == f"http://127.0.0.1:{platform.gateway.metrics_port}/metrics"
    assert platform.gateway.metrics_port != platform.port
    platform.gateway.context.metrics.key_admission("default", "0123456789abcdef", "admitted")
    async with httpx.AsyncClient(timeout=30) as client:
        scraped = await client.get(url)
        assert scraped.status_code == 200 and 'tenant="default"' in scraped.text
        api = await client.get(f"{state['gateway']['url']}/metrics")
        assert api.status_code == 404 and "0123456789abcdef" not in api.text
    config = scrape_config(state)
    (gateway_job,) = [j for j in config["scrape_configs"] if j["job_name"] == "inferplane-gateway"]
    assert gateway_job["static_configs"] == [{"targets": [f"127.0.0.1:{platform.gateway.metrics_port}"]}]

    runstate.write(platform.home, state)
    main(["status", "--home", str(platform.home)])
    assert f"metrics {url}" in capsys.readouterr().out


async def test_off_means_no_listener_and_no_scrape_target(platform_with, capsys: pytest.CaptureFixture[str]) -> None:
    platform = await platform_with(metrics_port=None)
    state = platform.run_state()
    assert platform.gateway.metrics_port is None and state["gateway"]["metrics"] is None
    assert [j["job_name"] for j in scrape_config(state)["scrape_configs"]] == ["inferplane-workers"]
    runstate.write(platform.home, state)
    main(["status", "--home", str(platform.home)])
    assert "metrics off" in capsys.readouterr().out
