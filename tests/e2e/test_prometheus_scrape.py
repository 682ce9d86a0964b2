"""Issue 15: a real Prometheus scrapes a running local stack, and every rule and dashboard query works.

`inferplane up` runs a gateway and a tiny-model worker (radix runtime, autoscaling on, a tenant
with a quota, a key with a low rate limit); the operator's exporter runs beside it (the operator
itself needs a cluster). Prometheus (Debian's package) scrapes all three every second and loads the
platform rules and the deployment's rules. After real requests (served, streamed, rate limited,
unauthenticated):
- every rule group evaluates without error (the rules API reports health "ok", no lastError);
- every expression of every rule and every dashboard panel runs through the query API;
- every metric name those expressions read is among the names Prometheus scraped: a dashboard
  that would show "No data" for want of a metric fails here.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from inferplane.bench.tiny_model import make_tiny_model
from inferplane.local import runstate
from inferplane.monitoring import dashboards, render
from inferplane.operator.metrics import OperatorMetrics
from tests.e2e.test_up_newcomer import Up
from tests.services import installed
from tests.worker.test_worker_process import free_port

pytestmark = pytest.mark.slow
NAME = "tiny"
WAIT = 240.0  # seconds for the series to appear on a busy machine


def prometheus_binary() -> str:
    return installed("prometheus", package="prometheus")


@pytest.fixture
def manifest(tmp_path: Path) -> Path:
    model = make_tiny_model(tmp_path / "tiny")
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump({
        "apiVersion": "inferplane.io/v1alpha1", "kind": "InferenceDeployment", "metadata": {"name": NAME},
        "spec": {"model": {"uri": model, "format": "safetensors"}, "runtime": "radix", "tenant": "default",
                 "replicas": 1, "minReplicas": 1, "maxReplicas": 2, "autoscaling": {"enabled": True},
                 "resources": {"cpu": "1", "memory": "2Gi"},
                 # KV tiers on, so that their series are scraped too (the deployment dashboard reads them)
                 "engine": {"kvCacheMemory": "64Mi", "maxModelLen": 256, "kvOffloadMemory": "16MiB",
                            "kvOffloadDisk": "16MiB",
                            # speculation on, so that its series (the "Speculative decoding" row) are scraped
                            "speculative": {"method": "ngram"}}}}))
    return path


def cli(*args: str) -> str:
    """`inferplane monitoring ARGS` as a user runs it."""
    result = subprocess.run([sys.executable, "-m", "inferplane.cli", "monitoring", *args], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


class Prometheus:
    def __init__(self, config: Path, data: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [prometheus_binary(), f"--config.file={config}", f"--storage.tsdb.path={data}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=subprocess.DEVNULL, stderr=open(data.parent / "prometheus.log", "w"))
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert self.proc.poll() is None, (data.parent / "prometheus.log").read_text()
            time.sleep(0.5)
        raise AssertionError("prometheus did not become ready")

    def api(self, path: str, **params: str) -> dict:
        body = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=60).json()
        assert body["status"] == "success", (path, params, body)
        return body["data"]

    def query(self, expr: str) -> dict:
        response = httpx.post(f"{self.url}/api/v1/query", data={"query": expr}, timeout=60).json()
        return response

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def traffic(base: str, key: str, admin: str) -> None:
    """Served, streamed, quota-counted, rate-limited and unauthenticated requests."""
    def post(path: str, token: str, **body) -> httpx.Response:
        return httpx.post(f"{base}{path}", json=body, headers={"Authorization": f"Bearer {token}"}, timeout=300)

    patched = httpx.patch(f"{base}/admin/v1/tenants/default", json={"monthly_token_quota": 1_000_000},
                          headers={"Authorization": f"Bearer {admin}"}, timeout=60)
    assert patched.status_code == 200, patched.text
    slow = post("/admin/v1/keys", admin, tenant_id="default", requests_per_minute=1)
    assert slow.status_code == 201, slow.text
    chat = {"model": NAME, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 8}
    for _ in range(3):
        assert post("/v1/chat/completions", key, **chat).status_code == 200
    with httpx.stream("POST", f"{base}/v1/chat/completions", json={**chat, "stream": True},
                      headers={"Authorization": f"Bearer {key}"}, timeout=300) as streamed:
        assert streamed.status_code == 200
        streamed.read()
    codes = [post("/v1/chat/completions", slow.json()["key"], **chat).status_code for _ in range(3)]
    assert 429 in codes, codes
    assert post("/v1/chat/completions", "ip-not-a-key", **chat).status_code == 401


def expressions(rule_texts: list[str]) -> list[tuple[str, str]]:
    """(where, expr) of every rule and every dashboard panel target."""
    found = [(f"rule {r.get('alert') or r.get('record')}", r["expr"])
             for text in rule_texts for doc in yaml.safe_load_all(text) if doc
             for group in doc["groups"] for r in group["rules"]]
    for file, board in dashboards.build_dashboards().items():
        found += [(f"{file}: {title}", dashboards.substitute_variables(expr)) for title, expr in
                  dashboards.panel_queries(board)]
    return found


def test_prometheus_scrapes_the_stack_and_every_rule_and_panel_query_works(manifest: Path, tmp_path: Path) -> None:
    up = Up(manifest, tmp_path / "home")
    operator = OperatorMetrics()
    operator_port = free_port()
    operator.serve(operator_port, host="127.0.0.1")
    with operator.reconcile():
        pass
    prometheus = None
    try:
        key = up.key
        admin = (tmp_path / "home" / "admin-key").read_text().strip()
        platform_rules, local_rules = tmp_path / "platform.rules.yaml", tmp_path / "deployment.rules.yaml"
        platform_rules.write_text(render.platform_rules_yaml())
        local_rules.write_text(cli("rules", str(manifest), "--local"))
        config = tmp_path / "prometheus.yml"
        config.write_text(cli("scrape-config", "--home", str(tmp_path / "home"), "--rule-file", str(platform_rules),
                              "--rule-file", str(local_rules), "--operator", f"127.0.0.1:{operator_port}",
                              "--interval", "1s"))
        prometheus = Prometheus(config, tmp_path / "tsdb")
        state = runstate.read(tmp_path / "home")
        assert state is not None
        traffic(state["gateway"]["url"], key, admin)

        exprs = expressions([platform_rules.read_text(), local_rules.read_text()])
        wanted = set().union(*(dashboards.used_metric_names(e) for _, e in exprs))
        deadline = time.monotonic() + WAIT
        while True:
            scraped = set(prometheus.api("label/__name__/values"))
            groups = prometheus.api("rules")["groups"]
            rules = [r for g in groups for r in g["rules"]]
            evaluated = all(r["health"] != "unknown" for r in rules)
            if (wanted <= scraped and evaluated) or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert wanted - scraped == set(), f"read by rules or panels but never scraped: {sorted(wanted - scraped)}"
        broken = [(r["name"], r["health"], r.get("lastError")) for r in rules if r["health"] != "ok"]
        assert broken == [], broken

        failures, with_data = [], 0
        for where, expr in exprs:
            answer = prometheus.query(expr)
            if answer["status"] != "success":
                failures.append((where, expr, answer.get("error")))
            elif answer["data"]["result"]:
                with_data += 1
        assert failures == [], failures
        alerts = sum(1 for r in rules if r["type"] == "alerting")
        print(f"\nprometheus: {len(rules)} rules loaded ({alerts} alerts) in {len(groups)} groups, "
              f"{len(exprs)} expressions checked ({with_data} with data now), {len(wanted)} metric names "
              f"read, all among {len(scraped)} scraped")
    finally:
        if prometheus is not None:
            prometheus.stop()
        up.proc.send_signal(signal.SIGINT)
        try:
            up.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            up.proc.kill()

