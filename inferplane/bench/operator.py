"""`inferplane bench operator`: how fast the operator settles many InferenceDeployments at once.

Runs the real operator in this process (kopf in a thread of its own, as a separate process would
run it) against the API server of `--kubeconfig`, applies N resources (200 by default) at once to a
fresh namespace, and prints the seconds until every one has all its children and a status phase.
The namespace is deleted afterwards. The server needs the InferenceDeployment CRD and, unless
`--no-monitoring`, the Prometheus operator's ServiceMonitor and PrometheusRule kinds.

`make bench-operator` runs it against the loopback control plane the tests build (kube-apiserver,
etcd and kube-controller-manager from `make envtest`). Not a test: the figure depends on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

CHILD_COLLECTIONS = {  # kind -> collection path in the namespace (format with ns=)
    "Deployment": "/apis/apps/v1/namespaces/{ns}/deployments",
    "Service": "/api/v1/namespaces/{ns}/services",
    "PodDisruptionBudget": "/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets",
    "ServiceMonitor": "/apis/monitoring.coreos.com/v1/namespaces/{ns}/servicemonitors",
    "PrometheusRule": "/apis/monitoring.coreos.com/v1/namespaces/{ns}/prometheusrules",
}
IDEPS = "/apis/inferplane.io/v1alpha1/namespaces/{ns}/inferencedeployments"


def _resource(index: int, namespace: str) -> dict[str, Any]:
    # A mix of the three runtimes, as a real cluster would hold.
    variants = [{"resources": {"gpus": 1}}, {"resources": {"gpus": 1}, "workload": {"agent": True}}, {}]
    return {"apiVersion": "inferplane.io/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": f"model-{index:04d}", "namespace": namespace},
            "spec": {"model": {"name": "smollm2-135m"}, **variants[index % 3]}}


@contextmanager
def running_operator(namespace: str, monitoring: bool) -> Iterator[None]:
    """The operator with its real handlers, standalone, in a thread with its own event loop."""
    import kopf

    import inferplane.operator.handlers  # noqa: F401  (registers the handlers)
    from inferplane.operator.config import OperatorConfig

    stop, ready = threading.Event(), threading.Event()
    failure: list[BaseException] = []
    config = OperatorConfig(post_events=False, monitoring=monitoring, namespaces=(namespace,))

    def run() -> None:
        try:
            asyncio.run(kopf.operator(standalone=True, namespaces=[namespace], memo=kopf.Memo(config=config),
                                      stop_flag=stop, ready_flag=ready))
        except BaseException as exc:  # reported to the caller
            failure.append(exc)

    thread = threading.Thread(target=run, name="kopf-operator", daemon=True)
    thread.start()
    if not ready.wait(120) or failure:
        stop.set()
        raise RuntimeError("the operator did not start") from (failure[0] if failure else None)
    try:
        yield
    finally:
        stop.set()
        thread.join(60)


def _client() -> Any:
    """Our operator's own REST client, with the credentials of $KUBECONFIG."""
    import kopf

    from inferplane.operator.kube import KubeClient

    info = kopf.login_with_kubeconfig(settings=kopf.OperatorSettings())
    if info is None:
        raise SystemExit(f"no credentials in {os.environ.get('KUBECONFIG')}")
    return KubeClient.from_connection_info(info)


async def _bench(count: int, namespace: str, monitoring: bool) -> tuple[float, float]:
    client = _client()
    kinds = [k for k in CHILD_COLLECTIONS if monitoring or k not in ("ServiceMonitor", "PrometheusRule")]
    try:
        started = time.perf_counter()
        await asyncio.gather(*(client.request("POST", IDEPS.format(ns=namespace), body=_resource(i, namespace))
                               for i in range(count)))
        applied = time.perf_counter() - started
        while True:
            await asyncio.sleep(0.25)
            resources = (await client.get(IDEPS.format(ns=namespace)) or {}).get("items") or []
            with_phase = {r["metadata"]["name"] for r in resources if (r.get("status") or {}).get("phase")}
            children = [{c["metadata"]["name"] for c in (await client.get(CHILD_COLLECTIONS[k].format(ns=namespace))
                                                         or {}).get("items") or []} for k in kinds]
            if len(set.intersection(with_phase, *children)) == count:
                return applied, time.perf_counter() - started
    finally:
        await client.close()


async def _namespace(namespace: str, create: bool) -> None:
    client = _client()
    try:
        if create:
            await client.request("POST", "/api/v1/namespaces",
                                 body={"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
        else:
            await client.delete(f"/api/v1/namespaces/{namespace}")
    finally:
        await client.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="inferplane bench operator", description=__doc__.splitlines()[0])
    parser.add_argument("--kubeconfig", default=os.environ.get("KUBECONFIG"), required="KUBECONFIG" not in os.environ,
                        help="the API server to run against (default: $KUBECONFIG)")
    parser.add_argument("--count", type=int, default=200, help="InferenceDeployments to apply (default: %(default)s)")
    parser.add_argument("--namespace", default=f"inferplane-bench-{int(time.time())}",
                        help="created for the run and deleted after it (default: a new name)")
    parser.add_argument("--no-monitoring", action="store_true",
                        help="no ServiceMonitor/PrometheusRule (the server lacks the Prometheus operator's CRDs)")
    args = parser.parse_args(argv)
    monitoring = not args.no_monitoring
    os.environ["KUBECONFIG"] = args.kubeconfig  # kopf's login and ours read it
    asyncio.run(_namespace(args.namespace, create=True))
    try:
        with running_operator(args.namespace, monitoring):
            applied, total = asyncio.run(_bench(args.count, args.namespace, monitoring))
    finally:
        asyncio.run(_namespace(args.namespace, create=False))
    print(f"applied all {args.count} in {applied:.2f} s")
    print(f"{args.count} InferenceDeployments reconciled (children + status) in {total:.2f} s "
          f"({args.count / total:.1f}/s); target < 30 s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
