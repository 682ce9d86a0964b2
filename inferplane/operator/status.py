"""The InferenceDeployment's status, computed from its spec and its child Deployment's status.

Pure, so that the create handler and the child-Deployment watcher write the same status for the
same facts, and so that tests can check every phase without an API server.
Conditions follow the Kubernetes convention: type, status, reason, message, lastTransitionTime;
a condition's lastTransitionTime changes only when its status does. Every status is built as the
typed model the CRD's status schema is generated from (api/deployment_status.py) and written as its
camelCase dump, so what the operator writes is what the CRD declares, field by field.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any

from inferplane.api.deployment_status import AdapterStatus, Condition, InferenceDeploymentStatus, ModelStatus
from inferplane.api.model_resolution import ModelResolutionError, ResolvedModel
from inferplane.api.resolve import ResolvedDeployment
from inferplane.operator.manifests import GRPC_PORT, LABEL_DEPLOYMENT


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC).replace(microsecond=0)  # whole seconds, as Kubernetes writes


def _wire(part: InferenceDeploymentStatus | Condition) -> dict[str, Any]:
    """A status part as the API server stores it: camelCase; a field not given (or None) is left out,
    so a merge patch of it leaves what another writer put there (status.autoscaler, say) alone."""
    return part.model_dump(by_alias=True, exclude_unset=True, exclude_none=True, mode="json")


def _condition(ctype: str, status: bool, reason: str, message: str, *, previous: Sequence[Mapping[str, Any]] = (),
               generation: int | None = None, now: str | None = None) -> Condition:
    value = "True" if status else "False"
    before = next((c for c in previous if c.get("type") == ctype), None)
    changed = before is None or before.get("status") != value
    return Condition(type=ctype, status=value, reason=reason, message=message, observed_generation=generation,
                     last_transition_time=(now or _now()) if changed else before.get("lastTransitionTime") or _now())


def condition(ctype: str, status: bool, reason: str, message: str, *, previous: Sequence[Mapping[str, Any]] = (),
              generation: int | None = None, now: str | None = None) -> dict[str, Any]:
    """One condition as written (see _condition)."""
    return _wire(_condition(ctype, status, reason, message, previous=previous, generation=generation, now=now))


def _deployment_condition(deployment: Mapping[str, Any], ctype: str) -> Mapping[str, Any] | None:
    for cond in deployment.get("status", {}).get("conditions", None) or []:
        if cond.get("type") == ctype:
            return cond
    return None


def compute_status(
    *,
    name: str,
    namespace: str,
    desired_replicas: int,
    resolved: ResolvedDeployment,
    deployment: Mapping[str, Any] | None,
    generation: int | None = None,
    previous_conditions: Sequence[Mapping[str, Any]] = (),
    now: str | None = None,
    model: ResolvedModel | None = None,
    adapters: Sequence[AdapterStatus] = (),
) -> dict[str, Any]:
    """Phase Ready when every desired replica is ready and updated; Degraded when the rollout failed.
    `adapters`: spec.adapters as resolved (status.adapters lists them)."""
    dstatus = (deployment or {}).get("status", {}) or {}
    ready = int(dstatus.get("readyReplicas") or 0)
    updated = int(dstatus.get("updatedReplicas") or 0)
    rolled_out = (
        deployment is not None
        and ready >= desired_replicas
        and updated >= desired_replicas
        and int(dstatus.get("observedGeneration") or 0)
        >= int((deployment.get("metadata") or {}).get("generation") or 0)
    )
    failure = _deployment_condition(deployment or {}, "ReplicaFailure")
    progressing = _deployment_condition(deployment or {}, "Progressing")
    stalled = progressing is not None and progressing.get("reason") == "ProgressDeadlineExceeded"
    degraded = (failure is not None and failure.get("status") == "True") or stalled

    if deployment is None:
        phase, p_reason, p_msg = "Pending", "Creating", "the worker Deployment is being created"
    elif desired_replicas == 0:
        phase, p_reason, p_msg = "ScaledToZero", "ScaledToZero", "replicas is 0"
    elif rolled_out:
        phase, p_reason, p_msg = "Ready", "RolledOut", f"{ready}/{desired_replicas} workers ready"
    elif degraded:
        phase, p_reason, p_msg = "Degraded", "RolloutStalled", str((failure or progressing or {}).get("message", ""))
    else:
        phase, p_reason, p_msg = "Progressing", "RollingOut", f"{ready}/{desired_replicas} workers ready"

    kw = {"previous": previous_conditions, "generation": generation, "now": now}
    if ready > 0:
        ready_cond = _condition("Ready", True, "WorkersReady" if rolled_out else "PartiallyReady",
                               f"{ready}/{desired_replicas} workers serve requests", **kw)
    else:
        ready_cond = _condition("Ready", False, "ScaledToZero" if desired_replicas == 0 else "NoWorkerReady",
                               "no worker is ready yet" if desired_replicas else "replicas is 0", **kw)
    conditions = [
        ready_cond,
        _condition("Progressing", phase in ("Pending", "Progressing"), p_reason, p_msg, **kw),
        _condition("Degraded", degraded, "RolloutStalled" if degraded else "AsExpected",
                  p_msg if degraded else "no rollout failure reported", **kw),
    ]
    if model is not None:
        conditions.append(_condition("ModelResolved", True, "Resolved",
                                     f"{model.ref} sha256:{model.sha256[:12]}", **kw))
    return _wire(InferenceDeploymentStatus(
        phase=phase, conditions=conditions, replicas=int(dstatus.get("replicas") or 0), ready_replicas=ready,
        selected_runtime=resolved.runtime, runtime_reason=resolved.reason, selector=f"{LABEL_DEPLOYMENT}={name}",
        # The headless Service resolves to the ready pods' addresses; the gateway dials them.
        endpoints=[f"{name}.{namespace}.svc:{GRPC_PORT}"] if ready > 0 else [],
        model=None if model is None else ModelStatus(name=model.name, version=model.version, sha256=model.sha256,
                                                     uri=model.uri, format=model.format),
        **({"adapters": list(adapters)} if adapters else {}), observed_generation=generation))


def unresolved_model_status(error: ModelResolutionError, *, generation: int | None,
                            previous_conditions: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """The registry cannot give the spec's model: no worker is created or changed (pods would only
    crash-loop); workers already running keep serving the version they have."""
    kw = {"previous": previous_conditions, "generation": generation}
    message = f"{error.message}; running workers, if any, are left as they are"
    return _wire(InferenceDeploymentStatus(
        phase="Degraded", observed_generation=generation,
        conditions=[_condition("ModelResolved", False, error.reason, error.message, **kw),
                    _condition("Degraded", True, error.reason, message, **kw)]))


def invalid_status(message: str, *, generation: int | None, previous_conditions: Sequence[Mapping[str, Any]] = ()
                   ) -> dict[str, Any]:
    """For a spec the operator cannot act on (when no webhook stopped it at admission)."""
    kw = {"previous": previous_conditions, "generation": generation}
    return _wire(InferenceDeploymentStatus(
        phase="Failed", observed_generation=generation,
        conditions=[_condition("Ready", False, "InvalidSpec", message, **kw),
                    _condition("Progressing", False, "InvalidSpec", message, **kw),
                    _condition("Degraded", True, "InvalidSpec", message, **kw)]))
