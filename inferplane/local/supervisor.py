"""Runs InferenceDeployments as local worker processes.

The command line comes from `operator.manifests.worker_invocation`, the same function the
operator puts into pod specs, so a worker starts the same way on a laptop and in a cluster; only
the actuator differs (processes here, Deployments there). Each replica gets its own ports; an
endpoint is published to the router only once its worker reports SERVING, and a crashed worker
is taken out of rotation and restarted with backoff.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from inferplane.api.deployment import InferenceDeploymentSpec, prefill_pool_name
from inferplane.api.model_resolution import ResolvedAdapter
from inferplane.api.resolve import ResolvedDeployment, prefill_spec, resolve
from inferplane.control_plane.routing import StaticEndpointSource
from inferplane.local import runstate
from inferplane.operator.manifests import worker_invocation

log = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Replica:
    index: int
    port: int
    metrics_port: int
    log_path: Path
    process: subprocess.Popen | None = None
    restarts: int = 0
    ready: bool = False
    stopping: bool = False

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@dataclass
class LocalDeployment:
    name: str
    spec: InferenceDeploymentSpec
    resolved: ResolvedDeployment
    model_arg: str
    adapters: tuple[ResolvedAdapter, ...] = ()  # spec.adapters as resolved: loaded before a replica serves
    source: StaticEndpointSource = field(default_factory=StaticEndpointSource)
    replicas: list[Replica] = field(default_factory=list)
    next_index: int = 0  # replicas keep their number (and log file) for life; a new one takes the next
    owner: str = ""  # the InferenceDeployment it serves (a prefill pool: its deployment's); "": `name`

    @property
    def served_model_name(self) -> str:
        return self.spec.served_model_name(self.owner or self.name)


class Supervisor:
    """Starts, watches, scales and stops the worker processes of local deployments."""

    def __init__(self, home: Path, on_ready: Callable[[LocalDeployment, Replica], None] | None = None,
                 restart_backoff: float = 2.0, healthy_reset: float = 60.0):
        self.home = home
        self.logs = home / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.deployments: dict[str, LocalDeployment] = {}
        self._on_ready = on_ready
        self._backoff = restart_backoff
        self._healthy_reset = healthy_reset  # serving this long forgives earlier crashes
        self._tasks: set[asyncio.Task] = set()
        self._stopping = False
        self._retired: list[LocalDeployment] = []  # rolled over or deleted: draining, waited for by stop

    def add(self, name: str, spec: InferenceDeploymentSpec, model_arg: str,
            adapters: tuple[ResolvedAdapter, ...] = (), *,
            succeeding: Mapping[str, LocalDeployment] | None = None) -> LocalDeployment:
        """Starts `name`'s replicas (and its prefill pool's). `succeeding`: the deployments (by name)
        these replace in a rollout: the new replicas join their endpoint sources, so the router
        sends to old and new alike until the old are retired, and take the next replica numbers."""
        succeeding = succeeding or {}

        def deployment_of(deployment_name: str, deployment_spec: InferenceDeploymentSpec,
                          owner: str = "") -> LocalDeployment:
            new = LocalDeployment(deployment_name, deployment_spec, resolve(deployment_spec), model_arg, adapters,
                                  owner=owner)
            if deployment_name in succeeding:
                new.source = succeeding[deployment_name].source
                new.next_index = succeeding[deployment_name].next_index
            self.deployments[deployment_name] = new
            self.scale(deployment_name, deployment_spec.replicas)
            return new

        deployment = deployment_of(name, spec)
        if spec.disaggregation.enabled:  # its prefill pool: processes of their own, as pods of their own
            deployment_of(prefill_pool_name(name), prefill_spec(spec), owner=name)
        return deployment

    def take(self, name: str) -> dict[str, LocalDeployment]:
        """Removes `name` and its prefill pool from the running set, still running: a rollout passes
        them to `add(succeeding=...)` and retires them once the new replicas serve."""
        return {n: self.deployments.pop(n) for n in (name, prefill_pool_name(name)) if n in self.deployments}

    def retire(self, deployments: Collection[LocalDeployment]) -> None:
        """Each replica leaves the router, then drains what it has in flight and exits; `stop` still
        waits for them."""
        for deployment in deployments:
            self._retired.append(deployment)
            for replica in deployment.replicas:
                self._retire(deployment, replica)

    def scale(self, name: str, replicas: int, *, load: Callable[[str], int] | None = None,
              first: Collection[str] = ()) -> None:
        """The local Scaler: start or stop processes until `replicas` run.

        Going down, the replicas retired first are those at the addresses in `first` (the ones the
        autoscaler already steered traffic away from), then those not serving yet, then the least
        loaded (`load(address)`: requests in flight there); each leaves the router before it is told
        to drain, so no new request reaches it and the ones it has finish.
        """
        deployment = self.deployments[name]
        while len(deployment.replicas) < replicas:
            index = deployment.next_index
            deployment.next_index += 1
            replica = Replica(index, free_port(), free_port(), self.logs / f"{name}-{index}.log")
            deployment.replicas.append(replica)
            self._spawn(deployment, replica)
        if len(deployment.replicas) > replicas:
            def cost(r: Replica) -> tuple[int, int, int, int]:
                return (0 if r.address in first else 1, 1 if r.ready else 0,
                        load(r.address) if load is not None and r.ready else 0, r.index)

            for replica in sorted(deployment.replicas, key=cost)[:len(deployment.replicas) - replicas]:
                deployment.replicas.remove(replica)
                self._retire(deployment, replica)

    def command(self, deployment: LocalDeployment, replica: Replica) -> tuple[list[str], dict[str, str]]:
        invocation = worker_invocation(deployment.owner or deployment.name, deployment.spec,
                                       resolved=deployment.resolved,
                                       host="127.0.0.1", port=replica.port, metrics_port=replica.metrics_port,
                                       model_argument=deployment.model_arg, adapters=deployment.adapters,
                                       # One folder per deployment, as a node's in a cluster (operator/kv_tier.py):
                                       # a replica started later (scale from zero, a restart) finds the
                                       # blocks its predecessors left there.
                                       kv_tier_dir=str(self.home / "kv" / deployment.name))
        args = list(invocation.args)
        # `inferplane worker` as this interpreter runs it, so the process uses the same environment.
        command = [sys.executable, "-m", "inferplane.cli", *invocation.command[1:], *args]
        # The home marks the process as this supervisor's (runstate.end_leftovers checks it).
        env = {**os.environ, **invocation.env, "PYTHONUNBUFFERED": "1", runstate.HOME_ENV: str(self.home),
               runstate.PARENT_ENV: str(os.getpid())}
        return command, env

    def _spawn(self, deployment: LocalDeployment, replica: Replica) -> None:
        command, env = self.command(deployment, replica)
        log_file = open(replica.log_path, "ab")  # noqa: SIM115 (owned by the child for its lifetime)
        # Own session (a Ctrl-C reaches the supervisor, which drains them in order), but tied to the
        # supervisor's life: SIGTERM when it dies, however it dies (the child asks for that itself,
        # runstate.die_with_parent).
        replica.process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                           start_new_session=True)
        log_file.close()
        replica.ready = False
        self._track(asyncio.get_running_loop().create_task(self._watch(deployment, replica)))

    def _track(self, task: asyncio.Task) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _watch(self, deployment: LocalDeployment, replica: Replica) -> None:
        """Publishes the replica once SERVING; on an unexpected exit unpublishes and restarts it."""
        process = replica.process
        served_since: float | None = None
        channel = grpc.aio.insecure_channel(replica.address)
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            while process.poll() is None and not replica.stopping:
                if not replica.ready:
                    try:
                        reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                        if reply.status == health_pb2.HealthCheckResponse.SERVING:
                            replica.ready = True
                            served_since = time.monotonic()
                            deployment.source.add(replica.address)
                            log.info("%s replica %d ready at %s", deployment.name, replica.index, replica.address)
                            if self._on_ready is not None:
                                self._on_ready(deployment, replica)
                    except grpc.aio.AioRpcError:
                        pass
                await asyncio.sleep(0.25)
        finally:
            await channel.close()
        deployment.source.remove(replica.address)
        replica.ready = False
        if replica.stopping or self._stopping:
            return
        tail = _tail(replica.log_path)
        log.warning("%s replica %d exited with %s; restarting. Last log line: %s",
                    deployment.name, replica.index, process.returncode, tail)
        served_for = None if served_since is None else time.monotonic() - served_since
        await asyncio.sleep(self.restart_delay(replica, served_for))
        if not (replica.stopping or self._stopping) and replica in deployment.replicas:
            self._spawn(deployment, replica)

    def restart_delay(self, replica: Replica, served_for: float | None) -> float:
        """Counts the crash and says how long to wait before the restart: doubling from the base up
        to a minute while the replica keeps crashing, and back to the base once it had served for
        `healthy_reset` seconds (a crash a day must not cost a minute's wait forever after)."""
        if served_for is not None and served_for >= self._healthy_reset:
            replica.restarts = 0
        replica.restarts += 1
        return min(60.0, self._backoff * 2 ** min(replica.restarts - 1, 5))

    def _retire(self, deployment: LocalDeployment, replica: Replica) -> None:
        replica.stopping = True
        deployment.source.remove(replica.address)
        if replica.process is not None and replica.process.poll() is None:
            replica.process.send_signal(signal.SIGTERM)  # the worker drains in-flight requests, then exits
            # Reaped once it has (no zombie left behind), killed if it outlives its drain grace as a
            # pod outlives terminationGracePeriodSeconds.
            grace = deployment.spec.drain_grace_seconds + 10.0
            self._track(asyncio.get_running_loop().create_task(self._reap(replica.process, grace)))

    @staticmethod
    async def _reap(process: subprocess.Popen, grace: float) -> None:
        deadline = time.monotonic() + grace
        while process.poll() is None:
            if time.monotonic() > deadline:
                process.kill()
                process.wait()
                return
            await asyncio.sleep(0.25)

    async def stop(self, timeout: float = 30.0) -> None:
        self._stopping = True
        for deployment in self.deployments.values():
            for replica in deployment.replicas:
                self._retire(deployment, replica)
        deadline = time.monotonic() + timeout
        for deployment in [*self.deployments.values(), *self._retired]:
            for replica in deployment.replicas:
                process = replica.process
                while process is not None and process.poll() is None and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                if process is not None and process.poll() is None:
                    process.kill()
                    process.wait()
        for task in list(self._tasks):
            task.cancel()

    def failed_to_start(self) -> list[str]:
        """Replicas that exited before ever serving, with the reason from their log."""
        problems = []
        for deployment in self.deployments.values():
            for replica in deployment.replicas:
                if replica.process is not None and replica.process.poll() not in (None, 0) and not replica.ready:
                    problems.append(f"{deployment.name}[{replica.index}]: {_tail(replica.log_path)}")
        return problems


def _tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    errors = [line for line in lines if line.startswith("error: ")]
    return (errors or lines or [""])[-1]


class SupervisorScaler:
    """The autoscaler's `Scaler` for `inferplane up`: replica counts are worker processes."""

    def __init__(self, supervisor: Supervisor, load: Callable[[str], int]):
        self.supervisor = supervisor
        self.load = load

    async def current(self, name: str) -> int:
        return len(self.supervisor.deployments[name].replicas)

    async def scale(self, name: str, replicas: int, decision, victims=()) -> None:
        """Going down, the `victims` the autoscaler chose (and the router no longer sends to) go first."""
        self.supervisor.scale(name, replicas, load=self.load, first={ep.address for ep in victims})
