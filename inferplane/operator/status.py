"""The InferenceDeployment's status, computed from its spec and its child Deployment's status.

Pure, so that the create handler and the child-Deployment watcher write the same status for the
same facts, and so that tests can check every phase without an API server.
Conditions follow the Kubernetes convention: type, status, reason, message, lastTransitionTime;
a condition's lastTransitionTime changes only when its status does.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any

from inferplane.api.model_resolution import ModelResolutionError, ResolvedModel
from inferplane.api.resolve import ResolvedDeployment
from inferplane.operator.manifests import GRPC_PORT, LABEL_DEPLOYMENT


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def condition(ctype: str, status: bool, reason: str, message: str, *, previous: Sequence[Mapping[str, Any]] = (),
              generation: int | None = None, now: str | None = None) -> dict[str, Any]:
    value = "True" if status else "False"
    before = next((c for c in previous if c.get("type") == ctype), None)
    changed = before is None or before.get("status") != value
    result = {"type": ctype, "status": value, "reason": reason, "message": message,
              "lastTransitionTime": (now or _now()) if changed else before.get("lastTransitionTime") or _now()}
    if generation is not None:
        result["observedGeneration"] = generation
    return result


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
) -> dict[str, Any]:
    """Phase Ready when every desired replica is ready and updated; Degraded when the rollout failed."""
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
        ready_cond = condition("Ready", True, "WorkersReady" if rolled_out else "PartiallyReady",
                               f"{ready}/{desired_replicas} workers serve requests", **kw)
    else:
        ready_cond = condition("Ready", False, "ScaledToZero" if desired_replicas == 0 else "NoWorkerReady",
                               "no worker is ready yet" if desired_replicas else "replicas is 0", **kw)
    conditions = [
        ready_cond,
        condition("Progressing", phase in ("Pending", "Progressing"), p_reason, p_msg, **kw),
        condition("Degraded", degraded, "RolloutStalled" if degraded else "AsExpected",
                  p_msg if degraded else "no rollout failure reported", **kw),
    ]
    status: dict[str, Any] = {
        "phase": phase,
        "conditions": conditions,
        "replicas": int(dstatus.get("replicas") or 0),
        "readyReplicas": ready,
        "selectedRuntime": resolved.runtime,
        "runtimeReason": resolved.reason,
        "selector": f"{LABEL_DEPLOYMENT}={name}",
        # The headless Service resolves to the ready pods' addresses; the gateway dials them.
        "endpoints": [f"{name}.{namespace}.svc:{GRPC_PORT}"] if ready > 0 else [],
    }
    if model is not None:
        status["model"] = {"name": model.name, "version": model.version, "sha256": model.sha256, "uri": model.uri,
                           "format": model.format}
        conditions.append(condition("ModelResolved", True, "Resolved",
                                    f"{model.ref} sha256:{model.sha256[:12]}", **kw))
    if generation is not None:
        status["observedGeneration"] = generation
    return status


def unresolved_model_status(error: ModelResolutionError, *, generation: int | None,
                            previous_conditions: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """The registry cannot give the spec's model: no worker is created or changed (pods would only
    crash-loop); workers already running keep serving the version they have."""
    kw = {"previous": previous_conditions, "generation": generation}
    message = f"{error.message}; running workers, if any, are left as they are"
    status: dict[str, Any] = {
        "phase": "Degraded",
        "conditions": [condition("ModelResolved", False, error.reason, error.message, **kw),
                       condition("Degraded", True, error.reason, message, **kw)],
    }
    if generation is not None:
        status["observedGeneration"] = generation
    return status


def invalid_status(message: str, *, generation: int | None, previous_conditions: Sequence[Mapping[str, Any]] = ()
                   ) -> dict[str, Any]:
    """For a spec the operator cannot act on (when no webhook stopped it at admission)."""
    kw = {"previous": previous_conditions, "generation": generation}
    status: dict[str, Any] = {
        "phase": "Failed",
        "conditions": [condition("Ready", False, "InvalidSpec", message, **kw),
                       condition("Progressing", False, "InvalidSpec", message, **kw),
                       condition("Degraded", True, "InvalidSpec", message, **kw)],
    }
    if generation is not None:
        status["observedGeneration"] = generation
    return status
