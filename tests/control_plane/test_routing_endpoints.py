"""Endpoint sources (static and EndpointSlice-based) and the tenant cache salt."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
from kubernetes import client

from inferplane.control_plane.routing import (
    Deployment,
    Endpoint,
    EndpointSource,
    KubernetesEndpointSource,
    Router,
    RouteRequest,
    StaticEndpointSource,
    endpoints_from_slices,
    tenant_cache_salt,
)


def _slice(addresses: list[tuple[str, bool | None, bool | None]], *, port: int = 50051,
           address_type: str = "IPv4") -> dict[str, Any]:
    """An EndpointSlice as the API returns it in JSON (camelCase)."""
    eps = []
    for i, (addr, ready, terminating) in enumerate(addresses):
        cond: dict[str, Any] = {}
        if ready is not None:
            cond["ready"] = ready
        if terminating is not None:
            cond["terminating"] = terminating
        eps.append({"addresses": [addr], "conditions": cond,
                    "targetRef": {"kind": "Pod", "name": f"llama-{i}"}})
    return {"addressType": address_type, "endpoints": eps,
            "ports": [{"name": "metrics", "port": 9090}, {"name": "grpc", "port": port}],
            "metadata": {"labels": {"kubernetes.io/service-name": "llama"}}}


def test_slices_to_endpoints_filters_not_ready_and_terminating() -> None:
    slices = [
        _slice([("10.1.0.5", True, False), ("10.1.0.6", False, False), ("10.1.0.7", None, None)]),
        _slice([("10.1.0.8", True, True), ("10.1.0.5", True, False)]),  # duplicate across slices
    ]
    eps = endpoints_from_slices(slices)
    assert [e.address for e in eps] == ["10.1.0.5:50051", "10.1.0.7:50051"]
    assert eps[0].name == "llama-0"


def test_slices_port_fallback_and_ipv6() -> None:
    sl = _slice([("fd00::1", True, None)], address_type="IPv6")
    assert endpoints_from_slices([sl])[0].address == "[fd00::1]:50051"
    assert endpoints_from_slices([sl], port_name="other")[0].address == "[fd00::1]:9090"  # first port
    sl["ports"] = None
    assert endpoints_from_slices([sl]) == ()


def test_slices_from_client_model_objects_and_to_dict() -> None:
    obj = client.V1EndpointSlice(
        address_type="IPv4",
        endpoints=[client.V1Endpoint(addresses=["10.2.0.1"],
                                     conditions=client.V1EndpointConditions(ready=True),
                                     target_ref=client.V1ObjectReference(name="p0")),
                   client.V1Endpoint(addresses=["10.2.0.2"],
                                     conditions=client.V1EndpointConditions(ready=False))],
        ports=[client.DiscoveryV1EndpointPort(name="grpc", port=7000)],
    )
    expected = (Endpoint("10.2.0.1:7000", "p0"),)
    assert endpoints_from_slices([obj]) == expected
    assert endpoints_from_slices([obj.to_dict()]) == expected


class FakeDiscoveryApi:
    def __init__(self) -> None:
        self.slices: list[Any] = []
        self.calls: list[tuple[str, str]] = []
        self.fail = False

    def list_namespaced_endpoint_slice(self, namespace: str, label_selector: str) -> Any:
        self.calls.append((namespace, label_selector))
        if self.fail:
            raise RuntimeError("apiserver down")
        return client.V1EndpointSliceList(items=self.slices)


async def test_kubernetes_source_lists_by_service_label_and_keeps_last_snapshot() -> None:
    api = FakeDiscoveryApi()
    api.slices = [_slice([("10.3.0.1", True, None), ("10.3.0.2", True, None)])]
    src = KubernetesEndpointSource("llama", "models", api=api)
    assert isinstance(src, EndpointSource)
    assert [e.address for e in src.refresh()] == ["10.3.0.1:50051", "10.3.0.2:50051"]
    assert api.calls == [("models", "kubernetes.io/service-name=llama")]
    api.fail = True
    task = asyncio.create_task(src.run(interval_s=0))
    while len(api.calls) < 3:  # the loop keeps polling through failures
        await asyncio.sleep(0.001)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(src.endpoints()) == 2  # failures keep the last good list


def test_static_source_add_remove_changes_routing() -> None:
    src = StaticEndpointSource(["127.0.0.1:7001"])
    router = Router({"m": [Deployment("local", src)]}, rng=random.Random(0))
    assert router.pick(RouteRequest("m")).address == "127.0.0.1:7001"
    src.add(Endpoint("127.0.0.1:7002", name="replica-1"))
    src.remove("127.0.0.1:7001")
    assert [e.address for e in src.endpoints()] == ["127.0.0.1:7002"]
    assert router.pick(RouteRequest("m")).address == "127.0.0.1:7002"
    assert router.addresses() == {"127.0.0.1:7002"}


def test_tenant_cache_salt_is_keyed_and_stable() -> None:
    a1 = tenant_cache_salt("tenant-a", b"secret-1")
    assert a1 == tenant_cache_salt("tenant-a", "secret-1")
    assert a1 != tenant_cache_salt("tenant-b", b"secret-1")
    assert a1 != tenant_cache_salt("tenant-a", b"secret-2")  # unguessable without the secret
    assert len(a1) == 32 and int(a1, 16) >= 0
    with pytest.raises(ValueError):
        tenant_cache_salt("tenant-a", b"")
