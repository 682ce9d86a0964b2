"""The autoscaler on Kubernetes: a Scaler on the InferenceDeployment's scale subresource, and a Lease
so that only one control-plane replica decides at a time.

`KubernetesScaler.scale` patches `/scale` (the operator carries spec.replicas to the worker
Deployment), then records the decision where users look: `status.autoscaler` (desired, current,
saturation, panic, last scale time, reason) and an Event on the InferenceDeployment. Deployment
names are "namespace/name", as the gateway's cluster sync names them.

`LeaseElector` holds a coordination.k8s.io Lease with the usual optimistic concurrency (replace with
the read resourceVersion; a 409 means another replica won): the holder renews every third of the
lease duration and counts itself leader until two thirds have passed since its last renewal, so a
holder that cannot renew steps down before another can take over.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import socket
import time
from collections.abc import Sequence
from typing import Any

from inferplane.api.deployment import API_VERSION, GROUP, KIND, PLURAL, VERSION
from inferplane.api.deployment_status import AutoscalerStatus
from inferplane.control_plane.autoscale.decision import Decision
from inferplane.control_plane.routing import Endpoint

log = logging.getLogger(__name__)
COMPONENT = "inferplane-autoscaler"
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


# A disaggregated deployment's prefill pool is scaled as "namespace/name/prefill": its replicas are
# spec.disaggregation.prefill.replicas (the scale subresource maps spec.replicas, the decode pool's).
PREFILL_TARGET = "prefill"


def prefill_target(name: str) -> str:
    """The scaler name of deployment `name`'s ("namespace/name") prefill pool."""
    return f"{name}/{PREFILL_TARGET}"


def _split(name: str) -> tuple[str, str]:
    namespace, _, resource = name.partition("/")
    return namespace, resource.removesuffix(f"/{PREFILL_TARGET}")


def _is_prefill(name: str) -> bool:
    return name.count("/") == 2 and name.endswith(f"/{PREFILL_TARGET}")


class KubernetesScaler:
    def __init__(self, api_client: Any) -> None:
        from kubernetes import client

        self.custom = client.CustomObjectsApi(api_client)
        self.core = client.CoreV1Api(api_client)

    async def current(self, name: str) -> int:
        namespace, resource = _split(name)
        if _is_prefill(name):
            body = await asyncio.to_thread(self.custom.get_namespaced_custom_object, GROUP, VERSION, namespace, PLURAL,
                                           resource)
            pool = ((body.get("spec") or {}).get("disaggregation") or {}).get("prefill") or {}
            return int(pool.get("replicas", 1))
        scale = await asyncio.to_thread(self.custom.get_namespaced_custom_object_scale, GROUP, VERSION, namespace,
                                        PLURAL, resource)
        return int((scale.get("spec") or {}).get("replicas") or 0)

    async def scale(self, name: str, replicas: int, decision: Decision, victims: Sequence[Endpoint] = ()) -> None:
        namespace, resource = _split(name)
        previous = await self.current(name)
        for pod in [ep.name for ep in victims if ep.name]:
            # The ReplicaSet removes the pods of lowest deletion cost first: the least loaded ones.
            try:
                await asyncio.to_thread(self.core.patch_namespaced_pod, pod, namespace, {"metadata": {"annotations": {
                    DELETION_COST: str(-1000)}}})
            except Exception as exc:  # gone already, or no permission: the scale-down still happens
                log.warning("autoscaler: marking pod %s/%s for removal failed: %s", namespace, pod, exc)
        if _is_prefill(name):  # the prefill pool: its own field; status.autoscaler is the decode pool's
            body = await asyncio.to_thread(self.custom.patch_namespaced_custom_object, GROUP, VERSION, namespace,
                                           PLURAL, resource,
                                           {"spec": {"disaggregation": {"prefill": {"replicas": replicas}}}})
            await asyncio.to_thread(self._event, namespace, resource, body["metadata"]["uid"], previous, replicas,
                                    decision, _now().replace(microsecond=0), pool=PREFILL_TARGET)
            return
        await asyncio.to_thread(self.custom.patch_namespaced_custom_object_scale, GROUP, VERSION, namespace, PLURAL,
                                resource, {"spec": {"replicas": replicas}})
        now = _now().replace(microsecond=0)
        status = AutoscalerStatus(desired_replicas=replicas, current_replicas=previous,
                                  saturation=round(decision.stable_load, 3), panic=decision.panic,
                                  last_scale_time=now, reason=decision.reason[:1024])
        body = await asyncio.to_thread(self.custom.patch_namespaced_custom_object_status, GROUP, VERSION, namespace,
                                       PLURAL, resource, {"status": {"autoscaler": status.model_dump(
                                           by_alias=True, exclude_none=True, mode="json")}})
        await asyncio.to_thread(self._event, namespace, resource, body["metadata"]["uid"], previous, replicas,
                                decision, now)

    def _event(self, namespace: str, resource: str, uid: str, previous: int, replicas: int, decision: Decision,
               now: datetime.datetime, pool: str = "") -> None:
        from kubernetes import client

        self.core.create_namespaced_event(namespace, client.CoreV1Event(
            metadata=client.V1ObjectMeta(generate_name=f"{resource}."),
            involved_object=client.V1ObjectReference(api_version=API_VERSION, kind=KIND, name=resource,
                                                     namespace=namespace, uid=uid),
            reason="ScaledUp" if replicas > previous else "ScaledDown", type="Normal",
            message=f"{pool + ' ' if pool else ''}replicas {previous} -> {replicas}: {decision.reason}"[:1024],
            source=client.V1EventSource(component=COMPONENT), reporting_component=COMPONENT,
            reporting_instance=socket.gethostname()[:128], first_timestamp=now, last_timestamp=now, count=1))


class LeaseElector:
    def __init__(self, api_client: Any, namespace: str, *, name: str = COMPONENT, identity: str | None = None,
                 duration: float = 15.0, clock=time.monotonic) -> None:
        from kubernetes import client

        self.api = client.CoordinationV1Api(api_client)
        self.namespace, self.name = namespace, name
        self.identity = identity or os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}"
        self.duration = duration
        self.clock = clock
        self._leader_until = 0.0

    def is_leader(self) -> bool:
        return self.clock() < self._leader_until

    def try_acquire(self) -> bool:
        """One round: take, renew or respect the Lease. Returns whether this replica leads now."""
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        started, now = self.clock(), _now()
        try:
            lease = self.api.read_namespaced_lease(self.name, self.namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise
            lease = client.V1Lease(metadata=client.V1ObjectMeta(name=self.name, namespace=self.namespace),
                                   spec=client.V1LeaseSpec(holder_identity=self.identity,
                                                           lease_duration_seconds=int(self.duration),
                                                           acquire_time=now, renew_time=now, lease_transitions=0))
            try:
                self.api.create_namespaced_lease(self.namespace, lease)
            except ApiException as race:
                if race.status != 409:
                    raise
                return self._lead(False, started)
            return self._lead(True, started)
        spec = lease.spec
        renewed = spec.renew_time
        expired = renewed is None or (now - renewed).total_seconds() > (spec.lease_duration_seconds or self.duration)
        if spec.holder_identity not in (None, self.identity) and not expired:
            return self._lead(False, started)
        if spec.holder_identity != self.identity:
            spec.acquire_time = now
            spec.lease_transitions = (spec.lease_transitions or 0) + 1
            log.info("autoscaler lease %s/%s taken over from %s", self.namespace, self.name, spec.holder_identity)
        spec.holder_identity, spec.renew_time = self.identity, now
        spec.lease_duration_seconds = int(self.duration)
        try:
            self.api.replace_namespaced_lease(self.name, self.namespace, lease)
        except ApiException as exc:
            if exc.status != 409:
                raise
            return self._lead(False, started)  # another replica renewed or took it first
        return self._lead(True, started)

    def _lead(self, leading: bool, started: float) -> bool:
        self._leader_until = started + self.duration * 2 / 3 if leading else 0.0
        return leading

    async def run(self) -> None:
        while True:
            try:
                await asyncio.to_thread(self.try_acquire)
            except Exception as exc:  # the API is unreachable: stop leading once the lease may have passed
                log.warning("autoscaler lease: %s", " ".join(str(exc).split())[:200])
            await asyncio.sleep(self.duration / 3)
