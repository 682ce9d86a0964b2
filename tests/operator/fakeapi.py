"""An in-memory Kubernetes API for tests and the benchmark: kmock, with the gaps that kopf meets filled.

kmock 0.8's `KubernetesEmulator` stores objects, serves list/watch/get/create/patch/delete and
honours finalizers. A real API server does more, and the operator relies on some of it; this
subclass adds, in the order a request meets them:

* the namespaces resource (kopf waits for its namespace; kmock's path parser trips on
  `/api/v1/namespaces`), served from a fixed list;
* `metadata.generateName` (kopf posts Events with it);
* server-side apply: an apply-patch to a missing object creates it (kmock merges patches, so an
  apply to an existing object is a JSON merge);
* the status and scale subresources: a patch to the main resource cannot change status, a
  patch to /status changes only status; GET/PATCH of /scale reads and writes spec.replicas;
* CRD behaviour for InferenceDeployments: structural defaults, openAPIV3Schema and CEL
  validation (tests.operator.crd), then validating admission webhooks read from the
  ValidatingWebhookConfiguration objects kopf manages, called over HTTP as the API server would;
* uid, resourceVersion, generation (bumped when spec changes) and creationTimestamp;
* 422 (not 500) when a JSON-patch `test` operation fails;
* background garbage collection of objects whose owner (by uid) is gone.

What is still missing is listed in deploy/TESTING.md. kmock and cel-python are test dependencies.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import functools
import json
import re
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import aiohttp.test_utils
import aiohttp.web
import attrs
import jsonpatch
import kmock
import yaml
from kmock._internal import dicts as kmock_dicts

from inferplane.api.deployment import GROUP, KIND, PLURAL, VERSION
from tests.operator import crd

IDEP = kmock.resource(group=GROUP, version=VERSION, plural=PLURAL)
WEBHOOK_CONFIGS = kmock.resource(group="admissionregistration.k8s.io", version="v1",
                                 plural="validatingwebhookconfigurations")
_NAMESPACES_PATH = re.compile(r"^/api/v1/namespaces/?(?P<name>[^/]+)?/?$")

# (group/version/plural, kind, namespaced, subresources) of everything the operator reads or writes.
RESOURCES: list[tuple[str, str, bool, set[str]]] = [
    (f"{GROUP}/{VERSION}/{PLURAL}", KIND, True, {"status", "scale"}),
    ("apps/v1/deployments", "Deployment", True, {"status", "scale"}),
    ("v1/services", "Service", True, {"status"}),
    ("v1/namespaces", "Namespace", False, set()),  # discovery only: __call__ serves the paths
    ("v1/events", "Event", True, set()),
    ("v1/pods", "Pod", True, {"status"}),
    ("policy/v1/poddisruptionbudgets", "PodDisruptionBudget", True, {"status"}),
    ("monitoring.coreos.com/v1/servicemonitors", "ServiceMonitor", True, set()),
    ("monitoring.coreos.com/v1/prometheusrules", "PrometheusRule", True, set()),
    ("admissionregistration.k8s.io/v1/validatingwebhookconfigurations", "ValidatingWebhookConfiguration", False,
     set()),
    ("apiextensions.k8s.io/v1/customresourcedefinitions", "CustomResourceDefinition", False, set()),
    ("kopf.dev/v1/kopfpeerings", "KopfPeering", True, set()),
    ("kopf.dev/v1/clusterkopfpeerings", "ClusterKopfPeering", False, set()),
]


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _failure(status: int, reason: str, message: str) -> kmock.KubernetesError:
    return kmock.KubernetesError(status=status, reason=reason, message=message, details={})


@attrs.define(kw_only=True)
class FakeApiServer(kmock.KubernetesEmulator):
    """kmock's emulator plus the API-server behaviour listed in the module docstring."""

    namespaces: list[str] = attrs.field(factory=lambda: ["default"])
    validate_custom_resources: bool = True
    # kmock keeps every request for assertions and matches each new one by scanning them all,
    # which is quadratic; the benchmark turns recording off (tests keep it to inspect writes).
    record_requests: bool = True
    _version: int = attrs.field(default=0, init=False)
    _guard: asyncio.Lock = attrs.field(factory=asyncio.Lock, init=False)
    _admission: aiohttp.ClientSession | None = attrs.field(default=None, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for key, kind, namespaced, subresources in RESOURCES:
            self.resources[key] = kmock.ResourceInfo(
                kind=kind, namespaced=namespaced, subresources=subresources,
                verbs={"get", "list", "watch", "create", "patch", "delete"})

    async def __aexit__(self, *exc: Any) -> None:
        if self._admission is not None:
            await self._admission.close()
            self._admission = None
        await super().__aexit__(*exc)

    # ---- raw HTTP: what kmock cannot parse -------------------------------------------------------

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        match = _NAMESPACES_PATH.match(raw_request.path)
        if match and raw_request.method == "GET":
            return await self._serve_namespaces(raw_request, match.group("name"))
        try:
            return await super().__call__(raw_request)
        finally:
            if not self.record_requests:
                self._requests[:] = [r for r in self._requests if r._raw_request is not raw_request]

    def _namespace_object(self, name: str) -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "Namespace",
                "metadata": {"name": name, "uid": f"ns-{name}", "resourceVersion": "1"},
                "status": {"phase": "Active"}}

    async def _serve_namespaces(self, raw: aiohttp.web.BaseRequest, name: str | None) -> aiohttp.web.StreamResponse:
        if name is not None:
            if name not in self.namespaces:
                return aiohttp.web.json_response({"kind": "Status", "code": 404, "reason": "NotFound"}, status=404)
            return aiohttp.web.json_response(self._namespace_object(name))
        items = [self._namespace_object(ns) for ns in self.namespaces]
        if raw.query.get("watch") != "true":
            return aiohttp.web.json_response({"kind": "NamespaceList", "apiVersion": "v1",
                                              "metadata": {"resourceVersion": "1"}, "items": items})
        response = aiohttp.web.StreamResponse()
        await response.prepare(raw)
        for item in items:
            await response.write(json.dumps({"type": "ADDED", "object": item}).encode() + b"\n")
        with contextlib.suppress(asyncio.CancelledError, ConnectionError):
            await asyncio.Event().wait()  # namespaces never change here; hold the watch open
        return response

    async def _serve_list(self, request: kmock.Request) -> Any:
        """kmock's list, stamped with the current resourceVersion so that a watch can start from it."""
        payload = await super()._serve_list(request)
        payload["metadata"]["resourceVersion"] = str(self._version)
        return payload

    async def _serve_watch(self, request: kmock.Request) -> AsyncIterator[Any]:  # type: ignore[override]
        """A watch that starts after ?resourceVersion= (kmock replays everything) and is subscribed
        before its snapshot, so that a write between the two is never lost."""
        yield b""
        assert request.resource is not None
        since = int(request.params.get("resourceVersion") or 0) if \
            str(request.params.get("resourceVersion") or "0").isdigit() else 0

        def newer(obj: Mapping[str, Any]) -> bool:
            version = str((obj.get("metadata") or {}).get("resourceVersion") or "0")
            return not version.isdigit() or int(version) > since

        bus = self._buses[request.resource]
        marker = await bus.mark()
        try:
            async with self._lock:
                events = [{"type": "ADDED", "object": obj.raw} for (res, ns, _), obj in list(self._objects.items())
                          if res == request.resource and not obj.deleted and newer(obj.raw)
                          and (request.namespace is None or ns == request.namespace)]
            for event in events:
                yield event
            async for event in bus.stream(since=marker):
                obj = event.get("object") or {}
                namespace = obj.get("metadata", {}).get("namespace")
                if (request.namespace is None or namespace == request.namespace) and (
                        event.get("type") == "DELETED" or newer(obj)):
                    yield event
        finally:
            await bus.unmark(marker)

    # ---- parsed requests: API-server semantics --------------------------------------------------

    def _stored(self, resource: Any, namespace: str | None, name: str | None) -> Any | None:
        key = (resource, namespace, name)
        if name is None or key not in self._objects or self._objects[key].deleted:
            return None
        return self._objects[key]

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        if request.resource is None or request.action not in (kmock.action.CREATE, kmock.action.UPDATE,
                                                              kmock.action.DELETE, kmock.action.FETCH):
            return await super()._handle(request)
        if request.subresource == "scale":
            request = await self._scale(request)
            if request.action == kmock.action.FETCH:
                return aiohttp.web.json_response(self._scale_object(request))
        if request.action == kmock.action.FETCH:
            return await super()._handle(request)
        if request.action == kmock.action.CREATE and isinstance(request.data, dict):
            request = self._with_generated_name(request)
        # Admission runs before the object is stored, and outside the state lock: a webhook may be slow.
        if request.resource == IDEP and request.subresource is None and request.action != kmock.action.DELETE:
            await self._admit(request)
        async with self._guard:
            request, owner_uid = self._prepare_write(request)
            response = await super()._handle(request)
            await self._collect_garbage(request, owner_uid)
        return response

    def _evolve(self, request: kmock.Request, **changes: Any) -> kmock.Request:
        """A changed copy of a request that kmock's views still see (they find requests by identity)."""
        new = attrs.evolve(request, **changes)
        for index, seen in enumerate(self._requests):
            if seen is request:
                self._requests[index] = new
        return new

    def _with_generated_name(self, request: kmock.Request) -> kmock.Request:
        meta = request.data.get("metadata") or {}
        if meta.get("name") or not meta.get("generateName"):
            return request
        data = copy.deepcopy(request.data)
        data["metadata"]["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        return self._evolve(request, data=data)

    def _prepare_write(self, request: kmock.Request) -> tuple[kmock.Request, str | None]:
        """Stamp metadata, enforce subresource boundaries, turn an apply to a missing object into a create."""
        stored = self._stored(request.resource, request.namespace, request.name)
        self._version += 1
        version = str(self._version)
        if request.action == kmock.action.DELETE:
            return request, (stored.get("metadata", {}).get("uid") if stored is not None else None)
        if request.action == kmock.action.UPDATE and stored is None and "apply-patch" in \
                request.headers.get("Content-Type", ""):
            request = self._evolve(request, action=kmock.action.CREATE, method=kmock.method.POST)
        if request.action == kmock.action.CREATE:
            data = copy.deepcopy(request.data)
            data.pop("status", None) if request.resource == IDEP else None
            meta = data.setdefault("metadata", {})
            meta.setdefault("namespace", request.namespace) if request.namespace else None
            meta.update(uid=str(uuid.uuid4()), resourceVersion=version, generation=1, creationTimestamp=_now())
            return self._evolve(request, data=data), None
        # UPDATE (merge or JSON patch) of an existing object.
        if stored is None:
            return request, None
        current = dict(stored.raw)
        data = request.data
        if isinstance(data, list):
            try:
                merged = jsonpatch.apply_patch(copy.deepcopy(current), data)
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
                raise _failure(422, "Invalid", f"the JSON patch cannot be applied: {exc}") from exc
        else:
            data = copy.deepcopy(data or {})
            if request.subresource == "status":
                data = {"status": data.get("status", {})}
            elif request.subresource is None and self._has_status_subresource(request.resource):
                data.pop("status", None)
            merged = kmock_dicts.merge_patch_dict(current, data)
        stamp: dict[str, Any] = {"resourceVersion": version}
        if request.subresource is None and merged.get("spec") != current.get("spec"):
            stamp["generation"] = int(current.get("metadata", {}).get("generation") or 0) + 1
        if isinstance(data, list):
            data = data + [{"op": "add", "path": f"/metadata/{k}", "value": v} for k, v in stamp.items()]
        else:
            data = kmock_dicts.merge_patch_dict(data, {"metadata": stamp})
        return self._evolve(request, data=data), None

    def _has_status_subresource(self, resource: Any) -> bool:
        for key, _, _, subresources in RESOURCES:
            if kmock.resource(key) == resource:
                return "status" in subresources
        return False

    # ---- scale subresource ----------------------------------------------------------------------

    async def _scale(self, request: kmock.Request) -> kmock.Request:
        stored = self._stored(request.resource, request.namespace, request.name)
        if stored is None:
            raise kmock.KubernetesObjectNotFoundError()
        if request.action != kmock.action.UPDATE:
            return request
        replicas = ((request.data or {}).get("spec") or {}).get("replicas")
        if not isinstance(replicas, int) or isinstance(replicas, bool):
            raise _failure(422, "Invalid", "Scale.spec.replicas must be an integer")
        return self._evolve(request, subresource=None, data={"spec": {"replicas": replicas}})

    def _scale_object(self, request: kmock.Request) -> dict[str, Any]:
        obj = self._stored(request.resource, request.namespace, request.name)
        assert obj is not None
        meta = obj.get("metadata", {})
        return {"apiVersion": "autoscaling/v1", "kind": "Scale",
                "metadata": {"name": meta.get("name"), "namespace": meta.get("namespace"), "uid": meta.get("uid"),
                             "resourceVersion": meta.get("resourceVersion")},
                "spec": {"replicas": obj.get("spec", {}).get("replicas")},
                "status": {"replicas": (obj.get("status") or {}).get("replicas", 0),
                           "selector": (obj.get("status") or {}).get("selector", "")}}

    # ---- admission: schema, CEL, webhooks -------------------------------------------------------

    async def _admit(self, request: kmock.Request) -> None:
        stored = self._stored(request.resource, request.namespace, request.name)
        old = dict(stored.raw) if stored is not None else None
        if request.action == kmock.action.CREATE:
            new = copy.deepcopy(request.data)
        elif old is None:
            return  # kmock answers 404
        elif isinstance(request.data, list):
            try:
                new = jsonpatch.apply_patch(copy.deepcopy(old), request.data)
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException):
                return  # _prepare_write answers 422
        else:
            new = kmock_dicts.merge_patch_dict(old, {k: v for k, v in request.data.items() if k != "status"})
        if old is not None and new.get("spec") == old.get("spec"):
            return  # metadata-only changes (finalizers, annotations) need no spec validation
        name = (new.get("metadata") or {}).get("name")
        if self.validate_custom_resources:
            defaulted, errors = crd.validate({k: v for k, v in new.items() if k != "status"})
            if errors:
                raise _failure(422, "Invalid", f'{KIND}.{GROUP} "{name}" is invalid: ' + "; ".join(errors))
            if request.action == kmock.action.CREATE:
                request.data.clear()
                request.data.update(defaulted)
            new = defaulted
        await self._call_webhooks(request, new, old)

    def _webhooks(self, operation: str) -> Iterable[Mapping[str, Any]]:
        for (resource, _, _), obj in list(self._objects.items()):
            if resource != WEBHOOK_CONFIGS or obj.deleted:
                continue
            for hook in obj.get("webhooks") or []:
                for rule in hook.get("rules") or []:
                    if GROUP in rule.get("apiGroups", []) and PLURAL in rule.get("resources", []) and \
                            (operation in rule.get("operations", []) or "*" in rule.get("operations", [])):
                        yield hook
                        break

    async def _call_webhooks(self, request: kmock.Request, new: dict[str, Any], old: dict[str, Any] | None) -> None:
        operation = "CREATE" if request.action == kmock.action.CREATE else "UPDATE"
        for hook in self._webhooks(operation):
            url = (hook.get("clientConfig") or {}).get("url")
            if not url:
                continue  # a Service-based client config cannot be dialled from here
            review = {
                "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                "request": {
                    "uid": str(uuid.uuid4()),
                    "kind": {"group": GROUP, "version": VERSION, "kind": KIND},
                    "resource": {"group": GROUP, "version": VERSION, "resource": PLURAL},
                    "requestKind": {"group": GROUP, "version": VERSION, "kind": KIND},
                    "requestResource": {"group": GROUP, "version": VERSION, "resource": PLURAL},
                    "name": (new.get("metadata") or {}).get("name"), "namespace": request.namespace,
                    "operation": operation, "userInfo": {"username": "fakeapi"},
                    "object": new, "oldObject": old, "dryRun": False, "options": None,
                },
            }
            if self._admission is None:
                self._admission = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
            try:
                async with self._admission.post(url, json=review) as answer:
                    body = await answer.json()
            except (aiohttp.ClientError, TimeoutError) as exc:
                if hook.get("failurePolicy") == "Ignore":
                    continue
                raise _failure(500, "InternalError", f'failed calling webhook "{hook.get("name")}": {exc}') from exc
            response = body.get("response") or {}
            if not response.get("allowed"):
                status = response.get("status") or {}
                raise _failure(int(status.get("code") or 400), "Forbidden" if status.get("code") == 403 else "Invalid",
                               f'admission webhook "{hook.get("name")}" denied the request: '
                               f'{status.get("message") or "(no message)"}')

    # ---- garbage collection ---------------------------------------------------------------------

    async def _collect_garbage(self, request: kmock.Request, owner_uid: str | None) -> None:
        """After an owner is gone, delete what it owned (background propagation), recursively."""
        key = (request.resource, request.namespace, request.name)
        if request.name is None or key not in self._objects or not self._objects[key].deleted:
            return
        owner_uid = owner_uid or self._objects[key].last.get("metadata", {}).get("uid")
        pending = [owner_uid] if owner_uid else []
        while pending:
            uid = pending.pop()
            for (resource, _, _), obj in list(self._objects.items()):
                if obj.deleted:
                    continue
                refs = obj.get("metadata", {}).get("ownerReferences") or []
                if any(ref.get("uid") == uid for ref in refs):
                    raw = obj.raw
                    obj.delete()
                    await self._buses[resource].put({"type": "DELETED", "object": raw})
                    pending.append(raw.get("metadata", {}).get("uid"))

    # ---- conveniences for tests -----------------------------------------------------------------

    def get(self, plural_key: str, namespace: str | None, name: str) -> dict[str, Any] | None:  # type: ignore[override]
        obj = self._stored(kmock.resource(plural_key), namespace, name)
        return None if obj is None else copy.deepcopy(dict(obj.raw))

    def peek(self, plural_key: str, namespace: str | None, name: str) -> Any | None:
        """The stored object without a copy (read-only use; cheap enough to poll)."""
        return self._stored(kmock.resource(plural_key), namespace, name)

    def alive(self, plural_key: str, namespace: str | None = None) -> list[dict[str, Any]]:
        res = kmock.resource(plural_key)
        return [copy.deepcopy(dict(obj.raw)) for (r, ns, _), obj in list(self._objects.items())
                if r == res and not obj.deleted and (namespace is None or ns == namespace)]


def write_kubeconfig(url: str, directory: Path) -> Path:
    """A kubeconfig for the fake API; kopf's login_with_kubeconfig and kubectl-like tools read it."""
    path = directory / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": url.rstrip("/")}}],
        "users": [{"name": "fake", "user": {"token": "fake-token"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": "default"}}],
    }))
    return path


@contextlib.asynccontextmanager
async def fake_cluster(namespaces: Iterable[str] = ("default",), *, record_requests: bool = True
                       ) -> AsyncIterator[tuple[FakeApiServer, str, Path]]:
    """Run the fake API on a local port; yields (api, base URL, kubeconfig path)."""
    with tempfile.TemporaryDirectory(prefix="inferplane-fakeapi-") as tmp:
        # handler_cancellation: a watch whose client went away ends, as on a real server; otherwise
        # its handler task lives on and kopf, sharing this event loop, waits for it at shutdown.
        server_cls = functools.partial(aiohttp.test_utils.RawTestServer, handler_cancellation=True)
        # Likewise, the test client closes its connections, so no keep-alive handler outlives a request.
        def client_fct(url: Any) -> aiohttp.ClientSession:
            return aiohttp.ClientSession(url, connector=aiohttp.TCPConnector(force_close=True))

        async with FakeApiServer(namespaces=list(namespaces), record_requests=record_requests) as api, \
                kmock.Server(api, server_cls=server_cls, client_fct=client_fct) as server:
            url = str(server.url).rstrip("/")
            yield api, url, write_kubeconfig(url, Path(tmp))


@contextlib.asynccontextmanager
async def running_operator(api: FakeApiServer, kubeconfig: Path, config: Any, *, namespaces: Iterable[str],
                           timeout: float = 30) -> AsyncIterator[None]:
    """Run the real kopf operator (inferplane.operator.handlers) against `api`, in a thread of its own.

    A thread with its own event loop, as a separate process would have: kopf then waits at
    shutdown only for its own tasks, never for the fake API's. Sets $KUBECONFIG for kopf's login
    while it runs. When the config has a webhook, waits until kopf has registered it, so that
    admission applies from the first request on.
    """
    import os
    import threading

    import kopf

    import inferplane.operator.handlers  # noqa: F401  (registers the handlers)

    previous = os.environ.get("KUBECONFIG")
    os.environ["KUBECONFIG"] = str(kubeconfig)
    stop, ready = threading.Event(), threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(kopf.operator(standalone=True, namespaces=list(namespaces), memo=kopf.Memo(config=config),
                                      stop_flag=stop, ready_flag=ready))
        except BaseException as exc:  # surfaced to the caller below
            failure.append(exc)

    thread = threading.Thread(target=run, name="kopf-operator", daemon=True)
    thread.start()
    loop = asyncio.get_running_loop()
    try:
        deadline = loop.time() + timeout
        while not ready.is_set() or (getattr(config, "webhook", None) is not None and not any(api._webhooks("CREATE"))):
            if failure or not thread.is_alive():
                raise RuntimeError("the operator stopped during start-up") from (failure[0] if failure else None)
            if loop.time() > deadline:
                raise TimeoutError("the operator did not become ready")
            await asyncio.sleep(0.05)
        yield
    finally:
        stop.set()
        await asyncio.to_thread(thread.join, timeout)
        if previous is None:
            os.environ.pop("KUBECONFIG", None)
        else:
            os.environ["KUBECONFIG"] = previous
