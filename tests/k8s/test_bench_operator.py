"""`inferplane bench operator` still runs (against the session's real API server, a few resources)."""

from __future__ import annotations

import pytest

from inferplane.bench import operator as bench
from tests.k8s.cluster import Cluster


def test_operator_bench_settles_every_resource_and_cleans_up(
        crds: Cluster, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KUBECONFIG", str(crds.admin_kubeconfig))  # the bench sets it; restored after
    assert bench.main(["--kubeconfig", str(crds.admin_kubeconfig), "--count", "6", "--namespace", "bench-test"]) == 0
    assert "6 InferenceDeployments reconciled (children + status) in" in capsys.readouterr().out
    namespace = crds.get("/api/v1/namespaces/bench-test")
    assert namespace is None or namespace["metadata"].get("deletionTimestamp")  # deleted (or being deleted)
