"""`inferplane gateway`: the control plane in a cluster.

Runs the gateway (REST + optional tenant gRPC) and keeps its routes and model catalog in step with
the cluster's InferenceDeployments (``gateway.kube_sync``) until SIGTERM or SIGINT. The Helm chart
starts it as ``inferplane gateway --host=0.0.0.0 --port=8000 --metrics-port=9090`` with ``$INFERPLANE_DATABASE_URL``
and ``$INFERPLANE_NAMESPACE`` set, so every option also reads an environment variable: secrets come
from mounted files or env, never from the command line (visible in ``ps``).

configure() stays import-light (argparse only): the top-level CLI calls it to build --help.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inferplane.control_plane.db_url import ENV_DATABASE_URL, ENV_DB_URL

SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
# The metrics listener's port: a worker's too (9090), as the pods are apart. Its series name tenants,
# keys and private adapters, so they are served here for Prometheus, never on the API port.
DEFAULT_METRICS_PORT = 9090


class UsageError(Exception):
    """A bad option or unreadable secret file: reported as one line and exit status 2."""


def configure(parser: argparse.ArgumentParser) -> None:
    """Numeric defaults stay strings: argparse converts them only when `gateway` runs, so a malformed
    variable is reported there instead of breaking `inferplane --help` for every subcommand."""
    env = os.environ.get
    parser.add_argument("--host", default=env("INFERPLANE_HOST", "127.0.0.1"),
                        help="REST listen address (default: $INFERPLANE_HOST, else %(default)s)")
    parser.add_argument("--port", type=int, default=env("INFERPLANE_PORT", "8000"),
                        help="REST port (default: $INFERPLANE_PORT, else %(default)s)")
    parser.add_argument("--grpc-port", type=int, default=env("INFERPLANE_GRPC_PORT", "0"),
                        help="tenant gRPC API port; 0 disables it (default: $INFERPLANE_GRPC_PORT, else 0)")
    parser.add_argument("--metrics-port", type=int, default=env("INFERPLANE_METRICS_PORT", str(DEFAULT_METRICS_PORT)),
                        help="Prometheus GET /metrics on --host, apart from the API port (its series name tenants, "
                             "API key ids and adapters: let only Prometheus reach it); 0 disables it "
                             "(default: $INFERPLANE_METRICS_PORT, else %(default)s)")
    parser.add_argument("--db-url", default=None,
                        help=f"database URL (default: ${ENV_DATABASE_URL}, else ${ENV_DB_URL}, "
                             "else sqlite:///<home>/inferplane.db)")
    parser.add_argument("--home", default=env("INFERPLANE_HOME", str(Path.home() / ".inferplane")),
                        help="state folder for the SQLite fallback (default: $INFERPLANE_HOME, else ~/.inferplane)")
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("--namespace", "-n", action="append", default=[], metavar="NS",
                       help="read InferenceDeployments in this namespace (repeatable; default: "
                            "$INFERPLANE_NAMESPACE (comma-separated), else the pod's namespace, else 'default')")
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="read InferenceDeployments cluster-wide")
    parser.add_argument("--kubeconfig", default=None,
                        help="kubeconfig to use outside a cluster (default: in-cluster, else $KUBECONFIG, "
                             "else ~/.kube/config)")
    parser.add_argument("--context", default=None, help="kubeconfig context (default: its current context)")
    parser.add_argument("--bootstrap-key-file", default=env("INFERPLANE_BOOTSTRAP_KEY_FILE"),
                        help="file holding the bootstrap admin key (default: $INFERPLANE_BOOTSTRAP_KEY_FILE; "
                             "$INFERPLANE_BOOTSTRAP_KEY gives the key itself)")
    jwt = parser.add_argument_group("admin JWTs (off unless an algorithm and a key are given)")
    jwt.add_argument("--jwt-algorithm", default=env("INFERPLANE_JWT_ALGORITHM"), choices=["HS256", "RS256"],
                     help="default: $INFERPLANE_JWT_ALGORITHM")
    jwt.add_argument("--jwt-key-file", default=env("INFERPLANE_JWT_KEY_FILE"),
                     help="the HS256 secret or the RS256 public key (PEM) (default: $INFERPLANE_JWT_KEY_FILE; "
                          "$INFERPLANE_JWT_KEY gives the key itself)")
    jwt.add_argument("--jwt-audience", default=env("INFERPLANE_JWT_AUDIENCE", "inferplane-admin"),
                     help="required 'aud' claim (default: $INFERPLANE_JWT_AUDIENCE, else %(default)s)")
    jwt.add_argument("--jwt-issuer", default=env("INFERPLANE_JWT_ISSUER"),
                     help="required 'iss' claim, e.g. your identity provider's URL (default: $INFERPLANE_JWT_ISSUER; "
                          "unset: not checked)")
    parser.add_argument("--salt-secret-file", default=env("INFERPLANE_SALT_SECRET_FILE"),
                        help="secret keying tenants' prefix-cache salts and signing console sessions; every gateway "
                             "replica needs the same one "
                             "(hex, or any text) (default: $INFERPLANE_SALT_SECRET_FILE; $INFERPLANE_SALT_SECRET "
                             "gives it directly; unset: random per process)")
    parser.add_argument("--resync-interval", type=float, default=env("INFERPLANE_RESYNC_INTERVAL", "5"),
                        help="seconds between listings of InferenceDeployments (default: %(default)s)")
    parser.add_argument("--endpoint-interval", type=float, default=env("INFERPLANE_ENDPOINT_INTERVAL", "2"),
                        help="seconds between listings of each deployment's EndpointSlices (default: %(default)s)")
    parser.add_argument("--max-migrations", type=int, default=env("INFERPLANE_MAX_MIGRATIONS", "2"),
                        help="a stream whose worker fails mid-answer moves to another replica, continuing after "
                             "what was delivered, at most this many times (0: it ends with an error event)")
    parser.add_argument("--drain-grace-seconds", type=float, default=env("INFERPLANE_DRAIN_GRACE_SECONDS", "30"),
                        help="on SIGTERM, how long requests and streams in flight may take to finish "
                             "(default: %(default)s)")
    parser.add_argument("--keep-alive-seconds", type=float, default=env("INFERPLANE_KEEP_ALIVE_SECONDS"),
                        help="how long an idle HTTP connection stays open (default: longer than the 5 s "
                             "httpx and openai clients keep theirs and a load balancer's 60 s)")
    parser.add_argument("--model-root", action="append", metavar="DIR",
                        default=[r for r in (env("INFERPLANE_MODEL_ROOTS") or "").split(os.pathsep) if r],
                        help="a folder a platform admin may register weights from over the admin API (repeatable; "
                             "default: $INFERPLANE_MODEL_ROOTS, separated by ':'; none: aliases only)")
    parser.add_argument("--outbound-allow", action="append", metavar="CIDR|HOST",
                        default=[e for e in re.split(r"[,\s]+", env("INFERPLANE_OUTBOUND_ALLOW") or "") if e],
                        help="an internal destination tenants' alert webhooks and admins' http(s) model sources may "
                             "reach: a CIDR or address (10.20.0.0/16, 127.0.0.1) or a host name (hooks.corp.example, "
                             "*.corp.example); repeatable. Without any, they reach public addresses only: loopback, "
                             "private, link-local (cloud metadata) and other internal addresses are refused "
                             "(default: $INFERPLANE_OUTBOUND_ALLOW, comma-separated)")
    limits = parser.add_argument_group("rate limits across gateway replicas (off: each replica limits alone)")
    limits.add_argument("--rate-limit-redis-url", default=env("INFERPLANE_RATE_LIMIT_REDIS_URL"),
                        help="redis://[:password@]host:6379/0 holding the keys' token buckets, shared by every "
                             "replica (default: $INFERPLANE_RATE_LIMIT_REDIS_URL; unset: in-process buckets)")
    limits.add_argument("--rate-limit-unreachable", choices=["open", "closed"],
                        default=env("INFERPLANE_RATE_LIMIT_UNREACHABLE", "open"),
                        help="when Redis cannot be reached: open = limit per replica meanwhile, closed = answer "
                             "503 (default: %(default)s)")
    alerts = parser.add_argument_group("alert routing (Alertmanager's webhook at /alerts/v1/webhook; off without "
                                       "a secret)")
    alerts.add_argument("--alert-webhook-secret-file", default=env("INFERPLANE_ALERT_WEBHOOK_SECRET_FILE"),
                        help="file holding the secret Alertmanager sends as 'Authorization: Bearer <secret>' "
                             "(default: $INFERPLANE_ALERT_WEBHOOK_SECRET_FILE; $INFERPLANE_ALERT_WEBHOOK_SECRET "
                             "gives it directly)")
    alerts.add_argument("--alert-retry-base-seconds", type=float,
                        default=env("INFERPLANE_ALERT_RETRY_BASE_SECONDS", "1"),
                        help="delay before the first retry of a failed delivery to a tenant's webhook, doubled "
                             "at each further retry (default: %(default)s)")
    alerts.add_argument("--alert-max-attempts", type=int, default=env("INFERPLANE_ALERT_MAX_ATTEMPTS", "8"),
                        help="attempts per delivery before it is marked failed (default: %(default)s)")
    autoscale = parser.add_argument_group("autoscaling (InferenceDeployments with autoscaling.enabled)")
    autoscale.add_argument("--no-autoscale", dest="autoscale", action="store_false",
                           help="leave replicas alone even where a spec enables autoscaling")
    autoscale.add_argument("--lease-namespace", default=env("INFERPLANE_LEASE_NAMESPACE"),
                           help="where the Lease that picks the one deciding replica lives (default: "
                                "$INFERPLANE_LEASE_NAMESPACE, else the pod's namespace, else 'default')")
    parser.add_argument("--verbose", "-v", action="store_true")


# ---- options -> settings (pure but for reading the files named) -----------------------------------


def _read_secret(path: str | None, env_name: str, what: str) -> str | None:
    """The secret in ``path`` (stripped), else ``$env_name``, else None."""
    if path:
        try:
            value = Path(path).read_text().strip()
        except OSError as exc:
            raise UsageError(f"cannot read the {what} file {path}: {exc.strerror or exc}") from exc
        if not value:
            raise UsageError(f"the {what} file {path} is empty")
        return value
    return os.environ.get(env_name) or None


def _salt(text: str | None) -> bytes:
    """Hex (what `inferplane up` writes) decodes to bytes; anything else is used as UTF-8 text."""
    if not text:
        return b""
    try:
        return bytes.fromhex(text)
    except ValueError:
        return text.encode()


def db_url(args: argparse.Namespace) -> str:
    if args.db_url:
        return args.db_url
    for name in (ENV_DATABASE_URL, ENV_DB_URL):
        if os.environ.get(name):
            return os.environ[name]
    return f"sqlite:///{Path(args.home).expanduser() / 'inferplane.db'}"


def namespaces(args: argparse.Namespace, service_account_file: str = SERVICE_ACCOUNT_NAMESPACE) -> list[str] | None:
    """None means every namespace. Flags win, then $INFERPLANE_NAMESPACE, then the pod's own namespace."""
    if args.all_namespaces:
        return None
    if args.namespace:
        return [ns for value in args.namespace for ns in value.split(",") if ns]
    from_env = [ns for ns in os.environ.get("INFERPLANE_NAMESPACE", "").split(",") if ns]
    if from_env:
        return from_env
    try:
        own = Path(service_account_file).read_text().strip()
    except OSError:
        own = ""
    return [own or "default"]


def _own_namespace(service_account_file: str = SERVICE_ACCOUNT_NAMESPACE) -> str:
    try:
        return Path(service_account_file).read_text().strip() or "default"
    except OSError:
        return "default"


def gateway_settings(args: argparse.Namespace) -> Any:
    """GatewaySettings from the options; raises UsageError naming what is wrong."""
    from inferplane.control_plane.gateway.server import GatewaySettings

    jwt_key = _read_secret(args.jwt_key_file, "INFERPLANE_JWT_KEY", "JWT key")
    if bool(args.jwt_algorithm) != bool(jwt_key):
        raise UsageError("JWTs need both --jwt-algorithm and a key (--jwt-key-file or $INFERPLANE_JWT_KEY)")
    if jwt_key:
        from inferplane.control_plane.errors import InvalidInput
        from inferplane.control_plane.tokens import JWTSettings

        try:  # checked here so that a weak or wrong key is a usage error, not a start-up traceback
            JWTSettings(algorithm=args.jwt_algorithm, key=jwt_key, audience=args.jwt_audience,
                        issuer=args.jwt_issuer)
        except InvalidInput as exc:
            raise UsageError(f"JWT key: {exc}") from exc
    if not 0 < args.port < 65536 or not 0 <= args.grpc_port < 65536:
        raise UsageError("--port must be 1..65535 and --grpc-port 0..65535")
    if not 0 <= args.metrics_port < 65536 or args.metrics_port and args.metrics_port in (args.port, args.grpc_port):
        raise UsageError("--metrics-port must be 0..65535 (0: off) and differ from --port and --grpc-port")
    if args.resync_interval <= 0 or args.endpoint_interval <= 0:
        raise UsageError("--resync-interval and --endpoint-interval must be positive")
    if args.drain_grace_seconds < 0:
        raise UsageError("--drain-grace-seconds must not be negative")
    if args.max_migrations < 0:
        raise UsageError("--max-migrations must not be negative")
    if args.keep_alive_seconds is not None and not 0 < args.keep_alive_seconds < math.inf:
        raise UsageError("--keep-alive-seconds must be a positive number of seconds")
    keep_alive = {} if args.keep_alive_seconds is None else {"keep_alive_seconds": args.keep_alive_seconds}
    if args.alert_retry_base_seconds <= 0 or args.alert_max_attempts < 1:
        raise UsageError("--alert-retry-base-seconds must be positive and --alert-max-attempts at least 1")
    from inferplane.control_plane.outbound import OutboundPolicy

    try:
        OutboundPolicy.parse(args.outbound_allow)
    except ValueError as exc:
        raise UsageError(f"--outbound-allow: {exc}") from exc
    return GatewaySettings(
        db_url=db_url(args), host=args.host, port=args.port, grpc_port=args.grpc_port or None,
        metrics_port=args.metrics_port or None,
        bootstrap_key=_read_secret(args.bootstrap_key_file, "INFERPLANE_BOOTSTRAP_KEY", "bootstrap key"),
        jwt_algorithm=args.jwt_algorithm, jwt_key=jwt_key, jwt_audience=args.jwt_audience,
        jwt_issuer=args.jwt_issuer or None,
        salt_secret=_salt(_read_secret(args.salt_secret_file, "INFERPLANE_SALT_SECRET", "salt secret")),
        drain_grace_seconds=args.drain_grace_seconds, max_migrations=args.max_migrations, **keep_alive,
        model_roots=tuple(args.model_root),
        rate_limit_redis_url=args.rate_limit_redis_url or None, rate_limit_unreachable=args.rate_limit_unreachable,
        alert_webhook_secret=_read_secret(args.alert_webhook_secret_file, "INFERPLANE_ALERT_WEBHOOK_SECRET",
                                          "alert webhook secret"),
        alert_retry_base_delay=args.alert_retry_base_seconds, alert_max_attempts=args.alert_max_attempts,
        outbound_allow=tuple(args.outbound_allow))


# ---- running ---------------------------------------------------------------------------------------


@dataclass
class _Plan:
    settings: Any
    namespaces: list[str] | None
    api_client: Any


def _port_problem(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on, checked up front: uvicorn reports a taken port by
    exiting the whole process from inside its task (status 3), past every cleanup."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, address = infos[0]
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except OSError as exc:
        return f"cannot listen on {host}:{port}: {exc.strerror or exc}"
    return None


async def _serve(args: argparse.Namespace, plan: _Plan) -> int:
    import asyncio
    import signal

    from inferplane.control_plane.gateway.kube_sync import KubernetesCatalogSync
    from inferplane.control_plane.gateway.server import Gateway

    ports = [args.port, *(p for p in (plan.settings.grpc_port, plan.settings.metrics_port) if p)]
    problem = next(filter(None, (_port_problem(args.host, port) for port in ports)), None)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        plan.api_client.close()
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    from inferplane.control_plane.db import DatabaseUnusable

    try:
        gateway = Gateway(plan.settings)
    except DatabaseUnusable as exc:  # a damaged SQLite file: its own line names it and what to do
        print(f"error: cannot start the gateway: {exc}", file=sys.stderr)
        plan.api_client.close()
        return 1
    except Exception as exc:  # a bad URL, an unreachable database, a failed migration: one line, not a traceback
        print(f"error: cannot start the gateway (database {plan.settings.db_url.split('@')[-1]}): "
              f"{' '.join(str(exc).split())[:300]}", file=sys.stderr)
        plan.api_client.close()
        return 1
    autoscaler, elector, background = None, None, []
    if args.autoscale:
        from inferplane.control_plane.autoscale.autoscaler import Autoscaler, AutoscalerMetrics
        from inferplane.control_plane.autoscale.kube import KubernetesScaler, LeaseElector

        elector = LeaseElector(plan.api_client, args.lease_namespace or _own_namespace())
        autoscaler = Autoscaler(gateway.router, gateway.channels, gateway.activator,
                                KubernetesScaler(plan.api_client), is_leader=elector.is_leader,
                                metrics=AutoscalerMetrics(gateway.context.metrics.registry))
    sync = KubernetesCatalogSync.from_api_client(
        plan.api_client, gateway.router, gateway.catalog, gateway.channels, namespaces=plan.namespaces,
        resync_interval=args.resync_interval, endpoint_interval=args.endpoint_interval, autoscaler=autoscaler)
    gateway.context.deployment_conditions = lambda: sync.conditions  # the console's deployments page
    try:
        await gateway.start()
        sync.start()
        if autoscaler is not None and elector is not None:
            background = [asyncio.create_task(elector.run()), asyncio.create_task(autoscaler.run())]
        scope = "all namespaces" if plan.namespaces is None else "namespace(s) " + ", ".join(plan.namespaces)
        grpc_note = f" and gRPC :{plan.settings.grpc_port}" if plan.settings.grpc_port else ""
        grpc_note += f", metrics on :{gateway.metrics_port}/metrics" if gateway.metrics_port else ", metrics off"
        print(f"gateway listening on http://{args.host}:{args.port}{grpc_note}; routing InferenceDeployments "
              f"in {scope}", flush=True)
        await stop.wait()
        print("stopping ...", flush=True)
        return 0
    finally:
        for task in background:
            task.cancel()
        await sync.stop()
        await gateway.stop()
        plan.api_client.close()


def run(args: argparse.Namespace) -> int:
    import logging

    from inferplane import aio

    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from inferplane.control_plane.gateway.kube_sync import KubeConfigError, load_api_client

    try:
        settings = gateway_settings(args)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not settings.salt_secret:
        logging.getLogger("inferplane.gateway").warning(
            "no salt secret (--salt-secret-file / $INFERPLANE_SALT_SECRET): prefix affinity will differ between "
            "gateway replicas, and a console session signed in on one replica is refused by the others")
    try:
        api_client = load_api_client(args.kubeconfig, args.context)
    except KubeConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return aio.run(_serve(args, _Plan(settings, namespaces(args), api_client)))
