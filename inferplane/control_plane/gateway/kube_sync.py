"""Keeps the gateway's router and catalog in step with the InferenceDeployments of a cluster.

In local mode the supervisor knows every worker it starts; in a cluster the gateway learns the same
facts from the API server instead: each InferenceDeployment names a served model (A/B weight, tier,
KV block size) and the operator gives it a headless Service whose EndpointSlices list its ready
pods. This module turns those into ``router.set_route`` calls and, once a served model has a
replica, a ``catalog.put`` with the tokenizer and context length that replica reports over ``Info``.

The mapping itself (an API object → ``ResourceRoute`` → router deployments and catalog entry) is
served_routes.py, which local mode uses too; here is what only a cluster needs:

* ``KubernetesCatalogSync``: re-lists the resources on an interval (no watch: restart-free, like
  ``KubernetesEndpointSource``), starts and stops one endpoint-polling task per resource, applies
  the table, and publishes catalog entries. Its API calls are plain callables, so tests can hand
  it any lister and endpoint-source factory; ``from_api_client`` wires the official client.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc

from inferplane.api.deployment import GROUP, PLURAL, VERSION
from inferplane.control_plane.autoscale.autoscaler import Autoscaler
from inferplane.control_plane.autoscale.kube import prefill_target
from inferplane.control_plane.autoscale.settings import watch
from inferplane.control_plane.gateway.catalog import Catalog
from inferplane.control_plane.gateway.served_routes import (
    ResourceRoute,
    catalog_entry,
    resource_routes,
    route_table,
    router_deployment,
    served_settings,
)
from inferplane.control_plane.routing import Deployment, Endpoint, Router, Tier
from inferplane.control_plane.routing.worker_channels import WorkerChannels
from inferplane.v1 import worker_pb2

log = logging.getLogger(__name__)

SERVICE_PORT_NAME = "grpc"  # manifests.service names the worker port so


class KubeConfigError(RuntimeError):
    """Neither an in-cluster service account nor a kubeconfig is available."""


# ---- the sync ------------------------------------------------------------------------------------


class PollingEndpointSource(Protocol):
    """An ``EndpointSource`` that refreshes itself while ``run`` runs (``KubernetesEndpointSource``)."""

    def endpoints(self) -> tuple[Endpoint, ...]: ...

    async def run(self, interval_s: float = 2.0) -> None: ...


Lister = Callable[[], Sequence[Mapping[str, Any]]]  # blocking; runs in a thread
SourceFactory = Callable[[str, str], PollingEndpointSource]  # (service, namespace) -> source


@dataclass
class _Tracked:
    route: ResourceRoute
    source: PollingEndpointSource
    task: asyncio.Task[None]
    prefill: tuple[str, PollingEndpointSource, asyncio.Task[None]] | None = None  # (Service, source, poller)

    def cancel(self) -> None:
        self.task.cancel()
        if self.prefill is not None:
            self.prefill[2].cancel()


@dataclass
class _Published:
    trigger: tuple[Any, ...]
    created: int


@dataclass
class KubernetesCatalogSync:
    """Applies the cluster's InferenceDeployments to ``router`` and ``catalog``.

    Only models this sync published are ever removed from the catalog, so it can share a catalog
    with entries added by other means.
    """

    router: Router
    catalog: Catalog
    channels: WorkerChannels
    lister: Lister
    source_factory: SourceFactory
    resync_interval: float = 5.0
    endpoint_interval: float = 2.0
    info_timeout: float = 10.0
    autoscaler: Autoscaler | None = None  # scales the resources whose spec enables autoscaling
    _tracked: dict[tuple[str, str], _Tracked] = field(default_factory=dict, init=False)
    _table: dict[str, tuple[ResourceRoute, ...]] = field(default_factory=dict, init=False)
    _published: dict[str, _Published] = field(default_factory=dict, init=False)
    _held_models: set[str] = field(default_factory=set, init=False)
    _task: asyncio.Task[None] | None = field(default=None, init=False)
    # Each routed resource's status conditions by its router deployment name (namespace/name), as of
    # the last listing: what the console's deployments page shows beside the replicas.
    conditions: dict[str, list[dict[str, Any]]] = field(default_factory=dict, init=False)

    @classmethod
    def from_api_client(cls, api_client: Any, router: Router, catalog: Catalog, channels: WorkerChannels, *,
                        namespaces: Sequence[str] | None, request_timeout: float = 10.0,
                        **kwargs: Any) -> KubernetesCatalogSync:
        """Wires the official (synchronous) client; ``namespaces=None`` watches every namespace."""
        from kubernetes import client

        from inferplane.control_plane.routing import KubernetesEndpointSource

        custom = client.CustomObjectsApi(api_client)
        discovery = client.DiscoveryV1Api(api_client)

        def lister() -> list[Mapping[str, Any]]:
            if namespaces is None:
                return list(custom.list_cluster_custom_object(
                    GROUP, VERSION, PLURAL, _request_timeout=request_timeout).get("items") or [])
            items: list[Mapping[str, Any]] = []
            for ns in namespaces:
                items += custom.list_namespaced_custom_object(
                    GROUP, VERSION, ns, PLURAL, _request_timeout=request_timeout).get("items") or []
            return items

        def source_factory(service: str, namespace: str) -> PollingEndpointSource:
            return KubernetesEndpointSource(service, namespace, port_name=SERVICE_PORT_NAME, api=discovery)

        return cls(router, catalog, channels, lister, source_factory, **kwargs)

    # -- one round -------------------------------------------------------------------------------
    async def sync_once(self) -> None:
        """List the resources, apply them, and publish what has replicas. Raises when listing fails
        (the loop logs it and keeps the last applied state: a flaky API server takes nothing down)."""
        objs = await asyncio.to_thread(self.lister)
        routes = resource_routes(objs)
        self.conditions = {r.deployment_name: list(r.conditions) for r in routes}
        self.apply(routes)
        await self.publish()

    def apply(self, routes: Iterable[ResourceRoute]) -> None:
        """Start/stop endpoint polling per resource, then set or remove routes that changed."""
        wanted = {r.key: r for r in routes}
        for key in [k for k in self._tracked if k not in wanted]:
            self._tracked.pop(key).cancel()
        for key, route in wanted.items():
            tracked = self._tracked.get(key)
            if tracked is None:
                tracked = self._tracked[key] = _Tracked(route, *self._poll(route.name, route.namespace))
            tracked.route = route
            if (tracked.prefill[0] if tracked.prefill else None) != route.prefill_pool:
                if tracked.prefill is not None:
                    tracked.prefill[2].cancel()
                tracked.prefill = None
                if route.prefill_pool is not None:  # a disaggregated deployment's prefill pool: its own Service
                    tracked.prefill = (route.prefill_pool, *self._poll(route.prefill_pool, route.namespace))
        table = route_table(wanted.values())
        for model in [m for m in self._table if m not in table]:
            self.router.remove_route(model)
            if self._published.pop(model, None) is not None:
                self.catalog.remove(model)
            log.info("served model %s removed", model)
        for model, members in table.items():
            if self._table.get(model) != members:
                self.router.set_route(model, [self._deployment(r) for r in members])
                log.info("served model %s -> %s", model, ", ".join(
                    f"{r.deployment_name} ({r.tier}, weight {r.weight:g})" for r in members))
        self._table = table
        if self.autoscaler is not None:
            self._autoscale(wanted.values())

    def _autoscale(self, routes: Iterable[ResourceRoute]) -> None:
        """Autoscaled resources are watched ("namespace/name", the Scaler's and the router's name)."""
        autoscaler = self.autoscaler
        assert autoscaler is not None
        watched = set()
        held_models = set()
        for route in routes:
            if route.autoscaling is None:
                continue
            watch(autoscaler, route.deployment_name, route.served_model_name, route.deployment_name,
                  route.autoscaling)
            watched.add(route.deployment_name)
            if route.prefill_autoscaling is not None:  # its prefill pool, on its own signals
                watch(autoscaler, prefill_target(route.deployment_name), route.served_model_name,
                      route.prefill_deployment_name, route.prefill_autoscaling)
                watched.add(prefill_target(route.deployment_name))
            if route.autoscaling.hold is not None:
                held_models.add(route.served_model_name)
        for name in [n for n in autoscaler.targets if n not in watched]:
            autoscaler.unwatch(name)
        for model in self._held_models - held_models:
            autoscaler.activator.configure(model, None)
        self._held_models = held_models

    def _poll(self, service: str, namespace: str | None) -> tuple[PollingEndpointSource, asyncio.Task[None]]:
        """The endpoint source of a headless Service, and the task that keeps it current."""
        source = self.source_factory(service, namespace)
        return source, asyncio.create_task(source.run(self.endpoint_interval), name=f"endpoints {namespace}/{service}")

    def _deployment(self, route: ResourceRoute) -> Deployment:
        tracked = self._tracked[route.key]
        return router_deployment(route, tracked.source, tracked.prefill[1] if tracked.prefill else None)

    async def publish(self) -> None:
        """Put each served model that has a replica into the catalog, from that replica's ``Info``.

        Asked again whenever the model's relevant spec or its replica set changes: during a rollout
        the first answer may come from an old pod, and the last change (old pods gone) corrects it.
        """
        for model, members in list(self._table.items()):
            addresses = self._addresses(members)
            if not addresses:
                continue
            trigger = (tuple(m.model_fingerprint for m in members), tuple(m.model_sha256 for m in members),
                       *served_settings(members), tuple(sorted(addresses)))
            previous = self._published.get(model)
            if previous is not None and previous.trigger == trigger:
                continue
            info = await self._fetch_info(addresses)
            if info is None or self._table.get(model) != members:
                continue  # no replica answered (next round retries), or the model changed meanwhile
            entry = catalog_entry(model, members, info)
            if previous is not None:
                entry.created = previous.created  # /v1/models shows when the model appeared, not the last refresh
            self.catalog.put(entry)
            self._published[model] = _Published(trigger, entry.created)
            log.info("served model %s published (max_model_len %d)", model, info.max_model_len)

    def _addresses(self, members: Sequence[ResourceRoute]) -> list[str]:
        """Replica addresses, primaries first (a spillover tier may run a differently built copy)."""
        ordered = sorted(members, key=lambda r: r.tier is not Tier.PRIMARY)
        seen: dict[str, None] = {}
        for route in ordered:
            tracked = self._tracked.get(route.key)
            for ep in tracked.source.endpoints() if tracked else ():
                seen.setdefault(ep.address, None)
        return list(seen)

    async def _fetch_info(self, addresses: Sequence[str]) -> Any | None:
        healthy = [a for a in addresses if self.router.health.is_healthy(a)]
        for address in healthy + [a for a in addresses if a not in healthy]:
            try:
                return await self.channels.stub(address).Info(worker_pb2.InfoRequest(), timeout=self.info_timeout)
            except grpc.aio.AioRpcError as exc:
                log.debug("Info from %s failed: %s", address, exc.code())
        return None

    # -- lifecycle -------------------------------------------------------------------------------
    async def run(self) -> None:
        """Re-list every ``resync_interval`` and publish every ``endpoint_interval`` (replicas come
        and go faster than resources do), until cancelled."""
        loop = asyncio.get_running_loop()
        next_list = loop.time()
        while True:
            if loop.time() >= next_list:
                next_list = loop.time() + self.resync_interval
                try:
                    await self.sync_once()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # one line per round; the traceback only at debug level
                    log.warning("listing InferenceDeployments failed, keeping the last state: %s",
                                " ".join(str(exc).split())[:300], exc_info=log.isEnabledFor(logging.DEBUG))
            else:
                try:
                    await self.publish()
                except asyncio.CancelledError:
                    raise
                except Exception:  # a bug, not a flaky API: keep the traceback
                    log.warning("publishing served models failed", exc_info=True)
            await asyncio.sleep(min(self.endpoint_interval, max(0.0, next_list - loop.time())))

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self.run(), name="kubernetes catalog sync")

    async def stop(self) -> None:
        """Cancel the loop and every endpoint poller; routes and catalog are left as they were."""
        tasks = [task for t in self._tracked.values()
                 for task in (t.task, *((t.prefill[2],) if t.prefill is not None else ()))]
        if self._task is not None:
            tasks.append(self._task)
            self._task = None
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tracked.clear()

    @property
    def models(self) -> list[str]:
        return sorted(self._table)


# ---- client configuration -------------------------------------------------------------------------


def load_api_client(kubeconfig: str | None = None, context: str | None = None) -> Any:
    """An ``ApiClient`` for the in-cluster service account, else for the kubeconfig (``kubeconfig``,
    else ``$KUBECONFIG``, else ~/.kube/config). Raises ``KubeConfigError`` with a one-line reason.

    A private ``Configuration`` rather than the client's global default, so that tests and an
    embedding process can hold clients for different clusters side by side.
    """
    from kubernetes import client, config

    configuration = client.Configuration()
    configuration.retries = 0  # the sync loops retry on their next tick; urllib3's own retries only add noise
    if kubeconfig is None and context is None:
        try:
            config.load_incluster_config(client_configuration=configuration)
            return client.ApiClient(configuration)
        except config.ConfigException as exc:
            in_cluster = f"not in a cluster ({exc})"
    else:
        in_cluster = "a kubeconfig or context was asked for"
    path = kubeconfig or os.environ.get("KUBECONFIG") or None
    try:
        config.load_kube_config(config_file=path, context=context, client_configuration=configuration)
    except (config.ConfigException, OSError, TypeError, ValueError) as exc:
        where = path or "~/.kube/config"
        raise KubeConfigError(f"no Kubernetes API: {in_cluster} and no usable "
                              f"kubeconfig at {where} ({' '.join(str(exc).split())})") from exc
    return client.ApiClient(configuration)
