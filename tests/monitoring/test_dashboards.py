"""The generated Grafana dashboards: they build, stay stable, and only read metrics and variables that exist.

Each structural check (metric names, variables, layout, data source) is a small function tried first on a
made-up defect, so a check that passes everything cannot hide behind a green run.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterable
from itertools import combinations
from pathlib import Path
from typing import Any

import pytest

from inferplane.api import metric_names as m
from inferplane.monitoring import dashboards as d
from tests.services import installed

EXPECTED = {"inferplane-platform.json", "inferplane-deployment.json", "inferplane-tenant.json"}
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}

# Which constants are counters or histograms (by reference, not by copied name); every other one is a gauge.
# `test_the_metric_kinds_agree_with_the_exporters` checks this against the registries that exist.
COUNTERS = {m.WORKER_REQUESTS, m.WORKER_PROMPT_TOKENS, m.WORKER_GENERATION_TOKENS, m.WORKER_PREEMPTIONS,
            m.WORKER_FAIR_SHARE_PREEMPTIONS, m.WORKER_LORA_LOADS, m.WORKER_LORA_EVICTIONS, m.WORKER_LORA_REQUESTS,
            m.WORKER_PREFIX_QUERY_TOKENS, m.WORKER_PREFIX_HIT_TOKENS, m.WORKER_PREFIX_EVICTED_BLOCKS,
            m.GATEWAY_REQUESTS, m.GATEWAY_TOKENS, m.GATEWAY_LIMITER_STORE_ERRORS, m.KEY_REQUESTS, m.TENANT_TOKENS,
            m.OPERATOR_RECONCILES, m.WORKER_KV_TIER_HITS, m.WORKER_KV_TIER_STORED, m.WORKER_KV_TIER_EVICTED,
            m.WORKER_KV_TIER_MISSES, m.WORKER_KV_TIER_REJECTED, m.WORKER_KV_TIER_PREFETCHED, m.WORKER_KV_TIER_SAVED,
            m.WORKER_KV_TIER_LOADED, m.WORKER_KV_EVENTS, m.WORKER_KV_TIER_READ_SECONDS, m.GATEWAY_ROUTING_DECISIONS,
            m.GATEWAY_KV_EVENT_BATCHES, m.GATEWAY_MIGRATIONS, m.GATEWAY_DISAGGREGATION, m.WORKER_KV_TRANSFER_BLOCKS,
            m.WORKER_KV_TRANSFER_BYTES, m.WORKER_KV_TRANSFER_SECONDS, m.WORKER_KV_TRANSFER_FAILURES,
            m.WORKER_SPEC_PROPOSED, m.WORKER_SPEC_ACCEPTED, m.WORKER_SPEC_VERIFICATIONS, m.WORKER_SPEC_NO_ROOM}
HISTOGRAMS = {m.WORKER_TTFT, m.WORKER_TPOT, m.WORKER_E2E, m.GATEWAY_LATENCY, m.GATEWAY_TTFT, m.GATEWAY_PREFILL_SECONDS}


def metric_constants() -> set[str]:
    return {value for name, value in vars(m).items()
            if name.isupper() and isinstance(value, str) and value.startswith(("inferplane_", "process_"))}


def stored_series() -> set[str]:
    """What Prometheus stores for every constant: counters `_total`, histograms their three series, gauges bare."""
    stored: set[str] = set()
    for name in metric_constants():
        if name in COUNTERS:
            stored.add(m.series(name))
        elif name in HISTOGRAMS:
            stored |= {f"{name}_{suffix}" for suffix in ("bucket", "sum", "count")}
        else:
            stored.add(name)
    return stored


def unknown_metrics(exprs: Iterable[str]) -> set[str]:
    return set().union(*(d.used_metric_names(expr) for expr in exprs)) - stored_series()


def variable_queries(dashboard: dict[str, Any]) -> list[str]:
    return [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]


def undefined_variables(dashboard: dict[str, Any]) -> set[str]:
    defined = {v["name"] for v in dashboard["templating"]["list"]}
    exprs = [expr for _, expr in d.panel_queries(dashboard)] + variable_queries(dashboard)
    return set().union(*(d.used_variables(expr) for expr in exprs)) - defined


def overlapping(panels: Iterable[dict[str, Any]]) -> list[tuple[str, str]]:
    boxes = [(p.get("title", ""), p["gridPos"]) for p in panels]

    def overlap(a: dict[str, int], b: dict[str, int]) -> bool:
        return (a["x"] < b["x"] + b["w"] and b["x"] < a["x"] + a["w"]
                and a["y"] < b["y"] + b["h"] and b["y"] < a["y"] + a["h"])

    return [(ta, tb) for (ta, a), (tb, b) in combinations(boxes, 2) if overlap(a, b)]


def off_grid(panels: Iterable[dict[str, Any]]) -> list[str]:
    return [p.get("title", "") for p in panels
            if p["gridPos"]["x"] < 0 or p["gridPos"]["x"] + p["gridPos"]["w"] > 24 or p["gridPos"]["h"] < 1]


def foreign_datasources(dashboard: dict[str, Any]) -> list[str]:
    wrong = [p.get("title", "") for p in d.all_panels(dashboard) if p.get("datasource") != DATASOURCE]
    wrong += [p.get("title", "") for p in d.all_panels(dashboard) for t in p.get("targets") or []
              if t.get("datasource", DATASOURCE) != DATASOURCE]
    wrong += [v["name"] for v in dashboard["templating"]["list"]
              if v["type"] == "query" and v.get("datasource") != DATASOURCE]
    return wrong


@pytest.fixture(scope="module")
def boards() -> dict[str, dict[str, Any]]:
    return d.build_dashboards()


# -- the checks catch defects ------------------------------------------------------------------------


def test_the_metric_check_rejects_invented_and_missuffixed_names() -> None:
    assert unknown_metrics([f"rate({m.series(m.WORKER_REQUESTS)}[1m])", f"{m.WORKER_TTFT}_bucket",
                            m.WORKER_KV_USED, m.PROCESS_START_TIME]) == set()
    assert unknown_metrics([f"rate({m.WORKER_REQUESTS}[1m])"]) == {m.WORKER_REQUESTS}  # counter without _total
    assert unknown_metrics([m.series(m.WORKER_KV_USED)]) == {m.series(m.WORKER_KV_USED)}  # gauge with _total
    assert unknown_metrics([m.WORKER_TTFT]) == {m.WORKER_TTFT}  # histogram without a series suffix
    assert unknown_metrics(["inferplane_worker_made_up"]) == {"inferplane_worker_made_up"}


def test_the_variable_check_finds_an_undefined_variable() -> None:
    board = {"templating": {"list": [{"name": "datasource", "type": "datasource"}]},
             "panels": [{"title": "p", "targets": [{"expr": 'up{a=~"$nope", b=~"${also:regex}"}[$__rate_interval]'}]}]}
    assert undefined_variables(board) == {"nope", "also"}


def test_the_overlap_check_finds_overlapping_and_off_grid_panels() -> None:
    a = {"title": "a", "gridPos": {"x": 0, "y": 0, "w": 12, "h": 8}}
    b = {"title": "b", "gridPos": {"x": 11, "y": 7, "w": 6, "h": 4}}
    beside = {"title": "c", "gridPos": {"x": 12, "y": 0, "w": 12, "h": 8}}
    below = {"title": "e", "gridPos": {"x": 0, "y": 8, "w": 12, "h": 8}}
    wide = {"title": "w", "gridPos": {"x": 18, "y": 20, "w": 12, "h": 8}}
    assert overlapping([a, b]) == [("a", "b")]
    assert overlapping([a, beside, below]) == []
    assert off_grid([a, wide]) == ["w"]


def test_the_datasource_check_finds_a_hard_wired_datasource() -> None:
    board = {"templating": {"list": []}, "panels": [
        {"title": "ok", "datasource": DATASOURCE, "targets": [{"expr": "up"}]},
        {"title": "fixed", "datasource": {"type": "prometheus", "uid": "prom-1"}, "targets": [{"expr": "up"}]}]}
    assert foreign_datasources(board) == ["fixed"]


# -- the dashboards ----------------------------------------------------------------------------------


def test_the_three_dashboards_build_with_stable_unique_uids(boards: dict[str, dict[str, Any]]) -> None:
    assert set(boards) == EXPECTED
    assert {f"{b['uid']}.json" for b in boards.values()} == EXPECTED
    assert d.build_dashboards() == boards  # deterministic: uids, ids and layout do not move between builds
    json.dumps(boards)  # plain JSON data


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_dashboard_settings(boards: dict[str, dict[str, Any]], name: str) -> None:
    board = boards[name]
    assert board["tags"] == ["inferplane"]
    assert board["refresh"] == "30s"
    assert board["time"] == {"from": "now-6h", "to": "now"}
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for variable in variables.values():
        if variable["type"] == "query":
            assert variable["multi"] and variable["includeAll"] and variable["allValue"] == ".*", variable["name"]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_panel_has_a_query_a_unique_id_and_the_datasource_variable(boards: dict[str, dict[str, Any]],
                                                                         name: str) -> None:
    board = boards[name]
    panels = list(d.all_panels(board))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), ids
    assert [p["title"] for p in panels if p["type"] != "row" and not p.get("targets")] == []
    assert all(t["expr"] and t["refId"] for p in panels for t in p.get("targets") or [])
    assert foreign_datasources(board) == []


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_panels_do_not_overlap(boards: dict[str, dict[str, Any]], name: str) -> None:
    panels = list(d.all_panels(boards[name]))
    assert overlapping(panels) == []
    assert off_grid(panels) == []


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_only_metrics_from_metric_names_are_read(boards: dict[str, dict[str, Any]], name: str) -> None:
    board = boards[name]
    exprs = [expr for _, expr in d.panel_queries(board)] + variable_queries(board)
    assert all(d.used_metric_names(expr) for expr in exprs)
    assert unknown_metrics(exprs) == set()


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_variable_used_is_defined(boards: dict[str, dict[str, Any]], name: str) -> None:
    assert undefined_variables(boards[name]) == set()


def test_the_metric_kinds_agree_with_the_exporters() -> None:
    from inferplane.control_plane.autoscale.autoscaler import AutoscalerMetrics
    from inferplane.control_plane.gateway.metrics import GatewayMetrics
    from inferplane.worker.serve import metrics as worker_metrics

    gateway = GatewayMetrics()
    AutoscalerMetrics(gateway.registry)
    stats = {key: 1.0 for key in (*worker_metrics._COUNTER_STATS, *worker_metrics._GAUGE_STATS)}
    worker = worker_metrics.WorkerMetrics("m", "paged", lambda: stats)
    families = {f.name: f.type for registry in (gateway.registry, worker.registry) for f in registry.collect()}
    constants = metric_constants()
    seen = {name: kind for name, kind in families.items() if name in constants}
    assert len(seen) >= 20, seen
    for name, kind in seen.items():
        expected = "counter" if name in COUNTERS else "histogram" if name in HISTOGRAMS else "gauge"
        assert kind == expected, name


# -- the helpers the rest of the project calls -------------------------------------------------------


def test_substitute_variables() -> None:
    expr = ('sum by (le) (rate(x_bucket{a=~"$a", b=~"${b}", c=~"${c:regex}", d=~"[[d]]"}[$__rate_interval])) '
            '/ $__interval * $__range, label_replace(y, "k", "$1", "l", "(.*)")')
    assert d.substitute_variables(expr, {"a": "one"}) == (
        'sum by (le) (rate(x_bucket{a=~"one", b=~".*", c=~".*", d=~".*"}[1m])) / 1m * 1h, '
        'label_replace(y, "k", "$1", "l", "(.*)")')
    assert d.used_variables(expr) == {"a", "b", "c", "d"}


def test_used_metric_names() -> None:
    expr = (f"sum(rate({m.series(m.GATEWAY_TOKENS)}[1m])) / sum({m.GATEWAY_TTFT}_count) "
            f"+ time() - {m.PROCESS_START_TIME} + on() up")
    assert d.used_metric_names(expr) == {m.series(m.GATEWAY_TOKENS), f"{m.GATEWAY_TTFT}_count", m.PROCESS_START_TIME}


# -- PromQL, through Prometheus' own parser and engine (promtool) ------------------------------------


def promtool() -> str:
    return installed("promtool", package="prometheus")


def run_promtool(*args: str, cwd: Path) -> None:
    result = subprocess.run([promtool(), *args], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_query_parses_with_all_variables_at_all(boards: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    exprs = [d.substitute_variables(expr) for board in boards.values() for _, expr in d.panel_queries(board)]
    assert not any(d.used_variables(expr) for expr in exprs)
    rules = [{"record": f"dashboard:query{i}", "expr": expr} for i, expr in enumerate(exprs)]
    (tmp_path / "rules.yml").write_text(json.dumps({"groups": [{"name": "dashboards", "rules": rules}]}))
    run_promtool("check", "rules", "rules.yml", cwd=tmp_path)


def test_deployment_matcher_finds_cluster_and_local_names(boards: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    """`(${namespace}/)?${deployment}` matches "prod/chat" and a local "chat", not another namespace's."""
    (expr,) = [e for title, e in d.panel_queries(boards["inferplane-deployment.json"])
               if title == "Autoscaler saturation"]
    query = d.substitute_variables(expr, {"namespace": "prod", "deployment": "chat"})
    metric = m.AUTOSCALER_SATURATION
    tests = {"rule_files": [], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": [{"series": f'{metric}{{deployment="{name}"}}', "values": "2x5"}
                         for name in ("prod/chat", "chat", "staging/chat", "prod/chatter")],
        "promql_expr_test": [{"expr": query, "eval_time": "5m", "exp_samples": [
            {"labels": '{deployment="chat"}', "value": 2}, {"labels": '{deployment="prod/chat"}', "value": 2}]}],
    }]}
    (tmp_path / "tests.yml").write_text(json.dumps(tests))
    run_promtool("test", "rules", "tests.yml", cwd=tmp_path)
