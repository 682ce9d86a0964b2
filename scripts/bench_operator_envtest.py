#!/usr/bin/env python3
"""`make bench-operator`: `inferplane bench operator` against the loopback control plane the tests
build (etcd, kube-apiserver and kube-controller-manager from `make envtest`), CRDs installed."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from inferplane.bench import operator as bench  # noqa: E402
from tests.k8s.cluster import install_crds, missing_binaries, running_cluster  # noqa: E402


def main() -> int:
    reason = missing_binaries()
    if reason:
        print(f"bench operator: {reason}", file=sys.stderr)
        return 1
    with running_cluster() as cluster:
        install_crds(cluster)
        print(f"Kubernetes {cluster.version} on {cluster.server}", flush=True)
        return bench.main(["--kubeconfig", str(cluster.admin_kubeconfig), *sys.argv[1:]])


if __name__ == "__main__":
    raise SystemExit(main())
