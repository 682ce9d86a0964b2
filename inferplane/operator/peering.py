"""Say why a peered operator does nothing, and how to fix it.

With a peering name, kopf pauses every watch until its peering object exists (a `KopfPeering` in
each watched namespace, or one `ClusterKopfPeering` with --all-namespaces), and it says so only at
debug level. The Helm chart creates the object; anybody who starts the operator another way would
wait in silence. So the operator looks for the object itself after login and, while it is missing,
logs a warning that names what is missing and the command that creates it (or --standalone).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Iterable

from inferplane.operator.kube import ApiError, KubeClient

CRD_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{plural}.kopf.dev"
RECHECK_SECONDS = 60.0


def _object_path(name: str, namespace: str | None) -> str:
    if namespace is None:
        return f"/apis/kopf.dev/v1/clusterkopfpeerings/{name}"
    return f"/apis/kopf.dev/v1/namespaces/{namespace}/kopfpeerings/{name}"


def _concrete(namespaces: Iterable[str]) -> list[str]:
    """Namespaces given by name; glob patterns cannot be checked before kopf expands them."""
    return [ns for ns in namespaces if not any(ch in ns for ch in "*?[]!,")]


async def missing_peerings(client: KubeClient, name: str, namespaces: Iterable[str], clusterwide: bool
                           ) -> list[str]:
    """What kopf waits for and does not find: the peering CRD, or the peering object per namespace."""
    plural = "clusterkopfpeerings" if clusterwide else "kopfpeerings"
    if await client.get(CRD_PATH.format(plural=plural)) is None:
        return [f"the CustomResourceDefinition {plural}.kopf.dev"]
    targets: list[str | None] = [None] if clusterwide else list(_concrete(namespaces))
    missing = []
    for namespace in targets:
        if await client.get(_object_path(name, namespace)) is None:
            missing.append(f"ClusterKopfPeering {name}" if namespace is None else f"KopfPeering {namespace}/{name}")
    return missing


def explanation(name: str, missing: list[str], namespaces: Iterable[str], clusterwide: bool) -> str:
    """One log line: what is missing, what it means, and the commands that fix it."""
    kind = "ClusterKopfPeering" if clusterwide else "KopfPeering"
    body = json.dumps({"apiVersion": "kopf.dev/v1", "kind": kind, "metadata": {"name": name}})
    if any("CustomResourceDefinition" in what for what in missing):
        fix = "install the CRD with `kubectl apply -f deploy/crds/kopf.dev_peerings.yaml`, then create the peering"
    else:
        fix = "create it"
    where = [""] if clusterwide else [f" -n {ns}" for ns in _concrete(namespaces)]
    commands = "; ".join(f"kubectl create{ns} -f - <<< '{body}'" for ns in where)
    return (f"kopf peering {name!r} is missing ({', '.join(missing)}): the operator is paused and reconciles "
            f"nothing until it exists. To fix, {fix}: {commands} -- or run a single replica without peering: "
            f"`inferplane operator --standalone`.")


async def report_missing_peering(client: Callable[[], KubeClient], name: str, namespaces: Iterable[str],
                                 clusterwide: bool, logger: logging.Logger, recheck: float = RECHECK_SECONDS
                                 ) -> None:
    """Warn while the peering is missing (every `recheck` seconds); say so once it appears.

    `client` is asked for the current client at every check: a re-login replaces it.
    """
    namespaces = list(namespaces)
    warned = False
    while True:
        try:
            missing = await missing_peerings(client(), name, namespaces, clusterwide)
        except ApiError as exc:
            logger.warning(f"could not check the kopf peering {name!r}: {exc}")
            missing = None
        if missing == []:
            if warned:
                logger.info(f"kopf peering {name!r} found: the operator resumes")
            return
        if missing:
            logger.warning(explanation(name, missing, namespaces, clusterwide))
            warned = True
        await asyncio.sleep(recheck)
