"""`inferplane bench operator`: how fast the operator settles many InferenceDeployments at once.

Applies N resources (200 by default) concurrently to the in-memory test API with the real
operator running, and prints the seconds until every one has all its children and a status.
Not a test: the figure depends on the machine. Needs the test dependencies (kmock, cel-python).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

NAMESPACE = "bench"


def _resource(index: int) -> dict[str, Any]:
    # A mix of the three runtimes, as a real cluster would hold.
    variants = [{"resources": {"gpus": 1}}, {"resources": {"gpus": 1}, "workload": {"agent": True}}, {}]
    return {"apiVersion": "inferplane.io/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": f"model-{index:04d}", "namespace": NAMESPACE},
            "spec": {"model": {"name": "smollm2-135m"}, **variants[index % 3]}}


async def _bench(count: int, webhook: bool) -> float:
    from inferplane.operator.config import OperatorConfig, WebhookConfig
    from inferplane.operator.fakeapi import fake_cluster, running_operator

    kinds = ["apps/v1/deployments", "v1/services", "policy/v1/poddisruptionbudgets",
             "monitoring.coreos.com/v1/servicemonitors", "monitoring.coreos.com/v1/prometheusrules"]
    hook = WebhookConfig(addr="127.0.0.1", host="127.0.0.1", port=0, insecure=True) if webhook else None
    config = OperatorConfig(post_events=False, webhook=hook)
    async with fake_cluster([NAMESPACE], record_requests=False) as (api, _url, kubeconfig), \
            running_operator(api, kubeconfig, config, namespaces=[NAMESPACE]):
        path = f"/apis/inferplane.io/v1alpha1/namespaces/{NAMESPACE}/inferencedeployments"

        async def create(index: int) -> None:
            async with api.clients[0].post(path, json=_resource(index)) as response:
                if response.status >= 300:
                    raise RuntimeError(await response.text())

        def settled(name: str) -> bool:
            obj = api.peek("inferplane.io/v1alpha1/inferencedeployments", NAMESPACE, name)
            return bool(obj is not None and (obj.get("status") or {}).get("phase")
                        and all(api.peek(kind, NAMESPACE, name) is not None for kind in kinds))

        started = time.perf_counter()
        await asyncio.gather(*(create(i) for i in range(count)))
        applied = time.perf_counter() - started
        pending = [f"model-{i:04d}" for i in range(count)]
        while pending:
            await asyncio.sleep(0.2)
            pending = [name for name in pending if not settled(name)]
        total = time.perf_counter() - started
        print(f"applied all {count} in {applied:.2f} s", flush=True)
        return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="inferplane bench operator", description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=200, help="InferenceDeployments to apply (default: %(default)s)")
    parser.add_argument("--no-webhook", action="store_true", help="skip the admission webhook round-trip")
    args = parser.parse_args(argv)
    seconds = asyncio.run(_bench(args.count, webhook=not args.no_webhook))
    print(f"{args.count} InferenceDeployments reconciled (children + status) in {seconds:.2f} s "
          f"({args.count / seconds:.1f}/s); target < 30 s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
