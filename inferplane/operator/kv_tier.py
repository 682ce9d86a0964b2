"""Where a worker pod's KV disk tier (engine.kvOffloadDisk) lives, and so how long it lasts.

- By default an emptyDir per pod, of the tier's size (requested as ephemeral storage, so the
  scheduler places the pod where the disk is): it outlives a worker process that crashed (the
  container restarts onto it), not the pod.
- With the operator's `--kv-tier-host-path` (a node's directory) or `--kv-tier-pvc` (a claim), a
  folder per InferenceDeployment there: it outlives the pod, so after a pod deletion, a rollout or
  scale to zero and back, the next pod of that deployment on the node finds its predecessors'
  blocks, indexes them at start and announces them in its KV events. The tier's files are checked
  against the model digest and KV layout on every read (worker/engine/kv/tiers/), so blocks of an
  older version are misses, never wrong KV.
  Pods of one deployment on one node share its folder (a rollout's new pod starts beside the old
  one): files are written whole and renamed into place, so they never see half a block, and each
  keeps its own size accounting, so the folder holds at most the tier's size per pod running there.
  Like the model cache's, the host path must exist on each node owned by uid 10001.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from inferplane.api.deployment import InferenceDeploymentSpec
from inferplane.api.quantities import parse_bytes

KV_TIER_DIR = "/var/cache/inferplane/kv"  # where the volume is mounted in the worker container
VOLUME = "kv-tier"


@dataclass(frozen=True)
class KVTierVolume:
    """The operator's choice for every deployment with a KV disk tier: `host_path` or `claim`, else
    an emptyDir per pod."""

    host_path: str | None = None
    claim: str | None = None

    @property
    def outlives_pods(self) -> bool:
        return bool(self.host_path or self.claim)

    def volume(self, spec: InferenceDeploymentSpec) -> dict[str, Any]:
        if self.claim:
            return {"name": VOLUME, "persistentVolumeClaim": {"claimName": self.claim}}
        if self.host_path:
            # Directory, not DirectoryOrCreate: one kubelet creates would be root's, unwritable by the pod.
            return {"name": VOLUME, "hostPath": {"path": self.host_path, "type": "Directory"}}
        # The tier keeps its files within its size; sizeLimit evicts a pod that would not. The limit
        # has a tenth more room: a file is written before the tier evicts for it.
        return {"name": VOLUME, "emptyDir": {"sizeLimit": str(int(quantity(spec)) * 11 // 10)}}

    def directory(self, namespace: str, name: str) -> str:
        """The worker's --kv-offload-dir: the mount itself for a pod's own emptyDir, else the
        deployment's folder in the shared volume (the worker creates it, as uid 10001)."""
        return f"{KV_TIER_DIR}/{namespace}/{name}" if self.outlives_pods else KV_TIER_DIR

    def ephemeral_storage(self, spec: InferenceDeploymentSpec) -> str | None:
        """What the worker container requests as ephemeral storage for the tier (emptyDir only: a
        host path or a claim is not the node's ephemeral storage)."""
        return None if self.outlives_pods else quantity(spec)


def quantity(spec: InferenceDeploymentSpec) -> str:
    """engine.kvOffloadDisk (a byte size like 20GiB) as a Kubernetes quantity, in bytes."""
    return str(parse_bytes(spec.engine.kv_offload_disk or "0"))
