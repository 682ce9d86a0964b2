"""`inferplane up` with two deployments behind one served name, one `cacheIsolation: shared` and one
`tenant`: the stricter wins, so tenants never share a prefix cache (whichever replica is ready first).

The shared deployment is the primary (it takes the traffic); before the rule was one function, local
mode took the isolation of whichever deployment's replica became ready first and could share.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from inferplane.bench.tiny_model import make_tiny_model
from tests.e2e.isolation import assert_tenants_do_not_share_the_prefix_cache
from tests.worker.test_worker_process import free_port

pytestmark = pytest.mark.slow


def deployment(name: str, model: str, isolation: str, tier: str) -> dict:
    return {"apiVersion": "inferplane.io/v1alpha1", "kind": "InferenceDeployment", "metadata": {"name": name},
            "spec": {"model": {"uri": model, "format": "safetensors"}, "runtime": "radix",
                     "resources": {"cpu": "1", "memory": "2Gi"}, "cacheIsolation": isolation,
                     "engine": {"kvCacheMemory": "64Mi", "maxModelLen": 256},
                     "serving": {"servedModelName": "mixed", "tier": tier}}}


def test_mixed_isolation_keeps_tenants_apart_in_local_mode(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "tiny")
    manifest = tmp_path / "mixed.yaml"
    manifest.write_text(yaml.safe_dump_all([deployment("open", model, "shared", "primary"),
                                            deployment("strict", model, "tenant", "spillover")]))
    home, port = tmp_path / "home", free_port()
    proc = subprocess.Popen([sys.executable, "-m", "inferplane.cli", "up", str(manifest), "--home", str(home),
                             "--port", str(port), "--grpc-port", str(free_port())],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line or "Ctrl-C stops everything" in line:
                break
            lines.append(line)
        assert any(re.search(r"API key \(shown once", line) for line in lines), "".join(lines)
        threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
        base = f"http://127.0.0.1:{port}"
        admin = {"Authorization": f"Bearer {(home / 'admin-key').read_text().strip()}"}
        keys = {}
        for tenant in ("acme", "globex"):
            assert httpx.post(f"{base}/admin/v1/tenants", headers=admin, json={"id": tenant}).status_code == 201
            reply = httpx.post(f"{base}/admin/v1/keys", headers=admin, json={"tenant_id": tenant, "scopes": ["infer"]})
            keys[tenant] = reply.json()["key"]
        time.sleep(2.5)  # the gateway's key cache refreshes
        assert_tenants_do_not_share_the_prefix_cache(base, keys["acme"], keys["globex"], "mixed")
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=90)
    assert proc.returncode == 0, "".join(lines)
