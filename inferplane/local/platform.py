"""`inferplane up`: the whole platform on one machine.

State lives in SQLite under the home folder; the supervisor runs one worker process per replica
of each InferenceDeployment; the gateway serves the OpenAI-compatible API. On first start a
bootstrap tenant, tenant key and admin key are created and printed once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import stat
from pathlib import Path

from inferplane.api.model_resolution import BUILTIN_MODELS, ModelResolutionError, ResolvedAdapter, ResolvedModel
from inferplane.control_plane import auth, registry, tenants
from inferplane.control_plane.autoscale.autoscaler import Autoscaler, AutoscalerMetrics
from inferplane.control_plane.autoscale.settings import watch
from inferplane.control_plane.errors import Conflict, NotFound
from inferplane.control_plane.gateway.served_routes import ResourceRoute, catalog_entry, route_table, router_deployment
from inferplane.control_plane.gateway.server import Gateway, GatewaySettings
from inferplane.control_plane.outbound import ENV_OUTBOUND_ALLOW, split_entries
from inferplane.local import runstate
from inferplane.local.manifests import Manifest, check_prefill_pool_names, kept_documents, manifest_of
from inferplane.local.supervisor import LocalDeployment, Replica, Supervisor, SupervisorScaler
from inferplane.storage.fetch import FetchResult, fetch_model
from inferplane.v1 import worker_pb2

log = logging.getLogger(__name__)

BOOTSTRAP_TENANT = "default"
def _secret_file(path: Path, value: str) -> None:
    path.write_text(value + "\n")
    os.chmod(path, stat.S_IRUSR | stat.S_IWUSR)


class LocalPlatform:
    def __init__(self, home: Path, manifests: list[Manifest], host: str, port: int, grpc_port: int | None, *,
                 autoscale_interval: float = 1.0, metrics_port: int | None = 0):
        """`metrics_port`: the gateway's metrics listener (0: a free port, as each worker's; None: none)."""
        self.home = home
        # The files' deployments, then those applied through the admin API on an earlier run.
        given = {m.name for m in manifests}
        kept = [manifest_of(doc, path) for path, doc in kept_documents(home)]
        self.manifests = [*manifests, *(m for m in kept if m.name not in given)]
        check_prefill_pool_names(self.manifests)
        self.host, self.port, self.grpc_port = host, port, grpc_port
        home.mkdir(parents=True, exist_ok=True)
        # Where the admin API may register weights from (model_roots below): made here, so that a
        # file copied in can be registered without first finding out that the folder must exist.
        (home / "models").mkdir(exist_ok=True)
        admin_file = home / "admin-key"
        if not admin_file.exists():
            _secret_file(admin_file, "ipadmin_" + secrets.token_urlsafe(32))
        salt_file = home / "salt-secret"
        if not salt_file.exists():
            _secret_file(salt_file, secrets.token_hex(32))
        # Alert routing is on locally too: point an Alertmanager at /alerts/v1/webhook with this
        # file as its bearer credentials_file (README, "Alert routing").
        alert_file = home / "alert-webhook-secret"
        if not alert_file.exists():
            _secret_file(alert_file, secrets.token_urlsafe(32))
        self.admin_key = admin_file.read_text().strip()
        settings = GatewaySettings(db_url=f"sqlite:///{home / 'inferplane.db'}", host=host, port=port,
                                   grpc_port=grpc_port, metrics_port=metrics_port, bootstrap_key=self.admin_key,
                                   salt_secret=bytes.fromhex(salt_file.read_text().strip()),
                                   model_roots=(str(home / "models"),),
                                   alert_webhook_secret=alert_file.read_text().strip(),
                                   # as in a cluster: webhooks and http(s) model URIs reach public
                                   # addresses, and the internal ones this variable lists (a local receiver)
                                   outbound_allow=tuple(split_entries(os.environ.get(ENV_OUTBOUND_ALLOW))))
        self.gateway = Gateway(settings)
        self.supervisor = Supervisor(home, on_ready=self._replica_ready)
        self.autoscaler = Autoscaler(
            self.gateway.router, self.gateway.channels, self.gateway.activator,
            SupervisorScaler(self.supervisor, load=self.gateway.router.load.outstanding),
            metrics=AutoscalerMetrics(self.gateway.context.metrics.registry), interval=autoscale_interval)
        self._autoscaling: asyncio.Task | None = None
        self._run_state: asyncio.Task | None = None
        self.tenant_key: str | None = None
        self.fetches: dict[str, FetchResult] = {}  # deployment name -> how its registry weights were fetched
        self.resolved_models: dict[str, ResolvedModel] = {}  # deployment name -> its registry model
        self.digests: dict[str, str | None] = {}  # deployment name -> its weights' digest (what adapters bind to)
        # served model name -> its deployments' routes: the mapping the cluster sync uses (served_routes)
        self.routes = route_table(ResourceRoute.of(m.name, m.spec) for m in self.manifests)

    def bootstrap(self) -> None:
        """First start only: the default tenant and its key (printed once, never stored)."""
        with self.gateway.sessions.begin() as session:
            try:
                tenants.get_tenant(session, BOOTSTRAP_TENANT)
                return
            except NotFound:
                pass
            tenants.create_tenant(session, BOOTSTRAP_TENANT, actor="inferplane-up", display_name="bootstrap tenant")
            created = auth.create_key(session, BOOTSTRAP_TENANT, actor="inferplane-up", name="bootstrap",
                                      scopes=(auth.SCOPE_INFER, auth.SCOPE_MODELS_READ))
            self.tenant_key = created.secret

    def _model_path(self, manifest: Manifest) -> str:
        """What the worker should load. A registry name resolves as in a cluster
        (`registry.resolve_for_deployment`) and its weights are fetched and verified into
        `<home>/model-cache` (a local path is verified in place); a `uri` is registered once: a
        restart with the same weights reuses its version (`reuse_unchanged`), new weights are a new one."""
        model = manifest.spec.model
        if model.name is not None:
            with self.gateway.sessions.begin() as session:
                try:
                    resolved = registry.resolve_for_deployment(session, model.name, model.version)
                except ModelResolutionError:
                    if model.name not in BUILTIN_MODELS or model.version is not None:
                        raise
                    info = registry.register_model(session, model.name, actor="inferplane-up", name=model.name,
                                                   reuse_unchanged=True)
                    self.digests[manifest.name] = info.sha256
                    return str(info.path)
            resolved.require_kind(manifest.spec.kind)
            self.resolved_models[manifest.name] = resolved
            fetched = fetch_model(resolved.uri, self.home / "model-cache", sha256=resolved.sha256)
            self.fetches[manifest.name] = fetched
            self.digests[manifest.name] = resolved.sha256
            return str(fetched.path)
        uri = model.uri or ""
        with self.gateway.sessions.begin() as session:
            try:
                info = registry.register_model(session, uri, actor="inferplane-up", name=manifest.name,
                                               outbound=self.gateway.context.outbound, reuse_unchanged=True)
                self.digests[manifest.name] = info.sha256
            except Conflict:
                self.digests[manifest.name] = registry.get_model(session, auth.ALL_TENANTS, manifest.name).sha256
        return uri.removeprefix("file://")

    def _adapters(self, manifest: Manifest) -> tuple[ResolvedAdapter, ...]:
        """spec.adapters resolved as the operator does (registry.resolve_adapter), each an adapter of
        the deployment's registry model; ModelResolutionError naming the first that is not."""
        found = []
        with self.gateway.sessions.begin() as session:
            for ref in manifest.spec.adapters:
                adapter = registry.resolve_adapter(session, ref.name, ref.version)
                adapter.require_base(self.resolved_models.get(manifest.name))
                found.append(adapter)
        return tuple(found)

    @property
    def gateway_metrics_url(self) -> str | None:
        """Where the gateway's /metrics is scraped (its own listener, never the API port); None: off."""
        port = self.gateway.metrics_port
        return None if port is None else f"http://{self.host}:{port}/metrics"

    def run_state(self) -> dict:
        """What runs, for run.json (`inferplane status`, and the next start's leftover cleanup)."""
        return {
            "supervisor_pid": os.getpid(), "home": str(self.home), "logs": str(self.home / "logs"),
            "gateway": {"url": f"http://{self.host}:{self.port}", "grpc_port": self.grpc_port,
                        "metrics": self.gateway_metrics_url},
            "deployments": [{
                "name": d.name, "served_model": d.served_model_name, "runtime": d.resolved.runtime,
                "model": d.model_arg, "replicas": [{
                    "index": r.index, "pid": r.process.pid if r.process is not None else None,
                    "address": r.address, "metrics": f"http://127.0.0.1:{r.metrics_port}/metrics",
                    "ready": r.ready, "restarts": r.restarts, "log": str(r.log_path)} for r in d.replicas],
            } for d in self.supervisor.deployments.values()],
        }

    async def _keep_run_state(self) -> None:
        while True:
            runstate.write(self.home, self.run_state())
            await asyncio.sleep(1.0)

    async def start(self) -> None:
        stopped = await asyncio.get_running_loop().run_in_executor(None, runstate.end_leftovers, self.home)
        if stopped:
            log.warning("stopped %d worker(s) a previous run left behind: pids %s", len(stopped),
                        ", ".join(map(str, stopped)))
        self.bootstrap()
        await self.gateway.start()
        for manifest in self.manifests:
            await self.start_deployment(manifest)
        self.sync_routes()
        self._run_state = asyncio.get_running_loop().create_task(self._keep_run_state())

    async def start_deployment(self, manifest: Manifest, *, succeeding: dict[str, LocalDeployment] | None = None):
        """Resolves the manifest's model and adapters and starts its replicas (beside `succeeding`'s,
        in a rollout: supervisor.add); ModelResolutionError or InvalidInput before anything starts."""
        loop = asyncio.get_running_loop()
        path = await loop.run_in_executor(None, self._model_path, manifest)
        adapters = await loop.run_in_executor(None, self._adapters, manifest)
        return self.supervisor.add(manifest.name, manifest.spec, path, adapters, succeeding=succeeding)

    def sync_routes(self) -> None:
        """The router, the catalog and the autoscaler made to match `self.manifests`: a served name no
        manifest has any more leaves the routes and the catalog; each route's autoscaling is watched
        (its requests held at zero replicas), and what no route has is unwatched."""
        routes = route_table(ResourceRoute.of(m.name, m.spec) for m in self.manifests)
        for served in self.routes.keys() - routes.keys():
            self.gateway.router.remove_route(served)
            self.gateway.catalog.remove(served)
        watched = set()
        for served, members in routes.items():
            self.gateway.router.set_route(served, [self._router_deployment(r) for r in members])
            for route in members:
                for name, settings in ((route.name, route.autoscaling),
                                       (route.prefill_pool, route.prefill_autoscaling)):
                    if settings is not None:
                        watch(self.autoscaler, name, served, name, settings)
                        watched.add(name)
        for name in set(self.autoscaler.targets) - watched:
            self.autoscaler.unwatch(name)
        self.routes = routes
        if self.autoscaler.targets and self._autoscaling is None:
            self._autoscaling = asyncio.get_running_loop().create_task(self.autoscaler.run())

    def _router_deployment(self, route: ResourceRoute):
        """The router's view of a local deployment: its processes, and its prefill pool's if it has one."""
        prefill = self.supervisor.deployments.get(route.prefill_pool) if route.prefill_pool else None
        return router_deployment(route, self.supervisor.deployments[route.name].source,
                                 prefill.source if prefill is not None else None)

    def _replica_ready(self, deployment: LocalDeployment, replica: Replica) -> None:
        if deployment.owner:
            return  # a prefill pool's replica: the catalog entry comes from the deployment's own
        served = deployment.served_model_name
        if served not in {m.name for m in self.gateway.catalog.visible(None)}:
            asyncio.get_running_loop().create_task(self.publish(deployment, replica))

    async def publish(self, deployment: LocalDeployment, replica: Replica) -> None:
        """Adds the served model to the catalog with the tokenizer and context length the worker reports."""
        info = await self.gateway.channels.stub(replica.address).Info(worker_pb2.InfoRequest(), timeout=30)
        served = deployment.served_model_name
        members = self.routes[served]
        self.gateway.catalog.put(catalog_entry(served, members, info, [self.digests.get(r.name) for r in members]))

    async def wait_ready(self, timeout: float) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        wanted = {d.served_model_name for d in self.supervisor.deployments.values()}
        while loop.time() < deadline:
            if wanted <= {m.name for m in self.gateway.catalog.visible(None)}:
                return True
            if self.supervisor.failed_to_start():
                return False
            await asyncio.sleep(0.2)
        return False

    async def stop(self) -> None:
        """The gateway drains first (what is in flight finishes on the workers), then the workers stop."""
        if self._autoscaling is not None:
            self._autoscaling.cancel()
        if self._run_state is not None:
            self._run_state.cancel()
        await self.gateway.stop()
        await self.supervisor.stop()
        runstate.remove(self.home)
