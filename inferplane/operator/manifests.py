"""Pure functions from an InferenceDeployment to the Kubernetes objects that serve it.

No I/O, no kopf, no Kubernetes client: the same spec always gives the same objects, which is
what makes reconciling twice a no-op (see `spec_hash`) and lets the local supervisor start
workers from `worker_invocation` exactly as the cluster does. This module is the single source
of truth for how a worker is started.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from inferplane.api.deployment import API_VERSION, KIND, InferenceDeploymentSpec, prefill_pool_name
from inferplane.api.model_resolution import ResolvedAdapter, ResolvedModel
from inferplane.api.resolve import ResolvedDeployment, prefill_spec, resolve
from inferplane.monitoring.deployment_rules import DeploymentScope, deployment_groups
from inferplane.monitoring.rules import rule_file
from inferplane.operator import kv_tier, model_pod
from inferplane.operator.kv_tier import KV_TIER_DIR, KVTierVolume

GRPC_PORT = 50051
METRICS_PORT = 9090
DEFAULT_IMAGE = "ghcr.io/inferplane/inferplane:0.1.0"
PRE_STOP_SECONDS = 5  # lets endpoints drop a terminating pod before it starts refusing work

# Labels: selectors use only LABEL_DEPLOYMENT, which never changes, so a Deployment's immutable
# selector survives every spec change; the others describe the pods for the gateway and humans.
LABEL_DEPLOYMENT = "inferplane.io/deployment"
LABEL_RUNTIME = "inferplane.io/runtime"
LABEL_TIER = "inferplane.io/tier"
# A disaggregated deployment's worker pods say which pool they are in (spec.disaggregation): the
# decode pool (the Deployment <name>, whose selector is unchanged) or the prefill pool (<name>-prefill).
LABEL_POOL = "inferplane.io/pool"
POOL_PREFILL = "prefill"
POOL_DECODE = "decode"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "inferplane-operator"
ANNOTATION_HASH = "inferplane.io/spec-hash"
ANNOTATION_SERVED_MODEL = "inferplane.io/served-model-name"
ANNOTATION_WEIGHT = "inferplane.io/weight"

@dataclass(frozen=True)
class WorkerInvocation:
    """How to start one worker process: what a container runs, and what the local supervisor runs."""

    command: list[str]
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Owner:
    """The InferenceDeployment that owns the objects built here (enough of its metadata for references)."""

    name: str
    namespace: str
    uid: str

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Owner:
        meta = body.get("metadata", {})
        return cls(name=meta["name"], namespace=meta.get("namespace", "default"), uid=meta.get("uid", ""))

    def reference(self) -> dict[str, Any]:
        """controller=True and blockOwnerDeletion=True: deleting the resource garbage-collects its children."""
        return {"apiVersion": API_VERSION, "kind": KIND, "name": self.name, "uid": self.uid,
                "controller": True, "blockOwnerDeletion": True}


def _label_value(text: str) -> str:
    """A label-safe rendering of free text (63 chars, alphanumerics at both ends)."""
    value = re.sub(r"[^A-Za-z0-9._-]", "-", text)[:63]
    return value.strip("-._") or "none"


def worker_invocation(
    name: str,
    spec: InferenceDeploymentSpec,
    *,
    resolved: ResolvedDeployment | None = None,
    host: str = "0.0.0.0",
    port: int = GRPC_PORT,
    metrics_port: int = METRICS_PORT,
    model_argument: str | None = None,
    adapters: Sequence[ResolvedAdapter] = (),
    kv_tier_dir: str = KV_TIER_DIR,
) -> WorkerInvocation:
    """The worker's command line and environment for one replica of `name`; `model_argument` is
    what --model says (default: as `model_pod.plan` says without a registry); `adapters` are the
    spec's `adapters` as the registry resolved them (loaded before the worker serves);
    `kv_tier_dir` where its KV disk tier lives, if it has one (a volume in a cluster, a folder of
    the home under `inferplane up`)."""
    resolved = resolved or resolve(spec)
    args = [
        "--model", model_argument or model_pod.plan(spec, None, image="").argument,
        "--host", host,
        "--port", str(port),
        "--metrics-port", str(metrics_port),
        *resolved.engine_args(),
        "--served-model-name", spec.served_model_name(name),
        "--drain-grace-seconds", str(spec.drain_grace_seconds),
        *(arg for adapter in adapters for arg in ("--preload-adapter", adapter.worker_flag())),
        *(("--kv-offload-dir", kv_tier_dir) if resolved.engine.get("kv_offload_disk") else ()),
    ]
    env: dict[str, str] = {}
    if resolved.cpu_threads is not None:
        # torch otherwise sizes its pool to the node's cores, not the pod's CPU allowance.
        env["OMP_NUM_THREADS"] = str(resolved.cpu_threads)
    return WorkerInvocation(command=["inferplane", "worker"], args=args, env=env)


def pool_name(name: str, pool: str | None) -> str:
    """The name of the objects of one worker pool of the InferenceDeployment `name`, and its pods'
    LABEL_DEPLOYMENT (pool None: not disaggregated). The decode pool keeps the resource's name, so
    enabling disaggregation renames nothing; the prefill pool's objects are prefill_pool_name(name),
    which no selector of the decode pool's (selector(name)) matches."""
    return prefill_pool_name(name) if pool == POOL_PREFILL else name


def labels(name: str, spec: InferenceDeploymentSpec, resolved: ResolvedDeployment, *,
           pool: str | None = None) -> dict[str, str]:
    """The labels of the InferenceDeployment `name`'s workers and objects; `pool` (disaggregated only)
    adds LABEL_POOL, and the prefill pool's LABEL_DEPLOYMENT is its own name."""
    return {
        "app.kubernetes.io/name": "inferplane-worker",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": "worker",
        "app.kubernetes.io/part-of": "inferplane",
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_DEPLOYMENT: pool_name(name, pool),
        LABEL_RUNTIME: resolved.runtime,
        LABEL_TIER: spec.serving.tier,
        **({LABEL_POOL: pool} if pool is not None else {}),
    }


def selector(name: str) -> dict[str, str]:
    return {LABEL_DEPLOYMENT: name}


def _grpc_probe(period: int, failures: int, timeout: int = 5) -> dict[str, Any]:
    return {"grpc": {"port": GRPC_PORT}, "periodSeconds": period, "failureThreshold": failures,
            "timeoutSeconds": timeout}


def worker_container(name: str, spec: InferenceDeploymentSpec, *, resolved: ResolvedDeployment, image: str,
                     weights: model_pod.ModelPlan, kv_dir: str = KV_TIER_DIR,
                     kv_storage: str | None = None) -> dict[str, Any]:
    """The worker container: the invocation plus probes, ports, resources and a locked-down context;
    `kv_dir` its KV disk tier's directory and `kv_storage` the ephemeral storage the tier requests."""
    invocation = worker_invocation(name, spec, resolved=resolved, model_argument=weights.argument,
                                   adapters=weights.adapters, kv_tier_dir=kv_dir)
    quantities = {"cpu": spec.resources.cpu, "memory": spec.resources.memory}
    if spec.uses_gpu:
        quantities[spec.resources.gpu_resource_name] = str(spec.resources.gpus)
    mounts = [*weights.worker_mounts, {"name": "tmp", "mountPath": "/tmp"}]
    if spec.uses_gpu:
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    requests = dict(quantities)
    if spec.engine.kv_offload_disk is not None:
        mounts.append({"name": kv_tier.VOLUME, "mountPath": KV_TIER_DIR})
        if kv_storage is not None:
            requests["ephemeral-storage"] = kv_storage  # the scheduler places it where the disk is
    # The worker answers NOT_SERVING while it drains; liveness must not kill it during that drain.
    liveness_failures = max(3, math.ceil((spec.drain_grace_seconds + PRE_STOP_SECONDS) / 15) + 2)
    env = [{"name": key, "value": value} for key, value in invocation.env.items()]
    env += [{"name": "HOME", "value": "/tmp"},
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            # The worker checks its footprint against this before loading (worker/serve/footprint.py): a
            # model that cannot fit refuses to start with what to ask for, a KV pool that cannot is
            # fitted, instead of the container being OOM-killed. Its cgroup says the same where the
            # worker can read it; this says it wherever.
            {"name": "INFERPLANE_MEMORY_LIMIT",
             "valueFrom": {"resourceFieldRef": {"containerName": "worker", "resource": "limits.memory"}}}]
    return {
        "name": "worker",
        "image": spec.image or image,
        "imagePullPolicy": "IfNotPresent",
        "command": invocation.command,
        "args": invocation.args,
        "env": env,
        "ports": [{"name": "grpc", "containerPort": GRPC_PORT, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"}],
        # Loading (and for cpu-int8, quantizing) can take minutes: the startup probe allows 15.
        "startupProbe": _grpc_probe(period=10, failures=90),
        "readinessProbe": _grpc_probe(period=5, failures=2, timeout=3),
        "livenessProbe": _grpc_probe(period=15, failures=liveness_failures),
        "lifecycle": {"preStop": {"sleep": {"seconds": PRE_STOP_SECONDS}}},
        "resources": {"requests": requests, "limits": dict(quantities)},
        "volumeMounts": mounts,
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }


def worker_pod_spec(name: str, spec: InferenceDeploymentSpec, *, resolved: ResolvedDeployment, image: str,
                    weights: model_pod.ModelPlan, namespace: str = "default",
                    kv_volume: KVTierVolume | None = None) -> dict[str, Any]:
    volumes = [*weights.volumes, {"name": "tmp", "emptyDir": {}}]
    kv_volume = kv_volume or KVTierVolume()
    if spec.engine.kv_offload_disk is not None:
        volumes.append(kv_volume.volume(spec))  # operator/kv_tier.py: per pod, or per node or claim
    tolerations = [t.model_dump(by_alias=True, exclude_none=True) for t in spec.tolerations]
    if spec.uses_gpu:
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
        gpu_key = spec.resources.gpu_resource_name
        if not any(t.get("key") == gpu_key for t in tolerations):
            tolerations.append({"key": gpu_key, "operator": "Exists", "effect": "NoSchedule"})
    pod: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": PRE_STOP_SECONDS + spec.drain_grace_seconds + 10,
        "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001, "fsGroup": 10001,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [worker_container(name, spec, resolved=resolved, image=image, weights=weights,
                                        kv_dir=kv_volume.directory(namespace, name),
                                        kv_storage=kv_volume.ephemeral_storage(spec))],
        "volumes": volumes,
    }
    if weights.init_containers:
        pod["initContainers"] = weights.init_containers
    if spec.node_selector:
        pod["nodeSelector"] = dict(spec.node_selector)
    if tolerations:
        pod["tolerations"] = tolerations
    if spec.affinity:
        pod["affinity"] = dict(spec.affinity)
    return pod


def _metadata(owner: Owner, spec: InferenceDeploymentSpec, resolved: ResolvedDeployment, *, runtime_label: bool = False,
              pool: str | None = None, **extra: Any) -> dict[str, Any]:
    """Only the Deployment carries the runtime label: a runtime change then rewrites nothing else.
    Of the pools, only the prefill pool's objects are labelled: the decode pool's keep what they had
    before disaggregation (its pods are labelled, in their template)."""
    object_pool = pool if pool == POOL_PREFILL else None
    object_labels = labels(owner.name, spec, resolved, pool=object_pool)
    if not runtime_label:
        object_labels.pop(LABEL_RUNTIME)
    return {"name": pool_name(owner.name, pool), "namespace": owner.namespace, "labels": object_labels,
            "ownerReferences": [owner.reference()], **extra}


def deployment(owner: Owner, spec: InferenceDeploymentSpec, *, resolved: ResolvedDeployment, image: str,
               model: ResolvedModel | None = None, cache: model_pod.ModelCache | None = None,
               adapters: tuple[ResolvedAdapter, ...] = (), kv_volume: KVTierVolume | None = None,
               pool: str | None = None) -> dict[str, Any]:
    """The workers of one pool (`pool` None: not disaggregated): their replicas and resources are
    `spec`'s (for the prefill pool, api.resolve.prefill_spec's)."""
    weights = model_pod.plan(spec, model, image=image, cache=cache, adapters=adapters)
    # Without a spare GPU a surge pod cannot schedule, so GPU rollouts replace one pod at a time.
    rolling = {"maxSurge": 0, "maxUnavailable": 1} if spec.uses_gpu else {"maxSurge": 1, "maxUnavailable": 0}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(owner, spec, resolved, runtime_label=True, pool=pool),
        "spec": {
            "replicas": spec.replicas,
            "revisionHistoryLimit": 3,
            "selector": {"matchLabels": selector(pool_name(owner.name, pool))},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": rolling},
            "template": {
                "metadata": {"labels": labels(owner.name, spec, resolved, pool=pool),
                             "annotations": {"prometheus.io/scrape": "true",
                                             "prometheus.io/port": str(METRICS_PORT), **weights.annotations}},
                "spec": worker_pod_spec(owner.name, spec, resolved=resolved, image=image, weights=weights,
                                        namespace=owner.namespace, kv_volume=kv_volume),
            },
        },
    }


def service(owner: Owner, spec: InferenceDeploymentSpec, *, resolved: ResolvedDeployment,
            pool: str | None = None) -> dict[str, Any]:
    """Headless: the gateway resolves pod addresses itself, to route by prefix affinity and load.
    The prefill pool's has no served-model annotations: it serves no model to tenants, its workers
    compute prompts for the decode pool's."""
    annotations = {ANNOTATION_SERVED_MODEL: spec.served_model_name(owner.name),
                   ANNOTATION_WEIGHT: str(spec.serving.weight)}
    extra = {} if pool == POOL_PREFILL else {"annotations": annotations}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(owner, spec, resolved, pool=pool, **extra),
        "spec": {
            "clusterIP": "None",
            "selector": selector(pool_name(owner.name, pool)),
            "ports": [{"name": "grpc", "port": GRPC_PORT, "targetPort": "grpc", "protocol": "TCP",
                       "appProtocol": "kubernetes.io/h2c"},
                      {"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"}],
        },
    }


def pod_disruption_budget(owner: Owner, spec: InferenceDeploymentSpec, *,
                          resolved: ResolvedDeployment, pool: str | None = None) -> dict[str, Any]:
    """maxUnavailable 1, not minAvailable: a one-replica deployment must not block node drains forever."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(owner, spec, resolved, pool=pool),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector(pool_name(owner.name, pool))}},
    }


def service_monitor(owner: Owner, spec: InferenceDeploymentSpec, *, resolved: ResolvedDeployment,
                    pool: str | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": _metadata(owner, spec, resolved, pool=pool),
        "spec": {
            "selector": {"matchLabels": selector(pool_name(owner.name, pool))},
            "namespaceSelector": {"matchNames": [owner.namespace]},
            "endpoints": [{"port": "metrics", "path": "/metrics", "interval": "15s"}],
        },
    }


def prometheus_rule(owner: Owner, spec: InferenceDeploymentSpec, *, resolved: ResolvedDeployment) -> dict[str, Any]:
    """The deployment's SLO and saturation rules (inferplane/monitoring/deployment_rules.py)."""
    scope = DeploymentScope.in_cluster(owner.namespace, owner.name, spec)
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": _metadata(owner, spec, resolved),
        "spec": rule_file(deployment_groups(spec, scope)),
    }


def spec_hash(manifest: Mapping[str, Any]) -> str:
    """A digest of everything the operator sets, so an unchanged object is never written again."""
    stripped = json.loads(json.dumps(manifest))
    stripped.get("metadata", {}).get("annotations", {}).pop(ANNOTATION_HASH, None)
    return hashlib.sha256(json.dumps(stripped, sort_keys=True).encode()).hexdigest()[:16]


def with_hash(manifest: dict[str, Any]) -> dict[str, Any]:
    digest = spec_hash(manifest)
    manifest.setdefault("metadata", {}).setdefault("annotations", {})[ANNOTATION_HASH] = digest
    return manifest


def children(
    body: Mapping[str, Any],
    spec: InferenceDeploymentSpec,
    *,
    image: str = DEFAULT_IMAGE,
    monitoring: bool = True,
    resolved: ResolvedDeployment | None = None,
    model: ResolvedModel | None = None,
    cache: model_pod.ModelCache | None = None,
    adapters: tuple[ResolvedAdapter, ...] = (),
    kv_volume: KVTierVolume | None = None,
) -> list[dict[str, Any]]:
    """Every object an InferenceDeployment owns, each stamped with the hash of its content: the
    decode pool's Deployment first, and a disaggregated deployment's prefill pool after the rest.

    monitoring=False leaves out the ServiceMonitor and PrometheusRule, for clusters without the
    Prometheus operator's CRDs.
    """
    owner = Owner.from_body(body)
    resolved = resolved or resolve(spec)
    disaggregated = spec.disaggregation.enabled
    objects = [
        deployment(owner, spec, resolved=resolved, image=image, model=model, cache=cache, adapters=adapters,
                   kv_volume=kv_volume, pool=POOL_DECODE if disaggregated else None),
        service(owner, spec, resolved=resolved),
        pod_disruption_budget(owner, spec, resolved=resolved),
    ]
    if monitoring:
        objects += [service_monitor(owner, spec, resolved=resolved),
                    prometheus_rule(owner, spec, resolved=resolved)]
    if disaggregated:
        # The same workers on the prefill pool's replicas and resources; its SLO rules are the
        # decode pool's (the tenants' requests end there), so it has no PrometheusRule of its own.
        prefill = prefill_spec(spec)
        prefill_resolved = resolve(prefill)
        objects += [
            deployment(owner, prefill, resolved=prefill_resolved, image=image, model=model, cache=cache,
                       adapters=adapters, kv_volume=kv_volume, pool=POOL_PREFILL),
            service(owner, prefill, resolved=prefill_resolved, pool=POOL_PREFILL),
            pod_disruption_budget(owner, prefill, resolved=prefill_resolved, pool=POOL_PREFILL),
        ]
        if monitoring:
            objects.append(service_monitor(owner, prefill, resolved=prefill_resolved, pool=POOL_PREFILL))
    return [with_hash(obj) for obj in objects]


# What `children` may build, by kind; the prefill pool has no PrometheusRule.
_POOL_KINDS = (("apps/v1", "Deployment"), ("v1", "Service"), ("policy/v1", "PodDisruptionBudget"))
_MONITORING_KINDS = (("monitoring.coreos.com/v1", "ServiceMonitor"), ("monitoring.coreos.com/v1", "PrometheusRule"))


def possible_children(name: str, namespace: str, *, monitoring: bool = True) -> list[dict[str, Any]]:
    """The kind, name and namespace of every object an InferenceDeployment `name` may own, whatever
    its spec, the Deployments first: what the finalizer deletes, and what reconcile deletes when
    `children` no longer builds it (disaggregation turned off)."""
    kinds = [*_POOL_KINDS, *(_MONITORING_KINDS if monitoring else ())]
    return [{"apiVersion": api_version, "kind": kind, "metadata": {"name": child, "namespace": namespace}}
            for api_version, kind in kinds
            for child in (name, prefill_pool_name(name)) if not (kind == "PrometheusRule" and child != name)]
