"""What an operator process is configured with; the CLI builds it, tests and the bench pass their own."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from inferplane.operator.kv_tier import KVTierVolume
from inferplane.operator.manifests import DEFAULT_IMAGE
from inferplane.operator.model_pod import ModelCache


@dataclass(frozen=True)
class WebhookConfig:
    """The admission webhook's listener. insecure (plain HTTP) is for tests only: Kubernetes needs HTTPS."""

    port: int = 9443
    addr: str = "0.0.0.0"
    host: str | None = None  # a host the API server dials by URL (https://<host>:<port>/...)
    service: tuple[str, str] | None = None  # or (namespace, name) of the Service it dials (port = port)
    certfile: str | None = None
    pkeyfile: str | None = None
    cafile: str | None = None
    insecure: bool = False
    managed: str | None = "inferplane.io"  # the ValidatingWebhookConfiguration kopf keeps up to date


@dataclass(frozen=True)
class OperatorConfig:
    worker_image: str = DEFAULT_IMAGE
    monitoring: bool = True  # create ServiceMonitor/PrometheusRule (needs the Prometheus operator's CRDs)
    webhook: WebhookConfig | None = None
    post_events: bool = True
    # None: standalone (one replica, no peering object needed). A name: kopf acts only while it
    # holds that peering, and waits until the KopfPeering (ClusterKopfPeering) object exists.
    peering_name: str | None = None
    namespaces: tuple[str, ...] = ()  # what the operator watches (for the peering check)
    clusterwide: bool = False
    max_backoff_seconds: float = 60.0
    # Resolves spec.model.name through the control plane's registry (a RegistryClient); None: a
    # name is an alias the worker image knows (no fetch, no digest).
    registry: Any = None
    model_cache: ModelCache = field(default_factory=ModelCache)
    kv_tier: KVTierVolume = field(default_factory=KVTierVolume)  # where KV disk tiers live (per pod by default)
    extra: dict[str, str] = field(default_factory=dict)
