"""Worker and gateway processes for the gateway benchmark and end-to-end tests.

The gateway runs in its own process (``python -m inferplane.bench.gateway_harness serve ...``) so
that a load generator, the gateway and the worker each have their own event loop and interpreter
lock: measured in one process, the client's work would be billed to the gateway. The serving
process creates a tenant and an API key in a throwaway SQLite database, routes one served model
to the given worker addresses (one deployment, so a dead replica's requests move to a sibling),
publishes the model with the tokenizer the first worker reports, and prints one JSON line with the
key and ports. SIGTERM or SIGINT stops it cleanly.

For LoRA adapters (`inferplane bench fairness`'s adapter cases) it can also register the served
model's weights in the registry (`--register-base`: the catalog then binds adapters to them, as
the cluster sync does), tenants' private adapters (`--adapter`, as `inferplane models
register-adapter --tenant` does), give a tenant an admin key (`--tenant-admin`) and the platform
a bootstrap admin key (`--bootstrap-admin`), and let the admin API register server paths under
`--model-root`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import typing
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from inferplane import aio
from inferplane.api.deployment import RoutingPolicy
from inferplane.local.supervisor import free_port

SERVED_MODEL = "tiny"
TENANT = "bench"




def start_worker(model: str, port: int, *extra: str, log_path: str | None = None) -> subprocess.Popen:
    """`inferplane worker` on 127.0.0.1:port with the CPU paged runtime; output goes to log_path."""
    cmd = [sys.executable, "-m", "inferplane.cli", "worker", "--model", model, "--runtime", "paged",
           "--device", "cpu", "--host", "127.0.0.1", "--port", str(port), "--metrics-port", "0", *extra]
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115 (the child owns it)
    try:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    finally:
        if log_path:
            out.close()


def stop_worker(worker: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGTERM (the worker drains), then SIGKILL if it has not exited within `timeout`."""
    worker.terminate()
    try:
        worker.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        worker.kill()
        worker.wait()


def wait_serving(address: str, proc: subprocess.Popen | None = None, timeout: float = 180.0) -> None:
    """Blocks until the worker's grpc.health.v1 check answers SERVING (the model is loaded)."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"worker {address} exited with {proc.returncode} before it was ready")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    raise TimeoutError(f"worker {address} was not SERVING within {timeout:.0f} s")


@dataclass
class GatewayProcess:
    proc: subprocess.Popen
    key: str
    port: int
    grpc_port: int
    keys: dict[str, str] = field(default_factory=dict)  # tenant -> its key (`--tenant`)
    admin_keys: dict[str, str] = field(default_factory=dict)  # tenant -> its admin key (`--tenant-admin`)
    admin_key: str = ""  # the platform's bootstrap admin key (`--bootstrap-admin`)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def start_gateway(workers: list[str], *, log_path: str | None = None, timeout: float = 120.0,
                  extra: tuple[str, ...] = ()) -> GatewayProcess:
    """Starts `serve` in a child process and waits for its JSON line (key and ports)."""
    port, grpc_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "inferplane.bench.gateway_harness", "serve", "--port", str(port),
           "--grpc-port", str(grpc_port), *extra]
    for address in workers:
        cmd += ["--worker", address]
    err = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    finally:
        if log_path:
            err.close()
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"gateway exited with {proc.wait()} before it was ready (log: {log_path})")
        if line.startswith("{"):
            ready = json.loads(line)
            return GatewayProcess(proc, ready["key"], ready["port"], ready["grpc_port"], ready.get("keys", {}),
                                  ready.get("admin_keys", {}), ready.get("admin_key", ""))
    proc.kill()
    raise TimeoutError("gateway not ready in time")


# -- the serving process ---------------------------------------------------------------------------

def _create_key(gateway, tenant: str = TENANT, priority: str | None = None,
                requests_per_minute: int | None = None) -> str:
    from inferplane.control_plane import auth, tenants

    with gateway.sessions.begin() as session:
        tenants.create_tenant(session, tenant, actor="bench", priority=priority)
        created = auth.create_key(session, tenant, actor="bench", scopes=auth.DEFAULT_SCOPES,
                                  requests_per_minute=requests_per_minute)
    return created.secret


def _create_admin_key(gateway, tenant: str) -> str:
    """A key of `tenant`'s with the admin scope: what its tenant admin calls the admin API with."""
    from inferplane.control_plane import auth

    with gateway.sessions.begin() as session:
        created = auth.create_key(session, tenant, actor="bench", scopes=(*auth.DEFAULT_SCOPES, auth.SCOPE_ADMIN))
    return created.secret


def _register_weights(gateway, args: argparse.Namespace) -> frozenset[str]:
    """`--register-base` and `--adapter`: the base in the registry (its digest is what adapters bind
    to) and each tenant's private adapter, checked against it as the CLI's register-adapter does."""
    from inferplane.control_plane import registry

    if not args.register_base:
        if args.adapter:
            raise SystemExit("--adapter needs --register-base")
        return frozenset()
    with gateway.sessions.begin() as session:
        base = registry.register_model(session, args.register_base, actor="bench", name=args.served_model_name)
        for spec in args.adapter:
            tenant, name, path = spec.split("=", 2)
            registry.register_adapter(session, path, actor="bench", base=base.ref, name=name,
                                      owner_tenant_id=tenant)
    return frozenset({base.sha256})


async def _serve(args: argparse.Namespace) -> int:
    from inferplane.control_plane.gateway.catalog import ServedModel
    from inferplane.control_plane.gateway.server import Gateway, GatewaySettings
    from inferplane.control_plane.routing import Deployment, StaticEndpointSource
    from inferplane.v1 import worker_pb2

    with tempfile.TemporaryDirectory(prefix="inferplane-gw-") as home:
        admin_key = secrets.token_urlsafe(32) if args.bootstrap_admin else None
        settings = GatewaySettings(db_url=f"sqlite:///{home}/gateway.db", port=args.port, grpc_port=args.grpc_port,
                                   health_poll_interval=args.health_poll_interval,
                                   drain_grace_seconds=args.drain_grace_seconds, max_migrations=args.max_migrations,
                                   model_roots=tuple(args.model_root), bootstrap_key=admin_key)
        gateway = Gateway(settings)
        key = _create_key(gateway)  # before start(): the key cache loads it on its first refresh
        keys = {}
        for spec in args.tenant:
            spec, _, rpm = spec.partition(",rpm=")
            name, _, band = spec.partition(":")
            keys[name] = _create_key(gateway, name, band or None, int(rpm) if rpm else None)
        admin_keys = {name: _create_admin_key(gateway, name) for name in args.tenant_admin}
        weights_sha256 = _register_weights(gateway, args)  # before start(): the adapter sync's first read
        await gateway.start()
        try:
            info = await gateway.channels.stub(args.worker[0]).Info(worker_pb2.InfoRequest(), timeout=30)
            prefill = None
            if args.prefill_worker:  # a disaggregated deployment: --worker is its decode pool
                prefill = Deployment(f"{args.served_model_name}-prefill", StaticEndpointSource(args.prefill_worker),
                                     block_size=info.block_size, max_outstanding=args.max_outstanding)
            deployment = Deployment(args.served_model_name, StaticEndpointSource(args.worker),
                                    block_size=info.block_size, max_outstanding=args.max_outstanding,
                                    routing_policy=args.routing_policy, prefill=prefill,
                                    min_prefill_tokens=args.min_prefill_tokens)
            gateway.router.set_route(args.served_model_name, [deployment])
            gateway.catalog.put(ServedModel.from_info(args.served_model_name, info, cache_isolation="shared",
                                                      weights_sha256=weights_sha256))
            print(json.dumps({"key": key, "keys": keys, "admin_keys": admin_keys, "admin_key": admin_key or "",
                              "port": args.port, "grpc_port": args.grpc_port}), flush=True)
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
            await stop.wait()
        finally:
            await gateway.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m inferplane.bench.gateway_harness")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run a gateway for the given workers; print {key, port, grpc_port}")
    serve.add_argument("--worker", action="append", required=True, help="host:port of a worker (repeatable)")
    serve.add_argument("--port", type=int, required=True)
    serve.add_argument("--grpc-port", type=int, required=True)
    serve.add_argument("--served-model-name", default=SERVED_MODEL)
    serve.add_argument("--max-outstanding", type=int, default=1024, help="per replica before it counts as full")
    serve.add_argument("--health-poll-interval", type=float, default=2.0)
    serve.add_argument("--drain-grace-seconds", type=float, default=30.0)
    serve.add_argument("--max-migrations", type=int, default=2, help="as `inferplane gateway --max-migrations`")
    serve.add_argument("--prefill-worker", action="append", default=[],
                       help="host:port of a prefill-pool worker (repeatable): the --worker replicas are then the "
                            "decode pool of a disaggregated deployment")
    serve.add_argument("--min-prefill-tokens", type=int, default=512,
                       help="with --prefill-worker: uncached prompt tokens from which the prefill pool computes them")
    serve.add_argument("--routing-policy", default="prefix-hash", choices=typing.get_args(RoutingPolicy))
    serve.add_argument("--tenant", action="append", default=[],
                       help="NAME[:BAND][,rpm=N] another tenant with a key of its own (repeatable); BAND: "
                            "api/priority.py; N: the key's requests per minute")
    serve.add_argument("--tenant-admin", action="append", default=[], metavar="NAME",
                       help="also give this --tenant an admin key, its tenant admin's (repeatable)")
    serve.add_argument("--bootstrap-admin", action="store_true", help="a bootstrap (platform) admin key, printed")
    serve.add_argument("--model-root", action="append", default=[],
                       help="a folder the admin API registers server paths from (repeatable)")
    serve.add_argument("--register-base", default=None, metavar="PATH",
                       help="register the served model's weights (this folder) in the registry, for adapters")
    serve.add_argument("--adapter", action="append", default=[], metavar="TENANT=NAME=PATH",
                       help="a tenant's private LoRA adapter, registered for --register-base (repeatable)")
    args = parser.parse_args(argv)
    return aio.run(_serve(args))


if __name__ == "__main__":
    sys.exit(main())
