"""The control plane's autoscaling loop: read each deployment's signals, decide, scale, report.

Every `interval` seconds, for each watched deployment: ask each replica's worker for its Stats
(running, waiting, slots, KV blocks), add this gateway's in-flight counts and the requests the
activator holds, fold them into one saturation sample (signals.py), run the pure decision
(decision.py) over the sample history, and hand a changed count to the `Scaler` (the local
supervisor, or the InferenceDeployment's scale subresource on Kubernetes). Only the leader decides
(`is_leader`: a Kubernetes Lease in a cluster, always true locally); the others keep sampling so that
a new leader starts with a history. Each decision is visible: `last` (for status), metrics, and
whatever the Scaler records (an Event and `status.autoscaler` on Kubernetes).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import grpc
from prometheus_client import CollectorRegistry, Gauge

from inferplane.api import metric_names as m
from inferplane.control_plane.autoscale.activator import Activator
from inferplane.control_plane.autoscale.decision import Decision, Policy, Sample, State, decide
from inferplane.control_plane.autoscale.signals import ReplicaSignals, Targets, saturation
from inferplane.control_plane.routing import Endpoint, Router
from inferplane.control_plane.routing.worker_channels import WorkerChannels
from inferplane.v1 import worker_pb2

log = logging.getLogger(__name__)


@dataclass
class ScaleTarget:
    """One autoscaled deployment: its name for the Scaler, the served model it sits behind."""

    name: str
    served_model: str
    deployment: str  # the router's Deployment name within the served model
    policy: Policy
    targets: Targets
    slots: int  # the workers' maxNumSeqs (resolved), for a replica whose Stats do not answer
    # Whether the served model's requests held at zero replicas (the activator's) are this target's
    # load: a deployment's, not a prefill pool's (its requests are computed by the decode pool meanwhile).
    counts_held: bool = True
    samples: deque[Sample] = field(default_factory=lambda: deque(maxlen=4096))
    state: State = field(default_factory=State)
    last: Decision | None = None


class Scaler(Protocol):
    """Where replica counts are read and written (the local supervisor, or Kubernetes)."""

    async def current(self, name: str) -> int: ...

    async def scale(self, name: str, replicas: int, decision: Decision, victims: Sequence[Endpoint] = ()) -> None:
        """Set `replicas`; going down, `victims` are the replicas to remove first (least loaded)."""


class AutoscalerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        kw = {"registry": registry} if registry is not None else {}
        self.desired = Gauge(m.AUTOSCALER_DESIRED, "Replicas the autoscaler wants", ["deployment"], **kw)
        self.current = Gauge(m.AUTOSCALER_CURRENT, "Replicas set when it decided", ["deployment"], **kw)
        self.maximum = Gauge(m.AUTOSCALER_MAX, "The policy's maxReplicas (pinned there: the alert)",
                             ["deployment"], **kw)
        self.saturation = Gauge(m.AUTOSCALER_SATURATION,
                                "Load in replicas' worth, averaged over the stable window", ["deployment"], **kw)
        self.panic = Gauge(m.AUTOSCALER_PANIC, "1 while the panic window rules", ["deployment"], **kw)


class Autoscaler:
    def __init__(self, router: Router, channels: WorkerChannels, activator: Activator, scaler: Scaler, *,
                 interval: float = 1.0, clock: Callable[[], float] = time.monotonic,
                 is_leader: Callable[[], bool] = lambda: True, metrics: AutoscalerMetrics | None = None,
                 stats_timeout: float = 1.0) -> None:
        self.router = router
        self.channels = channels
        self.activator = activator
        self.scaler = scaler
        self.interval = interval
        self.clock = clock
        self.is_leader = is_leader
        self.metrics = metrics or AutoscalerMetrics(CollectorRegistry())
        self.stats_timeout = stats_timeout
        self.targets: dict[str, ScaleTarget] = {}

    def watch(self, target: ScaleTarget) -> None:
        previous = self.targets.get(target.name)
        if previous is not None:  # a spec change keeps the history
            target.samples, target.state, target.last = previous.samples, previous.state, previous.last
        self.targets[target.name] = target

    def unwatch(self, name: str) -> None:
        self.targets.pop(name, None)

    async def _replica(self, address: str, slots_hint: int) -> ReplicaSignals:
        in_flight = self.router.load.outstanding(address)
        try:
            stats = await self.channels.stub(address).Stats(worker_pb2.StatsRequest(), timeout=self.stats_timeout)
        except (TimeoutError, grpc.aio.AioRpcError):
            return ReplicaSignals(max_num_seqs=slots_hint, gateway_in_flight=in_flight)
        v = stats.values
        return ReplicaSignals(running=int(v.get("num_running", 0)), waiting=int(v.get("num_waiting", 0)),
                              max_num_seqs=int(v.get("max_num_seqs", slots_hint)),
                              blocks_used=int(v.get("blocks_used", 0)), blocks_cached=int(v.get("blocks_cached", 0)),
                              blocks_total=int(v.get("blocks_total", 0)), gateway_in_flight=in_flight)

    def _endpoints(self, target: ScaleTarget) -> list[Endpoint]:
        try:
            deployments = self.router.deployments(target.served_model)
        except Exception:
            return []
        # A disaggregated deployment's prefill pool is a target of its own.
        pools = [pool for d in deployments for pool in (d, d.prefill) if pool is not None]
        return [ep for d in pools if d.name == target.deployment for ep in d.source.endpoints()]

    def _addresses(self, target: ScaleTarget) -> list[str]:
        return [ep.address for ep in self._endpoints(target)]

    def _victims(self, target: ScaleTarget, count: int) -> list[Endpoint]:
        """The `count` least loaded replicas; the router stops sending them new requests now (their
        health checks restore them if the scale-down does not happen)."""
        ranked = sorted(self._endpoints(target), key=lambda ep: self.router.load.outstanding(ep.address))[:count]
        for ep in ranked:
            self.router.health.mark_unhealthy(ep.address)
        return ranked

    async def sample(self, target: ScaleTarget) -> tuple[Sample, int]:
        """The saturation now, and how many replicas serve (are in the router)."""
        addresses = self._addresses(target)
        replicas = await asyncio.gather(*(self._replica(a, target.slots) for a in addresses))
        held = self.activator.held(target.served_model) if target.counts_held else 0
        return Sample(self.clock(), saturation(replicas, target.targets, held=held)), len(addresses)

    async def tick(self) -> dict[str, Decision]:
        decisions: dict[str, Decision] = {}
        for target in list(self.targets.values()):
            sample, serving = await self.sample(target)
            target.samples.append(sample)
            horizon = self.clock() - max(target.policy.stable_window, 1.0)
            while target.samples and target.samples[0].at < horizon:
                target.samples.popleft()
            if not self.is_leader():
                continue
            try:
                current = await self.scaler.current(target.name)
            except Exception as exc:  # e.g. the resource is gone; the next tick tries again
                log.warning("autoscaler: reading %s's replicas failed: %s", target.name, exc)
                continue
            decision = decide(list(target.samples), self.clock(), current, target.policy, target.state)
            if serving < current and decision.desired < current:
                # Replicas are still starting: their idleness proves nothing yet, and going down
                # would kill a start in progress. The idle period counts from when all serve.
                decision = replace(decision, desired=current, reason=f"{serving}/{current} replicas still starting",
                                   state=replace(decision.state, last_active=self.clock()))
            target.state, target.last = decision.state, decision
            self._observe(target, current, decision)
            if decision.desired != current:
                log.info("autoscaler: %s %d -> %d (%s)", target.name, current, decision.desired, decision.reason)
                victims = self._victims(target, current - decision.desired) if decision.desired < current else []
                try:
                    await self.scaler.scale(target.name, decision.desired, decision, victims)
                except Exception:
                    log.exception("autoscaler: scaling %s to %d failed", target.name, decision.desired)
            decisions[target.name] = decision
        return decisions

    def _observe(self, target: ScaleTarget, current: int, decision: Decision) -> None:
        name = target.name
        self.metrics.desired.labels(name).set(decision.desired)
        self.metrics.current.labels(name).set(current)
        self.metrics.maximum.labels(name).set(target.policy.max_replicas)
        self.metrics.saturation.labels(name).set(decision.stable_load)
        self.metrics.panic.labels(name).set(1 if decision.panic else 0)

    async def run(self) -> None:
        while True:
            started = self.clock()
            try:
                await self.tick()
            except Exception:
                log.exception("autoscaler tick failed")
            await asyncio.sleep(max(0.05, self.interval - (self.clock() - started)))
