"""From InferenceDeployments to what the gateway serves: the one mapping for local mode and the cluster.

Each deployment (a spec and its name) becomes a `ResourceRoute` (served model name, A/B weight, tier,
KV block size, cache isolation, priority band, autoscaling); the routes of one served model become
its router `Deployment`s (`router_deployment`, over the endpoint source that lists its replicas: the
local supervisor's, or the cluster's EndpointSlices) and, once a replica answers `Info`, its catalog
entry (`catalog_entry`, with the isolation and band that every deployment behind the name settles
on). `inferplane up` (local/platform.py) and the cluster sync (kube_sync.py) both go through here,
so a manifest means the same on one machine and on a cluster.

Invariant: equal inputs give equal routes and tables (sorted), so a sync can skip what did not change.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from inferplane.api.deployment import InferenceDeploymentSpec, SpecError, prefill_pool_name
from inferplane.api.resolve import prefill_spec, resolve, served_cache_isolation, served_priority
from inferplane.control_plane.autoscale.settings import AutoscaleSettings, autoscale_settings
from inferplane.control_plane.gateway.catalog import ServedModel
from inferplane.control_plane.routing import Deployment, EndpointSource, Tier

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResourceRoute:
    """What the gateway needs from one InferenceDeployment. Equal values mean "nothing to redo"."""

    namespace: str | None  # None: local mode, where names are unique on their own
    name: str  # the resource and, by the operator's convention, its headless Service
    served_model_name: str
    weight: float
    tier: Tier
    block_size: int
    cache_isolation: str
    model_fingerprint: str  # changes whenever what the workers load (and so Info) may change
    autoscaling: AutoscaleSettings | None = None  # None: the spec's replicas are the user's
    # spec.replicas (the autoscaler writes it, the sync re-reads it): the metrics' desired replicas. None
    # in local mode, where the supervisor's source lists every replica it runs, scaled or not.
    replicas: int | None = 1
    priority: str | None = None  # spec.priority: the default band of the served model's requests
    # The registry digest of the weights it serves (status.model.sha256; local mode: the fetched
    # weights'), None where none is known: what LoRA adapters bind to.
    model_sha256: str | None = None
    routing_policy: str = "prefix-hash"  # spec.routing.policy, resolved
    # Prefill/decode disaggregation: the prefill pool's name (its headless Service in a cluster, its
    # process group locally), None where the deployment has none; and the decider's threshold.
    prefill_pool: str | None = None
    min_prefill_tokens: int = 512
    prefill_autoscaling: AutoscaleSettings | None = None  # the prefill pool's, on its own workers' signals
    prefill_replicas: int | None = None  # spec.disaggregation.prefill.replicas (as `replicas`: None locally)
    # The resource's status conditions, shown (the console's deployments page), never routed by: a
    # change of them alone is not a change of the route.
    conditions: tuple[dict[str, Any], ...] = field(default=(), compare=False)

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace or "", self.name)

    @property
    def deployment_name(self) -> str:
        """namespace/name: unique across namespaces, which one served model may span (local: the name)."""
        return self.name if self.namespace is None else f"{self.namespace}/{self.name}"

    @property
    def prefill_deployment_name(self) -> str | None:
        """The prefill pool's router deployment name (namespace/name, as `deployment_name`)."""
        if self.prefill_pool is None:
            return None
        return self.prefill_pool if self.namespace is None else f"{self.namespace}/{self.prefill_pool}"

    @classmethod
    def of(cls, name: str, spec: InferenceDeploymentSpec, *, namespace: str | None = None,
           fingerprint: str = "", model_sha256: str | None = None) -> ResourceRoute:
        """The route of the deployment `name` with `spec`."""
        resolved = resolve(spec)
        return cls(namespace=namespace, name=name, served_model_name=spec.served_model_name(name),
                   weight=float(spec.serving.weight), tier=Tier(spec.serving.tier),
                   block_size=resolved.block_size, cache_isolation=spec.cache_isolation,
                   model_fingerprint=fingerprint, autoscaling=autoscale_settings(spec, resolved),
                   replicas=None if namespace is None else spec.replicas, priority=spec.priority,
                   model_sha256=model_sha256, routing_policy=resolved.routing_policy,
                   prefill_pool=prefill_pool_name(name) if spec.disaggregation.enabled else None,
                   min_prefill_tokens=spec.disaggregation.min_prefill_tokens,
                   prefill_autoscaling=_prefill_autoscaling(spec),
                   prefill_replicas=None if namespace is None else spec.disaggregation.prefill.replicas)


def _prefill_autoscaling(spec: InferenceDeploymentSpec) -> AutoscaleSettings | None:
    """A disaggregated deployment's prefill pool scales with the spec's autoscaling settings, within
    its own replica bounds and on its own workers' queue and KV use. It never holds requests at zero
    replicas: without a prefill replica the decode replica computes the prompt."""
    if not spec.disaggregation.enabled:
        return None
    settings = autoscale_settings(prefill_spec(spec))
    return None if settings is None else dataclasses.replace(settings, hold=None)


def _fingerprint(spec: Mapping[str, Any]) -> str:
    """The spec fields that change the catalog entry: weights and tokenizer (model), context length
    (engine.maxModelLen) and cache isolation. Replicas, weights and tiers deliberately excluded."""
    relevant = {"model": spec.get("model"), "maxModelLen": (spec.get("engine") or {}).get("maxModelLen"),
                "cacheIsolation": spec.get("cacheIsolation")}
    return hashlib.sha256(json.dumps(relevant, sort_keys=True, default=str).encode()).hexdigest()[:16]


def resource_route(obj: Mapping[str, Any]) -> ResourceRoute:
    """One InferenceDeployment (an API dict) as a route; raises ``SpecError`` for an invalid spec."""
    meta = obj.get("metadata") or {}
    name = meta.get("name")
    if not name:
        raise SpecError("metadata.name", "required")
    raw_spec = obj.get("spec") or {}
    status = obj.get("status") or {}
    model_status = status.get("model") or {}
    route = ResourceRoute.of(name, InferenceDeploymentSpec.from_dict(raw_spec),
                             namespace=meta.get("namespace") or "default", fingerprint=_fingerprint(raw_spec),
                             model_sha256=model_status.get("sha256") or None)
    return dataclasses.replace(route, conditions=tuple(dict(c) for c in status.get("conditions") or ()))


def resource_routes(objs: Iterable[Mapping[str, Any]]) -> list[ResourceRoute]:
    """Routes of the resources that should take traffic. A resource being deleted (deletionTimestamp
    set: its pods are draining) is left out, as is one whose spec does not parse; the latter is
    logged, never fatal, so one bad object cannot take the other models off the gateway."""
    routes = []
    objs = list(objs)
    names = {((o.get("metadata") or {}).get("namespace") or "default", (o.get("metadata") or {}).get("name"))
             for o in objs}
    for obj in objs:
        meta = obj.get("metadata") or {}
        if meta.get("deletionTimestamp"):
            continue
        try:
            route = resource_route(obj)
        except (SpecError, ValueError) as exc:
            log.warning("ignoring InferenceDeployment %s/%s: %s", meta.get("namespace"), meta.get("name"), exc)
            continue
        if route.prefill_pool is not None and (route.namespace, route.prefill_pool) in names:
            # Its prefill pool's name is another resource's (the operator refuses it: NameTaken):
            # never send one deployment's prompts to the other's pods; it serves as one pool.
            log.warning("InferenceDeployment %s: its prefill pool's name %s is another resource's; served without it",
                        route.deployment_name, route.prefill_pool)
            route = dataclasses.replace(route, prefill_pool=None, prefill_autoscaling=None)
        routes.append(route)
    return routes


def route_table(routes: Iterable[ResourceRoute]) -> dict[str, tuple[ResourceRoute, ...]]:
    """Served model name → its resources, each group sorted by (namespace, name) so that equal
    inputs give equal tables and the sync can skip unchanged models."""
    table: dict[str, list[ResourceRoute]] = {}
    for route in routes:
        table.setdefault(route.served_model_name, []).append(route)
    return {model: tuple(sorted(members, key=lambda r: r.key)) for model, members in sorted(table.items())}


def router_deployment(route: ResourceRoute, source: EndpointSource,
                      prefill_source: EndpointSource | None = None) -> Deployment:
    """The router's view of one deployment: its replicas (from `source`), weight, tier, block size and
    routing policy; a disaggregated one's prefill pool over `prefill_source` (prefix-hash: a prefix
    shared by many prompts stays cached on one prefill replica)."""
    prefill = None
    if route.prefill_pool is not None and prefill_source is not None:
        prefill = Deployment(route.prefill_deployment_name, prefill_source, block_size=route.block_size,
                             desired_replicas=route.prefill_replicas)
    return Deployment(route.deployment_name, source, weight=route.weight, tier=route.tier,
                      block_size=route.block_size, desired_replicas=route.replicas,
                      routing_policy=route.routing_policy, prefill=prefill,
                      min_prefill_tokens=route.min_prefill_tokens)


def served_settings(members: Sequence[ResourceRoute]) -> tuple[str, str]:
    """(cache isolation, default priority band) of a served model, from every deployment behind it."""
    return (served_cache_isolation(m.cache_isolation for m in members),
            served_priority(m.priority for m in members))


def catalog_entry(model: str, members: Sequence[ResourceRoute], info: Any,
                  digests: Iterable[str | None] | None = None) -> ServedModel:
    """The served model's catalog entry from a replica's `Info` and the deployments behind the name;
    `digests`: the weights' registry digests where the routes do not carry them (local mode)."""
    isolation, band = served_settings(members)
    found = [m.model_sha256 for m in members] if digests is None else list(digests)
    return ServedModel.from_info(model, info, cache_isolation=isolation, priority=band,
                                 weights_sha256=frozenset(d for d in found if d))
