"""InferenceDeployments added, changed and removed on a running `inferplane up` (the admin API's
`/admin/v1/deployments`, gateway/deployment_control.py).

A change rolls over as a cluster's rolling update does with a surge of every replica: the new
replicas start beside the old ones and join the same endpoint source, so the router sends to old
and new alike; once every new replica serves, the catalog entry is read again from one of them and
the old replicas are retired (out of the router first, then they finish what they have in flight
and exit). A new replica set that never serves leaves the old one serving and the rollout
"stalled", as a failed Deployment rollout leaves its old pods. Deleting takes the model off the
routes at once and drains its replicas.

What is applied is kept in `<home>/deployments/NAME.yaml` and comes back on the next start (beside
the files given on the command line, which win over a kept one of the same name).
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import TYPE_CHECKING, Any

import yaml

from inferplane.api.deployment import SpecError, prefill_pool_name
from inferplane.api.model_resolution import ModelResolutionError
from inferplane.control_plane.errors import InvalidInput, NotFound
from inferplane.local.manifests import API_VERSION, Manifest, check_prefill_pool_names, kept_folder, manifest_of

if TYPE_CHECKING:
    from inferplane.local.platform import LocalPlatform
    from inferplane.local.supervisor import LocalDeployment

log = logging.getLogger(__name__)


def _invalid(exc: SpecError | ModelResolutionError) -> Exception:
    """An apply's refusal as the API answers it: 400 naming the field, or 404 for a missing model."""
    if isinstance(exc, SpecError):
        field = exc.field if exc.field.startswith(("metadata", "kind")) else f"spec.{exc.field}"
        return InvalidInput(str(exc), param=field)
    if exc.reason in ("ModelNotFound", "AdapterNotFound"):
        return NotFound(exc.message)
    return InvalidInput(f"{exc.reason}: {exc.message}", param="spec.model")


class LocalDeploymentControl:
    def __init__(self, platform: LocalPlatform, ready_timeout: float):
        """`ready_timeout`: how long new replicas may take to serve before a rollout is stalled
        (`inferplane up --ready-timeout`, the time the first start gives them)."""
        self.platform = platform
        self.ready_timeout = ready_timeout
        self.rollouts: dict[str, str] = {}  # name -> "progressing", "complete" or "stalled: why"
        # name -> the replica sets its rollouts replaced, serving until a newer set serves in full (a
        # stalled rollout's stay), then retired; a delete retires them with the rest
        self.superseded: dict[str, list[LocalDeployment]] = {}
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()

    # --- reading ---------------------------------------------------------------------------

    def _find(self, name: str) -> Manifest:
        for manifest in self.platform.manifests:
            if manifest.name == name:
                return manifest
        raise NotFound(f"no deployment named {name!r}")

    def _view(self, manifest: Manifest) -> dict[str, Any]:
        running = self.platform.supervisor.deployments.get(manifest.name)
        replicas = running.replicas if running is not None else []
        status = {"servedModel": manifest.spec.served_model_name(manifest.name),
                  "runtime": running.resolved.runtime if running is not None else None,
                  "replicas": len(replicas), "readyReplicas": sum(r.ready for r in replicas),
                  "rollout": self.rollouts.get(manifest.name, "complete")}
        spec = manifest.spec.model_dump(by_alias=True, exclude_defaults=True, mode="json")
        return {"apiVersion": API_VERSION, "kind": "InferenceDeployment", "metadata": {"name": manifest.name},
                "spec": spec, "status": status}

    def list(self) -> list[dict[str, Any]]:
        return [self._view(m) for m in sorted(self.platform.manifests, key=lambda m: m.name)]

    def get(self, name: str) -> dict[str, Any]:
        return self._view(self._find(name))

    # --- changing --------------------------------------------------------------------------

    def _keep(self, name: str, document: dict[str, Any] | None) -> None:
        folder = kept_folder(self.platform.home)
        path = folder / f"{name}.yaml"
        if document is None:
            path.unlink(missing_ok=True)
            return
        folder.mkdir(exist_ok=True)
        partial = path.with_suffix(".partial")
        partial.write_text(yaml.safe_dump(document, sort_keys=False))
        os.replace(partial, path)

    async def apply(self, document: dict[str, Any]) -> dict[str, Any]:
        try:
            manifest = manifest_of(document, "the body")
        except SpecError as exc:
            raise _invalid(exc) from None
        async with self._lock:
            manifests = self.platform.manifests
            index = next((i for i, m in enumerate(manifests) if m.name == manifest.name), None)
            if index is not None and manifests[index].spec == manifest.spec:
                return {**self._view(manifests[index]), "action": "unchanged"}
            others = [m for m in manifests if m.name != manifest.name]
            try:
                check_prefill_pool_names([*others, manifest])
            except SpecError as exc:
                raise _invalid(exc) from None
            old = self.platform.supervisor.take(manifest.name) if index is not None else {}
            try:
                await self.platform.start_deployment(manifest, succeeding=old)
            except (SpecError, ModelResolutionError) as exc:
                self.platform.supervisor.deployments.update(old)  # the running replicas stay as they were
                raise _invalid(exc) from None
            except Exception:
                self.platform.supervisor.deployments.update(old)
                raise
            if index is None:
                manifests.append(manifest)
            else:
                manifests[index] = manifest
            self._keep(manifest.name, {"apiVersion": API_VERSION, "kind": "InferenceDeployment",
                                       "metadata": {"name": manifest.name}, "spec": document.get("spec")})
            self.platform.sync_routes()
            if old:
                self.superseded.setdefault(manifest.name, []).extend(old.values())
                self.rollouts[manifest.name] = "progressing"
                self._track(self._finish_rollout(manifest.name))
            log.info("deployment %s %s", manifest.name, "configured" if old else "created")
            return {**self._view(manifest), "action": "configured" if index is not None else "created"}

    async def delete(self, name: str) -> dict[str, Any]:
        async with self._lock:
            manifest = self._find(name)
            self.platform.manifests.remove(manifest)
            self._keep(name, None)
            taken = self.platform.supervisor.take(name)
            self.platform.sync_routes()  # off the routes before the replicas are told to drain
            self.platform.supervisor.retire([*taken.values(), *self.superseded.pop(name, [])])
            self.rollouts.pop(name, None)
            view = self._view(manifest)
            log.info("deployment %s deleted", name)
            return {**view, "action": "deleted"}

    def _track(self, coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _finish_rollout(self, name: str) -> None:
        """Retires what `name`'s rollouts replaced once every replica of its current set serves; if
        none does within the ready timeout, the rollout is stalled and the replaced sets serve on
        (a later apply, or a delete, settles them)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.ready_timeout
        supervisor = self.platform.supervisor
        while True:
            current = supervisor.deployments.get(name)
            if current is None:
                return  # deleted meanwhile: the delete retired everything
            members = [current, *(d for d in supervisor.deployments.values() if d.owner == name)]
            if all(r.ready for d in members for r in d.replicas):
                break
            if loop.time() > deadline:
                problems = "; ".join(p for p in supervisor.failed_to_start()
                                     if p.startswith((f"{name}[", f"{prefill_pool_name(name)}["))) \
                    or "no replica served in time"
                self.rollouts[name] = f"stalled: {problems}"
                log.warning("deployment %s: rollout stalled, the old replicas keep serving: %s", name, problems)
                return
            await asyncio.sleep(0.25)
        ready = next((r for r in current.replicas if r.ready), None)
        if ready is not None:
            await self.platform.publish(current, ready)  # the entry as the new replicas serve it
        supervisor.retire(self.superseded.pop(name, []))
        self.rollouts[name] = "complete"
        log.info("deployment %s: rollout complete", name)
