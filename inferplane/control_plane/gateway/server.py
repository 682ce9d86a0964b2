"""Assembles a gateway process: database, key cache, limits, usage, router, REST and gRPC servers."""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import sys
from dataclasses import dataclass

import grpc
import uvicorn

from inferplane.control_plane.alerts.forwarder import AlertForwarder, ForwarderSettings
from inferplane.control_plane.auth import KeyCache
from inferplane.control_plane.autoscale.activator import Activator
from inferplane.control_plane.concurrency import InProcessSequenceLimiter, SequenceLimiter
from inferplane.control_plane.db import init_db, session_factory
from inferplane.control_plane.gateway.adapter_sync import AdapterSync
from inferplane.control_plane.gateway.catalog import Catalog
from inferplane.control_plane.gateway.console.sessions import ConsoleSessions
from inferplane.control_plane.gateway.context import GatewayContext
from inferplane.control_plane.gateway.grpc_api import InferenceServicer
from inferplane.control_plane.gateway.http_protocol import (
    DEFAULT_HEAD_TIMEOUT,
    DEFAULT_MAX_HEAD_BYTES,
    bounded_head_protocol,
)
from inferplane.control_plane.gateway.inference import InferenceService
from inferplane.control_plane.gateway.metrics import (
    GatewayMetrics,
    PlatformCollector,
    PlatformSources,
    ReplicaCount,
    metrics_asgi_app,
)
from inferplane.control_plane.gateway.rest import create_asgi_app
from inferplane.control_plane.limits import InProcessKeyLimiter, KeyLimiter, QuotaTracker
from inferplane.control_plane.outbound import OutboundPolicy
from inferplane.control_plane.routing import HealthPoller, HealthTracker, Router
from inferplane.control_plane.routing.kv_events import KVEventSubscriber
from inferplane.control_plane.routing.worker_channels import WorkerChannels
from inferplane.control_plane.tokens import AdminTokenVerifier, JWTSettings
from inferplane.control_plane.usage import UsageRecorder
from inferplane.v1 import inference_pb2_grpc

log = logging.getLogger(__name__)
GIL_SWITCH_INTERVAL_S = 0.001  # see Gateway.start


@dataclass
class GatewaySettings:
    db_url: str
    host: str = "127.0.0.1"
    port: int = 8080
    grpc_port: int | None = None  # None: no tenant gRPC API
    # The metrics listener on `host` (GET /metrics, for Prometheus): its series name tenants, keys
    # and private adapters, so they are never on the API port. None: no listener; 0: a free port
    # (see Gateway.metrics_port).
    metrics_port: int | None = None
    bootstrap_key: str | None = None
    jwt_algorithm: str | None = None  # "HS256" or "RS256"
    jwt_key: str | None = None  # the HS256 secret or the RS256 public key (PEM)
    jwt_audience: str = "inferplane-admin"
    jwt_issuer: str | None = None  # when set, tokens must carry exactly this `iss`
    salt_secret: bytes = b""
    key_refresh_interval: float = 1.0
    adapter_refresh_interval: float = 2.0  # how soon a LoRA adapter registered elsewhere is served
    usage_flush_interval: float = 2.0
    health_poll_interval: float = 2.0
    # A stream whose worker fails mid-answer moves to another replica (with the tokens delivered so
    # far) at most this many times; then it ends with an error event as before (0: never moves).
    max_migrations: int = 2
    # On stop (SIGTERM): new connections are refused at once, requests and streams in flight get
    # this long to finish (the workers' drainGraceSeconds by default), then the rest is cancelled.
    drain_grace_seconds: float = 30.0
    # How long an idle HTTP keep-alive connection stays open. Longer than the clients' own expiry
    # (httpx and the openai client drop theirs after 5 s) and than a load balancer's idle timeout
    # (60 s on AWS's ALB), as nginx's 75 s is: with uvicorn's 5 s a client reusing a connection at
    # second 5 raced the server's close and got a dropped request (httpx.ReadError) instead of an answer.
    keep_alive_seconds: float = 75.0
    # A request head (request line and headers) larger than this is refused with 431, and one not
    # complete this long after its connection opened (or its first byte came) is closed: uvicorn
    # bounds neither (gateway/http_protocol.py).
    max_header_bytes: int = DEFAULT_MAX_HEAD_BYTES
    header_timeout_seconds: float = DEFAULT_HEAD_TIMEOUT
    # Keys' token buckets and keys' and tenants' sequences in flight in Redis, shared by every
    # replica (None: in this process only), and what to do while Redis is unreachable: "open" limits
    # per replica meanwhile, "closed" answers 503.
    rate_limit_redis_url: str | None = None
    rate_limit_unreachable: str = "open"
    # Folders a platform admin may register weights from through the admin API (none: aliases only).
    model_roots: tuple[str, ...] = ()
    # Alert routing: the secret Alertmanager sends to /alerts/v1/webhook (None: routing off, the
    # webhook answers 503 and no forwarder runs), and how deliveries to tenants' webhooks are retried.
    alert_webhook_secret: str | None = None
    alert_retry_base_delay: float = 1.0
    alert_max_attempts: int = 8
    alert_poll_interval: float = 5.0
    # Internal destinations that tenants' webhooks and admins' http(s) model sources may reach: CIDRs
    # ("10.20.0.0/16", "127.0.0.1") and host names ("hooks.corp.example", "*.corp.example"). Empty:
    # public addresses only (see control_plane.outbound).
    outbound_allow: tuple[str, ...] = ()
    # The web console under /console (gateway/console/): its sessions are signed with a key derived
    # from salt_secret, so every replica sharing that secret accepts them.
    console: bool = True


def _key_limiter(settings: GatewaySettings, metrics: GatewayMetrics) -> KeyLimiter:
    if settings.rate_limit_redis_url is None:
        return InProcessKeyLimiter()
    from inferplane.control_plane.shared_limits import RedisKeyLimiter

    return RedisKeyLimiter(settings.rate_limit_redis_url, failure=settings.rate_limit_unreachable,  # type: ignore[arg-type]
                           errors=metrics.limiter_store_errors)


def _sequence_limiter(settings: GatewaySettings, metrics: GatewayMetrics) -> SequenceLimiter:
    if settings.rate_limit_redis_url is None:
        return InProcessSequenceLimiter()
    from inferplane.control_plane.shared_concurrency import RedisSequenceLimiter

    return RedisSequenceLimiter(settings.rate_limit_redis_url, failure=settings.rate_limit_unreachable,  # type: ignore[arg-type]
                                errors=metrics.limiter_store_errors)


class Gateway:
    def __init__(self, settings: GatewaySettings, catalog: Catalog | None = None, router: Router | None = None):
        self.settings = settings
        self.engine = init_db(settings.db_url)
        self.sessions = session_factory(self.engine)
        self.catalog = catalog or Catalog()
        self.router = router or Router(health=HealthTracker())
        self.keys = KeyCache(self.sessions, refresh_interval=settings.key_refresh_interval)
        self.adapters = AdapterSync(self.sessions, self.catalog, refresh_interval=settings.adapter_refresh_interval)
        self.usage = UsageRecorder(self.sessions, flush_interval=settings.usage_flush_interval)
        self.quota = QuotaTracker(self.sessions, recorder=self.usage)
        self.channels = WorkerChannels()
        self.kv_events = KVEventSubscriber(self.router.kv_index, self.router.kv_aware_addresses, self.channels.stub)
        jwt_verifier = None
        if settings.jwt_algorithm and settings.jwt_key:
            jwt_verifier = AdminTokenVerifier(JWTSettings(algorithm=settings.jwt_algorithm, key=settings.jwt_key,
                                                          audience=settings.jwt_audience, issuer=settings.jwt_issuer))
        metrics = GatewayMetrics()
        shared_secret = settings.salt_secret or secrets.token_bytes(32)
        metrics.registry.register(PlatformCollector(PlatformSources(
            database_up=lambda: self.keys.database_ok,
            usage_last_flush=lambda: self.usage.last_flush,
            usage_pending=self.usage.pending_records,
            quotas=self.quota.snapshot,
            replicas=lambda: [ReplicaCount(*row) for row in self.router.replica_counts()],
            routing_decisions=lambda: self.router.decisions,
            kv_index_blocks=self.router.kv_index.blocks,
            kv_replica_blocks=lambda: {a: self.router.kv_index.replica_blocks(a)
                                       for a in self.router.kv_index.replicas()},
            kv_event_batches=lambda: self.kv_events.batches)))
        self.limiter = _key_limiter(settings, metrics)
        self.sequences = _sequence_limiter(settings, metrics)
        self.activator = Activator()
        inference = InferenceService(self.catalog, self.router, self.channels, limiter=self.limiter,
                                     activator=self.activator, sequences=self.sequences,
                                     quota=self.quota, usage=self.usage, metrics=metrics,
                                     salt_secret=shared_secret,
                                     max_migrations=settings.max_migrations)
        outbound = OutboundPolicy.parse(settings.outbound_allow)
        self.alert_forwarder = AlertForwarder(self.sessions, ForwarderSettings(
            base_delay=settings.alert_retry_base_delay, max_attempts=settings.alert_max_attempts,
            poll_interval=settings.alert_poll_interval), outbound=outbound) if settings.alert_webhook_secret else None
        self.context = GatewayContext(sessions=self.sessions, keys=self.keys, catalog=self.catalog,
                                      inference=inference, metrics=metrics,
                                      bootstrap_key=settings.bootstrap_key, jwt_verifier=jwt_verifier,
                                      model_roots=tuple(settings.model_roots),
                                      alert_webhook_secret=settings.alert_webhook_secret,
                                      alert_forwarder=self.alert_forwarder, outbound=outbound,
                                      refresh_adapters=self.adapters.refresh,
                                      console=ConsoleSessions(shared_secret, self.keys,
                                                              bootstrap_key=settings.bootstrap_key,
                                                              jwt_verifier=jwt_verifier) if settings.console else None)
        self.app = create_asgi_app(self.context)
        self._http: uvicorn.Server | None = None
        self._metrics: uvicorn.Server | None = None
        self._metrics_task: asyncio.Task | None = None
        self.metrics_port: int | None = None  # the metrics listener's port once started (None: none)
        self._grpc: grpc.aio.Server | None = None
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        # The event loop serves every tenant; a thread parsing a big body takes the GIL from it for
        # at most this long at a time (Python's default is 5 ms).
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        # Bound first: a taken metrics port is an OSError before anything else has started.
        metrics_socket = None if self.settings.metrics_port is None else _listen(self.settings.host,
                                                                                  self.settings.metrics_port)
        try:
            await self._start_serving()
        except BaseException:
            if metrics_socket is not None:
                metrics_socket.close()
            raise
        if metrics_socket is not None:
            await self._start_metrics(metrics_socket)

    async def _start_serving(self) -> None:
        self.keys.start()
        self.adapters.start()
        self.usage.start()
        self.quota.start()
        if self.alert_forwarder is not None:
            self.alert_forwarder.start()  # delivers what earlier runs left pending, then what arrives
        poller = HealthPoller(self.router.health, self.router.addresses)
        self._tasks.append(asyncio.create_task(poller.run(self.settings.health_poll_interval)))
        # The KV index of kv-aware deployments, from their workers' KV event streams.
        self._tasks.append(asyncio.create_task(self.kv_events.run(self.settings.health_poll_interval)))
        self._tasks.append(asyncio.create_task(self._prune_channels()))
        # access_log=False: the access logger sits below log_level anyway, but uvicorn would still
        # format the client address and path of every request before finding that out.
        config = uvicorn.Config(self.app, host=self.settings.host, port=self.settings.port, log_level="warning",
                                lifespan="off", timeout_graceful_shutdown=self.settings.drain_grace_seconds,
                                timeout_keep_alive=self.settings.keep_alive_seconds, access_log=False,
                                http=bounded_head_protocol(self.settings.max_header_bytes,
                                                           self.settings.header_timeout_seconds))
        self._http = uvicorn.Server(config)
        self._http.install_signal_handlers = lambda: None  # the caller owns Ctrl-C
        self._tasks.append(asyncio.create_task(self._http.serve()))
        if self.settings.grpc_port is not None:
            # A message is bounded as a REST body is (gRPC's own default is 4 MiB).
            limit = self.context.max_body_bytes
            self._grpc = grpc.aio.server(options=[("grpc.max_receive_message_length", limit)])
            inference_pb2_grpc.add_InferenceServicer_to_server(InferenceServicer(self.context), self._grpc)
            self._grpc.add_insecure_port(f"{self.settings.host}:{self.settings.grpc_port}")
            await self._grpc.start()
        while not self._http.started:
            if self._tasks[-1].done():
                self._tasks[-1].result()  # raises why the HTTP server could not start (port taken...)
            await asyncio.sleep(0.05)

    async def _start_metrics(self, sock: socket.socket) -> None:
        """Serves GET /metrics on its own socket, on this event loop (the platform collector reads
        state the loop owns, so a scrape never races it from another thread)."""
        host, port = sock.getsockname()[:2]
        config = uvicorn.Config(metrics_asgi_app(self.context.metrics.registry), host=host, port=port,
                                log_level="warning", lifespan="off", access_log=False, timeout_graceful_shutdown=5,
                                http=bounded_head_protocol(self.settings.max_header_bytes,
                                                           self.settings.header_timeout_seconds))
        self._metrics = uvicorn.Server(config)
        self._metrics.install_signal_handlers = lambda: None
        self._metrics_task = asyncio.create_task(self._metrics.serve(sockets=[sock]))
        while not self._metrics.started:
            if self._metrics_task.done():
                self._metrics_task.result()
            await asyncio.sleep(0.05)
        self.metrics_port = port

    async def _prune_channels(self) -> None:
        """Closes channels to workers that left every route (after the request timeout, see
        WorkerChannels); a failure is logged and the loop goes on."""
        grace = self.context.inference.request_timeout
        while True:
            await asyncio.sleep(max(self.settings.health_poll_interval, 1.0))
            try:
                closed = await self.channels.prune(self.router.addresses(), grace)
                if closed:
                    log.info("closed channels to departed workers: %s", ", ".join(sorted(closed)))
            except Exception:
                log.exception("pruning worker channels failed")

    async def stop(self) -> None:
        """Drain: stop accepting, let what is in flight finish (up to drain_grace_seconds), close."""
        if self._http is not None:
            self._http.should_exit = True
        if self._metrics is not None:
            self._metrics.should_exit = True
        if self._grpc is not None:
            await self._grpc.stop(grace=self.settings.drain_grace_seconds)
        for task in self._tasks:
            if task is not self._tasks[-1]:
                task.cancel()
        await asyncio.gather(*self._tasks, *([self._metrics_task] if self._metrics_task else []),
                             return_exceptions=True)
        await self.channels.close()
        if self.alert_forwarder is not None:
            await self.alert_forwarder.stop()
        for limiter in (self.limiter, self.sequences):
            close = getattr(limiter, "close", None)
            if close is not None:
                await close()
        self.quota.stop()
        self.usage.stop()
        self.keys.stop()
        self.adapters.stop()
        self.engine.dispose()


def _listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (0: a free port), as uvicorn would bind it."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock
