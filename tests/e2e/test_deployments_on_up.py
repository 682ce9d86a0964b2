"""Issue 59: deployments added, changed and removed on a running `inferplane up`, through the admin
API and `inferplane deployments`, and the admin CLI against the running gateway (`--url`).

A change rolls over while requests keep coming, streamed and not: none fails, and the new spec is
what serves afterwards (a prompt over the old context length is refused before and answered
after). A second deployment is added and removed; what is applied comes back after a restart; a
bad spec is refused naming its field; a change whose replicas never serve stalls while the old
ones serve on; only a platform admin may deploy. A key made with
`keys create --url` answers at once.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
import yaml

from inferplane.bench.tiny_model import make_tiny_model
from inferplane.local import runstate
from tests.e2e.test_up_newcomer import ROOT, Up, gone

pytestmark = pytest.mark.slow


def manifest(name: str, model: str, max_model_len: int) -> dict:
    return {"apiVersion": "inferplane.io/v1alpha1", "kind": "InferenceDeployment", "metadata": {"name": name},
            "spec": {"model": {"uri": model, "format": "safetensors"}, "runtime": "paged",
                     "resources": {"cpu": "1", "memory": "2Gi"},
                     "engine": {"kvCacheMemory": "64Mi", "maxModelLen": max_model_len}}}


def write(path: Path, *docs: dict) -> Path:
    path.write_text(yaml.safe_dump_all(docs))
    return path


def cli(home: Path, *argv: str, env: dict | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "inferplane.cli", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "INFERPLANE_HOME": str(home), **(env or {})})


def pids_of(home: Path, deployment: str) -> list[int]:
    return [r["pid"] for d in runstate.read(home)["deployments"] if d["name"] == deployment for r in d["replicas"]
            if r["pid"] is not None]


def running_with(folder: Path) -> bool:
    """Whether a process of this machine has `folder` on its command line (a worker loading it)."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(folder).encode() in cmdline.read_bytes():
                return True
        except OSError:
            continue
    return False


def complete(base: str, key: str, model: str, prompt: str = "Hi", stream: bool = False) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "stream": stream}
    return httpx.post(f"{base}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)


class Traffic:
    """Requests one after another on two threads (one streamed) until stopped; every outcome kept."""

    def __init__(self, base: str, key: str, model: str):
        self.outcomes: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(base, key, model, s), daemon=True)
                         for s in (False, True)]
        for thread in self._threads:
            thread.start()

    def _run(self, base: str, key: str, model: str, stream: bool) -> None:
        while not self._stop.is_set():
            try:
                response = complete(base, key, model, stream=stream)
                ok = response.status_code == 200 and (not stream or response.text.rstrip().endswith("[DONE]"))
                self.outcomes.append("ok" if ok else f"{response.status_code}: {response.text[:200]}")
            except httpx.HTTPError as exc:
                self.outcomes.append(f"error: {exc!r}")

    def stop(self) -> list[str]:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=180)
        return self.outcomes


def test_deployments_change_on_a_running_up_with_no_request_failed(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "tiny")
    home = tmp_path / "home"
    # --ready-timeout also bounds how long a rollout waits for its new replicas before it is stalled
    up = Up(None, home, command=("up", str(write(tmp_path / "tiny.yaml", manifest("tiny", model, 256))),
                                 "--ready-timeout", "40"))
    try:
        base, key = f"http://127.0.0.1:{up.port}", up.key
        long_prompt = "x" * 400  # one token a byte: over 256, under 512
        assert complete(base, key, "tiny", long_prompt).status_code == 400
        old_pids = up.worker_pids()

        traffic = Traffic(base, key, "tiny")
        longer = write(tmp_path / "t2.yaml", manifest("tiny", model, 512))
        changed = cli(home, "deployments", "apply", "-f", str(longer), "--wait")
        outcomes = traffic.stop()
        assert changed.returncode == 0, changed.stderr
        assert "deployment/tiny configured" in changed.stdout and "deployment/tiny ready" in changed.stdout
        assert len(outcomes) >= 4 and set(outcomes) == {"ok"}, [o for o in outcomes if o != "ok"][:5]
        assert complete(base, key, "tiny", long_prompt).status_code == 200  # the new spec serves
        assert gone(old_pids), "the old replica did not exit after the rollout"
        again = cli(home, "deployments", "apply", "-f", str(tmp_path / "t2.yaml"))
        assert "deployment/tiny unchanged" in again.stdout

        # a second deployment, added and later removed
        added = cli(home, "deployments", "apply", "-f", str(write(tmp_path / "b.yaml", manifest("other", model, 256))),
                    "--wait")
        assert added.returncode == 0 and "deployment/other created" in added.stdout, added.stderr
        assert complete(base, key, "other").status_code == 200
        listed = cli(home, "deployments", "list")
        assert [line.split()[0] for line in listed.stdout.splitlines()[1:]] == ["other", "tiny"], listed.stdout

        bad = manifest("broken", model, 256)
        bad["spec"]["runtime"] = "fast"
        refused = cli(home, "deployments", "apply", "-f", str(write(tmp_path / "bad.yaml", bad)))
        assert refused.returncode == 1 and "spec.runtime" in refused.stderr and "(HTTP 400)" in refused.stderr
        tenant = httpx.put(f"{base}/admin/v1/deployments/x", json=manifest("x", model, 256),
                           headers={"Authorization": f"Bearer {key}"})
        assert tenant.status_code in (401, 403)

        # the admin CLI through the gateway: a key it makes answers at once
        made = cli(home, "keys", "create", "--tenant", "default", "--url", base)
        assert made.returncode == 0, made.stderr
        assert complete(base, made.stdout.splitlines()[0], "tiny").status_code == 200
        assert "default" in cli(home, "tenants", "list", "--url", base).stdout
        models = cli(home, "models", "list", "--url", base)
        assert models.returncode == 0 and models.stdout.startswith("NAME"), models.stderr
        assert cli(home, "models", "verify", "smollm2-135m", "--url", base).returncode == 2  # the database's only

        # a change whose replicas never serve (weights that register but do not load) stalls; the old
        # ones keep serving
        first_other = pids_of(home, "other")
        broken = tmp_path / "broken"
        shutil.copytree(model, broken)
        (broken / "model.safetensors").write_bytes(b"not a safetensors file" * 100)
        stalled = cli(home, "deployments", "apply", "-f",
                      str(write(tmp_path / "broken.yaml", manifest("other", str(broken), 256))), "--wait")
        assert stalled.returncode == 1 and "deployment/other: stalled" in stalled.stderr, stalled.stderr
        assert complete(base, key, "other").status_code == 200 and not gone(first_other, timeout=1)
        # applying working weights again settles it: the stalled set and the first one both go
        fixed = cli(home, "deployments", "apply", "-f", str(tmp_path / "b.yaml"), "--wait")
        assert fixed.returncode == 0 and "deployment/other ready" in fixed.stdout, fixed.stderr
        assert gone(first_other) and not running_with(broken)

        other_pids = pids_of(home, "other")
        deleted = cli(home, "deployments", "delete", "other")
        assert deleted.returncode == 0 and complete(base, key, "other").status_code == 404
        assert gone(other_pids)
        third = cli(home, "deployments", "apply", "-f", str(write(tmp_path / "c.yaml", manifest("kept", model, 256))),
                    "--wait")
        assert third.returncode == 0, third.stderr
        assert up.stop() == 0
    finally:
        up.proc.kill()

    restarted = Up(tmp_path / "tiny.yaml", home)  # what was applied comes back; what was deleted does not
    try:
        base = f"http://127.0.0.1:{restarted.port}"
        key = cli(home, "keys", "create", "--tenant", "default").stdout.splitlines()[0]
        assert complete(base, key, "kept").status_code == 200
        assert complete(base, key, "other").status_code == 404
        assert restarted.stop() == 0
    finally:
        restarted.proc.kill()
