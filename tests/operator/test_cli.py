"""`inferplane operator`'s CLI module: cheap to configure, and the options reach the operator config."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest


def test_configure_imports_neither_kopf_nor_kubernetes() -> None:
    code = ("import argparse, sys; import inferplane.operator.cli as c; c.configure(argparse.ArgumentParser()); "
            "print(sorted(m for m in ('kopf', 'kubernetes', 'aiohttp') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_options_parse() -> None:
    from inferplane.operator import cli

    parser = argparse.ArgumentParser()
    cli.configure(parser)
    args = parser.parse_args(["-n", "a", "-n", "b", "--webhook-port", "9443", "--no-monitoring", "--peering", "p"])
    assert args.namespace == ["a", "b"] and args.webhook_port == 9443 and args.no_monitoring
    assert args.peering == "p" and not args.all_namespaces


def test_webhook_is_dialled_through_a_service_or_a_host_not_both() -> None:
    from inferplane.operator import cli
    from inferplane.operator.webhook import parse_service

    parser = argparse.ArgumentParser()
    cli.configure(parser)
    args = parser.parse_args(["--webhook-port", "9443", "--webhook-service", "inference/inferplane-operator"])
    assert parse_service(args.webhook_service) == ("inference", "inferplane-operator")
    with pytest.raises(SystemExit):
        parser.parse_args(["--webhook-service", "a/b", "--webhook-host", "127.0.0.1"])
    for bad in ("inferplane-operator", "/svc", "ns/", "a/b/c"):
        with pytest.raises(ValueError, match="--webhook-service must be NAMESPACE/NAME"):
            parse_service(bad)


async def test_inferplane_operator_command_reconciles_with_peering(fake_api) -> None:
    """The real `inferplane operator` process, with kopf peering on (as the chart runs it)."""
    import asyncio
    import os
    import signal

    from tests.operator.conftest import NAMESPACE, eventually

    api, kubeconfig = fake_api
    client = api.clients[0]
    # The chart creates the peering object; without one kopf waits instead of acting.
    async with client.post(f"/apis/kopf.dev/v1/namespaces/{NAMESPACE}/kopfpeerings",
                           json={"apiVersion": "kopf.dev/v1", "kind": "KopfPeering",
                                 "metadata": {"name": "inferplane", "namespace": NAMESPACE}}) as response:
        assert response.status == 200
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "inferplane.cli", "operator", "-n", NAMESPACE, "--peering", "inferplane",
        "--liveness", "", "--no-events", env=dict(os.environ, KUBECONFIG=str(kubeconfig)),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        body = {"apiVersion": "inferplane.io/v1alpha1", "kind": "InferenceDeployment",
                "metadata": {"name": "cli", "namespace": NAMESPACE}, "spec": {"model": {"name": "smollm2-135m"}}}
        async with client.post(f"/apis/inferplane.io/v1alpha1/namespaces/{NAMESPACE}/inferencedeployments",
                               json=body) as response:
            assert response.status == 200
        await eventually(lambda: ((api.get("inferplane.io/v1alpha1/inferencedeployments", NAMESPACE, "cli") or {})
                                  .get("status") or {}).get("phase") == "Progressing", timeout=60)
        assert api.get("apps/v1/deployments", NAMESPACE, "cli") is not None
    finally:
        proc.send_signal(signal.SIGTERM)
        output = (await asyncio.wait_for(proc.communicate(), 30))[0].decode()
    assert proc.returncode == 0, output[-2000:]
