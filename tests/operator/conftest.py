"""Fixtures for the operator tests.

Only the Kubernetes API server is mocked (kmock, extended by tests.operator.fakeapi); the
operator under test is the real kopf operator with the real handlers, and helm is a real binary.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "deploy" / "examples").glob("*.yaml"))
NAMESPACE = "team-a"


def load_example(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


async def eventually(check: Callable[[], Any], timeout: float = 20.0, interval: float = 0.05) -> Any:
    """Poll until check() returns something truthy (the operator works asynchronously)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        result = check()
        if result:
            return result
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"condition not met within {timeout}s: {check}")
        await asyncio.sleep(interval)


@pytest.fixture
async def fake_api() -> AsyncIterator[tuple[Any, Path]]:
    from tests.operator.fakeapi import fake_cluster

    async with fake_cluster([NAMESPACE]) as (api, _url, kubeconfig):
        yield api, kubeconfig


@pytest.fixture
async def operator(fake_api: tuple[Any, Path]) -> AsyncIterator[Any]:
    """The real operator, with its admission webhook served over plain HTTP on a free local port."""
    from inferplane.operator.config import OperatorConfig, WebhookConfig
    from tests.operator.fakeapi import running_operator

    api, kubeconfig = fake_api
    config = OperatorConfig(
        worker_image="registry.example/inferplane:test", post_events=False,
        webhook=WebhookConfig(addr="127.0.0.1", host="127.0.0.1", port=0, insecure=True))
    async with running_operator(api, kubeconfig, config, namespaces=[NAMESPACE]):
        yield api


