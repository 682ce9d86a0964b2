"""kopf handlers: the lifecycle of an InferenceDeployment.

    admitted   → validate_spec (admission webhook) refuses specs the schema cannot catch
    created    → reconcile: apply the children, write status Progressing with the chosen runtime
    changed    → reconcile again: only children whose content changed are written, and those no
                 longer built are deleted (a prefill pool when disaggregation is turned off)
    resumed    → reconcile after an operator restart, in case anything drifted meanwhile
    child Deployment changes → child_deployment_changed: status follows the workers' readiness
    deleted    → finalize: remove the children (owner references would too) before the finalizer goes

Objects are built by `manifests` (pure); this module only talks to the API and kopf.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any

import kopf

from inferplane.api.deployment import GROUP, PLURAL, VERSION, InferenceDeploymentSpec, SpecError
from inferplane.api.deployment_status import AdapterStatus
from inferplane.api.model_resolution import BUILTIN_MODELS, ModelResolutionError, ResolvedAdapter, ResolvedModel
from inferplane.api.resolve import resolve
from inferplane.operator import manifests, peering
from inferplane.operator.config import OperatorConfig
from inferplane.operator.kube import ApiError, KubeClient, path_for, path_of
from inferplane.operator.metrics import METRICS
from inferplane.operator.status import compute_status, condition, invalid_status, unresolved_model_status
from inferplane.operator.webhook import ServiceWebhookServer

FINALIZER = "inferplane.io/finalizer"


def _config(memo: kopf.Memo) -> OperatorConfig:
    return memo.get("config") or OperatorConfig()


def _client(memo: kopf.Memo) -> KubeClient:
    client = memo.get("client")
    if client is None:
        raise kopf.TemporaryError("no API client yet (login pending)", delay=1)
    return client


async def _no_webhook_server(fn: Any) -> AsyncIterator[Any]:
    """Stands in for a webhook server when admission is off, so that kopf accepts the validate handler."""
    await asyncio.Event().wait()
    yield  # pragma: no cover


# ---- operator start-up --------------------------------------------------------------------------

@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    config = _config(memo)
    # Progress and the last-handled spec go into annotations: the CRD's structural schema would
    # prune kopf's default status.kopf, and status belongs to the user-facing conditions.
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="inferplane.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="inferplane.io", key="last-handled-configuration")
    settings.posting.enabled = config.post_events
    settings.posting.level = logging.WARNING
    if config.peering_name is not None:
        settings.peering.name = config.peering_name
    settings.networking.error_backoffs = [1, 2, 5, 10, 20]  # kopf's own API calls
    settings.batching.worker_limit = 256
    if config.webhook is None:
        settings.admission.server = _no_webhook_server
    else:
        hook = config.webhook
        listener = dict(addr=hook.addr, port=hook.port, insecure=hook.insecure, certfile=hook.certfile,
                        pkeyfile=hook.pkeyfile, cafile=hook.cafile)
        if hook.service is not None:
            settings.admission.server = ServiceWebhookServer(
                service_namespace=hook.service[0], service_name=hook.service[1], **listener)
        else:
            settings.admission.server = kopf.WebhookServer(host=hook.host, **listener)
        settings.admission.managed = hook.managed


@kopf.on.login()
async def login(memo: kopf.Memo, **kwargs: Any) -> kopf.ConnectionInfo | None:
    """In-cluster service account first, then $KUBECONFIG; our own client shares the credentials."""
    info = kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)
    if info is not None:
        old = memo.get("client")
        memo["client"] = KubeClient.from_connection_info(info)
        if old is not None:
            await old.close()
        _check_peering_once(memo, kwargs["logger"])
    return info


def _check_peering_once(memo: kopf.Memo, logger: logging.Logger) -> None:
    """With peering, warn (in the background, as long as it lasts) when the peering object is missing."""
    config = _config(memo)
    if config.peering_name is None or memo.get("peering_check") is not None:
        return
    memo["peering_check"] = asyncio.create_task(peering.report_missing_peering(
        lambda: memo["client"], config.peering_name, config.namespaces, config.clusterwide, logger))


@kopf.on.cleanup()
async def close_client(memo: kopf.Memo, **_: Any) -> None:
    check = memo.pop("peering_check", None)
    if check is not None:
        check.cancel()
    client = memo.pop("client", None)
    if client is not None:
        await client.close()
    registry = _config(memo).registry
    if registry is not None:
        await registry.close()


# ---- admission ----------------------------------------------------------------------------------

@kopf.on.validate(GROUP, VERSION, PLURAL, id="validate-spec", operations=["CREATE", "UPDATE"])
async def validate_spec(spec: Mapping[str, Any], **_: Any) -> None:
    """The full validation of inferplane.api.deployment, including rules that CEL cannot express."""
    try:
        InferenceDeploymentSpec.from_dict(spec)
    except SpecError as exc:
        raise kopf.AdmissionError(str(exc), code=422) from exc


# ---- reconciliation -----------------------------------------------------------------------------

def _retry_delay(retry: int, config: OperatorConfig) -> float:
    return min(config.max_backoff_seconds, 2.0 ** retry)


class NameTaken(Exception):
    """A child's name is held by an object another InferenceDeployment controls."""


def _controller(obj: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ownerReference of `obj` that controls it, if any."""
    refs = obj.get("metadata", {}).get("ownerReferences") or []
    return next((ref for ref in refs if ref.get("controller")), None)


def _owned_by(obj: Mapping[str, Any], name: str) -> bool:
    return any(ref.get("kind") == "InferenceDeployment" and ref.get("name") == name
               for ref in obj.get("metadata", {}).get("ownerReferences") or [])


async def _apply(client: KubeClient, desired: dict[str, Any], logger: logging.Logger) -> str:
    """Write a child only when its content hash changed, so a repeated reconcile writes nothing.

    A child that another InferenceDeployment controls is left alone (NameTaken): a resource `chat`
    with disaggregation builds `chat-prefill`, which may be another resource's name.
    """
    live = await client.get(path_of(desired))
    ours, theirs = _controller(desired), live and _controller(live)
    if theirs and ours and theirs.get("kind") == ours["kind"] and theirs.get("name") != ours["name"]:
        raise NameTaken(f"{desired['kind']} {desired['metadata']['name']} belongs to {theirs['kind']} "
                        f"{theirs.get('name')}; rename one of them")
    want = desired["metadata"]["annotations"][manifests.ANNOTATION_HASH]
    if live is not None and (live.get("metadata", {}).get("annotations") or {}).get(manifests.ANNOTATION_HASH) == want:
        return "unchanged"
    await client.apply(desired)
    action = "created" if live is None else "updated"
    logger.info(f"{desired['kind']} {desired['metadata']['name']} {action}")
    return action


def _parse(spec: Mapping[str, Any], patch: kopf.Patch, meta: Mapping[str, Any], status: Mapping[str, Any]
           ) -> InferenceDeploymentSpec:
    try:
        return InferenceDeploymentSpec.from_dict(spec)
    except SpecError as exc:
        # Reachable when no webhook guards the API; say so in status rather than retrying forever.
        patch.status.update(invalid_status(str(exc), generation=meta.get("generation"),
                                           previous_conditions=status.get("conditions") or []))
        raise kopf.PermanentError(str(exc)) from exc


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
async def reconcile(body: kopf.Body, spec: kopf.Spec, meta: kopf.Meta, status: kopf.Status, name: str,
                    namespace: str, patch: kopf.Patch, retry: int, memo: kopf.Memo,
                    logger: logging.Logger, **_: Any) -> None:
    with METRICS.reconcile():
        await _reconcile(body, spec, meta, status, name, namespace, patch, retry, memo, logger)


async def _reconcile(body: kopf.Body, spec: kopf.Spec, meta: kopf.Meta, status: kopf.Status, name: str,
                     namespace: str, patch: kopf.Patch, retry: int, memo: kopf.Memo,
                     logger: logging.Logger) -> None:
    config, client = _config(memo), _client(memo)
    parsed = _parse(spec, patch, meta, status)
    resolved = resolve(parsed)
    model = await _resolve_model(parsed, config, patch, meta, status, retry, logger)
    adapters = await _resolve_adapters(parsed, config, model, patch, meta, status, retry, logger)
    desired = manifests.children(body, parsed, image=config.worker_image, monitoring=config.monitoring,
                                 resolved=resolved, model=model, cache=config.model_cache, adapters=adapters,
                                 kv_volume=config.kv_tier)
    try:
        for child in desired:
            await _apply(client, child, logger)
        await _prune(client, desired, name, namespace, config.monitoring, logger)
        deployment = await client.get(path_of(desired[0]))
    except (ApiError, NameTaken) as exc:
        if isinstance(exc, ApiError) and exc.retryable:
            raise kopf.TemporaryError(str(exc), delay=_retry_delay(retry, config)) from exc
        reason = "NameTaken" if isinstance(exc, NameTaken) else "ApplyFailed"
        patch.status.update({"phase": "Degraded", "conditions": [_degraded(reason, str(exc), meta, status)]})
        raise kopf.PermanentError(str(exc)) from exc
    patch.status.update(compute_status(
        name=name, namespace=namespace, desired_replicas=parsed.replicas, resolved=resolved,
        deployment=deployment, generation=meta.get("generation"),
        previous_conditions=status.get("conditions") or [], model=model,
        adapters=[AdapterStatus(name=a.name, version=a.version, sha256=a.sha256) for a in adapters]))


async def _delete_owned(client: KubeClient, stub: Mapping[str, Any], owner: str) -> bool:
    """Delete the object `stub` names if the InferenceDeployment `owner` owns it (never one of
    another, nor one that someone else made under that name); whether it did."""
    path = path_of(stub)
    live = await client.get(path)
    if live is None or not _owned_by(live, owner):
        return False
    await client.delete(path)
    return True


async def _prune(client: KubeClient, desired: list[dict[str, Any]], name: str, namespace: str, monitoring: bool,
                 logger: logging.Logger) -> None:
    """Delete the children `manifests.children` no longer builds: the prefill pool's, once
    spec.disaggregation is turned off."""
    built = {(child["kind"], child["metadata"]["name"]) for child in desired}
    for stub in manifests.possible_children(name, namespace, monitoring=monitoring):
        if (stub["kind"], stub["metadata"]["name"]) not in built and await _delete_owned(client, stub, name):
            logger.info(f"{stub['kind']} {stub['metadata']['name']} deleted (no longer part of the spec)")


async def _resolve_adapters(spec: InferenceDeploymentSpec, config: OperatorConfig, model: ResolvedModel | None,
                            patch: kopf.Patch, meta: Mapping[str, Any], status: Mapping[str, Any], retry: int,
                            logger: logging.Logger) -> tuple[ResolvedAdapter, ...]:
    """spec.adapters as the registry resolves them, each checked to be an adapter of the resolved
    model; one that is unknown, or of another base, is handled as an unresolved model is (a False
    ModelResolved condition, no child touched, another try later)."""
    if not spec.adapters:
        return ()
    try:
        if config.registry is None:
            raise ModelResolutionError("AdapterNotFound", "spec.adapters needs the operator's registry "
                                       "(--registry-url) to resolve adapters")
        found = []
        for ref in spec.adapters:
            adapter = await config.registry.resolve_adapter(ref.name, ref.version)
            adapter.require_base(model)
            found.append(adapter)
        return tuple(found)
    except ModelResolutionError as exc:
        raise _unresolved(exc, "adapters", config, patch, meta, status, retry, logger) from exc


async def _resolve_model(spec: InferenceDeploymentSpec, config: OperatorConfig, patch: kopf.Patch,
                         meta: Mapping[str, Any], status: Mapping[str, Any], retry: int,
                         logger: logging.Logger) -> ResolvedModel | None:
    """The registry entry the spec names, or None (a path, a PVC, a model built into the image, or
    no registry to ask).
    An unknown or unverified model, or one of another kind than the spec's: a False ModelResolved
    condition, no child touched, and another try later (the model may be registered meanwhile)."""
    name, version = spec.model.name, spec.model.version
    if name is None or config.registry is None or (name in BUILTIN_MODELS and version is None):
        return None
    try:
        model = await config.registry.resolve(name, version)
        model.require_kind(spec.kind)
        return model
    except ModelResolutionError as exc:
        raise _unresolved(exc, "model", config, patch, meta, status, retry, logger) from exc


def _unresolved(exc: ModelResolutionError, what: str, config: OperatorConfig, patch: kopf.Patch,
                meta: Mapping[str, Any], status: Mapping[str, Any], retry: int,
                logger: logging.Logger) -> kopf.TemporaryError:
    """The False ModelResolved status for a model or adapters the registry cannot give, and the
    error that retries later (soon while the registry is unreachable)."""
    logger.warning(f"{what} not resolved: {exc.message}")
    patch.status.update(unresolved_model_status(exc, generation=meta.get("generation"),
                                                previous_conditions=status.get("conditions") or []))
    delay = _retry_delay(retry, config) if exc.retryable else config.max_backoff_seconds
    return kopf.TemporaryError(exc.message, delay=delay)


def _degraded(reason: str, message: str, meta: Mapping[str, Any], status: Mapping[str, Any]) -> dict[str, Any]:
    return condition("Degraded", True, reason, message, previous=status.get("conditions") or [],
                     generation=meta.get("generation"))


@kopf.on.event("apps", "v1", "deployments", labels={manifests.LABEL_MANAGED_BY: manifests.MANAGED_BY})
async def child_deployment_changed(type: str | None, body: kopf.Body, namespace: str, memo: kopf.Memo,
                                   logger: logging.Logger, **_: Any) -> None:
    """The workers' readiness moved: bring the owner's status up to date (only if it changed)."""
    object_labels = body.get("metadata", {}).get("labels") or {}
    owner = object_labels.get(manifests.LABEL_DEPLOYMENT)
    # The status follows the decode pool (the replicas that serve); a prefill pool's Deployment is
    # labelled with its own name, which is no InferenceDeployment's.
    if object_labels.get(manifests.LABEL_POOL) == manifests.POOL_PREFILL:
        return
    if not owner or type == "DELETED" or memo.get("client") is None:
        return
    client = _client(memo)
    owner_path = path_for(f"{GROUP}/{VERSION}", PLURAL, namespace, owner)
    parent = await client.get(owner_path)
    if parent is None or parent.get("metadata", {}).get("deletionTimestamp"):
        return
    try:
        parsed = InferenceDeploymentSpec.from_dict(parent.get("spec") or {})
    except SpecError:
        return  # reconcile reports invalid specs
    current = parent.get("status") or {}
    resolved_model = current.get("model")
    new = compute_status(
        name=owner, namespace=namespace, desired_replicas=parsed.replicas, resolved=resolve(parsed),
        deployment=body, generation=parent.get("metadata", {}).get("generation"),
        previous_conditions=current.get("conditions") or [],
        model=ResolvedModel.from_dict(resolved_model) if resolved_model and parsed.model.name else None,
        adapters=[AdapterStatus.model_validate(a) for a in current.get("adapters") or []])
    if any(current.get(key) != value for key, value in new.items()):
        await client.patch_status(owner_path, new)


# ---- deletion -----------------------------------------------------------------------------------

@kopf.on.delete(GROUP, VERSION, PLURAL)
async def finalize(body: kopf.Body, spec: kopf.Spec, name: str, namespace: str, retry: int, memo: kopf.Memo,
                   logger: logging.Logger, **_: Any) -> None:
    """Delete the Deployments first (their pods drain within their grace period), then the rest.

    Owner references would garbage-collect them too; deleting explicitly makes the order certain
    and works where the garbage collector lags.
    """
    config, client = _config(memo), _client(memo)
    try:
        for stub in manifests.possible_children(name, namespace, monitoring=config.monitoring):
            await _delete_owned(client, stub, name)
    except ApiError as exc:
        if exc.retryable:
            raise kopf.TemporaryError(str(exc), delay=_retry_delay(retry, config)) from exc
        raise
    logger.info(f"workers of {namespace}/{name} removed")
