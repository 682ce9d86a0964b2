"""The admission webhook's address as the API server should dial it: a Service reference.

kopf's `WebhookServer` registers a URL (`https://<host>:<port>/...`). A URL naming the operator's
Service (`inferplane-operator.<ns>.svc`) needs the API server to resolve cluster DNS, which most
control planes cannot (kubeadm, kind and managed API servers use the node's resolver). A
`clientConfig.service` reference is resolved by the API server itself, through the Service, and
its TLS name is `<name>.<namespace>.svc`, which the certificate must carry.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import kopf


class ServiceWebhookServer(kopf.WebhookServer):
    """kopf's webhook server (listener, TLS, CA bundle), advertised as a Service reference."""

    def __init__(self, *, service_namespace: str, service_name: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.service_namespace = service_namespace
        self.service_name = service_name

    async def __call__(self, fn: Any) -> AsyncIterator[Any]:
        async for config in super().__call__(fn):
            # kopf appends each handler's path to service.path, as it does to a URL.
            service = {"namespace": self.service_namespace, "name": self.service_name, "port": self.port}
            yield {"service": service, **({"caBundle": config["caBundle"]} if "caBundle" in config else {})}


def parse_service(value: str) -> tuple[str, str]:
    """'NAMESPACE/NAME' -> (namespace, name); ValueError naming the flag otherwise."""
    namespace, sep, name = value.partition("/")
    if not sep or not namespace or not name or "/" in name:
        raise ValueError(f"--webhook-service must be NAMESPACE/NAME, got {value!r}")
    return namespace, name
