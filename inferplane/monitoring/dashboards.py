"""The platform's Grafana dashboards, generated from code.

Three dashboards: `inferplane-platform` (gateway, tenants, usage pipeline, operator), `inferplane-deployment`
(one deployment's workers and autoscaler) and `inferplane-tenant` (one tenant's traffic and quota).

They are built with `grafana-foundation-sdk`, Grafana's own typed builders (generated from Grafana's schemas
and maintained by Grafana), rather than as hand-written JSON: a misspelt field or a wrong type is an error
here instead of a panel Grafana silently ignores, and bumping the pinned SDK keeps the emitted JSON in step
with the schema Grafana expects. Every metric name comes from `inferplane.api.metric_names`, so a renamed
metric breaks the build (and the tests), not a panel on "No data".

Conventions: every panel queries the `${datasource}` variable; every query variable is multi-valued with
"All" = ".*" and is matched with `=~`, so a query stays valid with ".*" substituted everywhere (which is how
`substitute_variables` lets the tests send each expression to Prometheus). Rates use `$__rate_interval`.
Worker series are scoped by `namespace` and `service` (the deployment's name); gateway and autoscaler series
by `deployment`, "<namespace>/<name>" in a cluster and "<name>" locally. Gauges every gateway replica exports
alike (replica counts, quotas) are aggregated with `max`, not `sum`, so replicas are not added up.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from grafana_foundation_sdk.builders import common as common_builder
from grafana_foundation_sdk.builders import dashboard as dashboard_builder
from grafana_foundation_sdk.builders import gauge, prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as dashboard_model

from inferplane.api import metric_names as m
from inferplane.api.metric_names import series

__all__ = ["build_dashboards", "panel_queries", "substitute_variables", "used_metric_names", "used_variables"]

TAGS = ["inferplane"]
REFRESH = "30s"
TIME_FROM = "now-6h"
DATASOURCE = dashboard_model.DataSourceRef(type_val="prometheus", uid="${datasource}")
RATE_WINDOW = "$__rate_interval"
QUANTILES = (0.5, 0.95, 0.99)
ALL_VALUE = ".*"
GRID_WIDTH = 24

# Gateway and autoscaler series name a deployment "<namespace>/<name>" (cluster) or "<name>" (local).
DEPLOYMENT_OF_NAMESPACE = "${namespace}/.+|[^/]+"  # any deployment in the chosen namespaces, or a local one
ONE_DEPLOYMENT = "(${namespace}/)?${deployment}"


# -- PromQL ------------------------------------------------------------------------------------------


def selector(**matchers: str) -> str:
    """`{label=~"regex", ...}`; every matcher is a regex so "All" (".*") keeps the query valid."""
    if not matchers:
        return ""
    return "{" + ", ".join(f'{label}=~"{regex}"' for label, regex in matchers.items()) + "}"


def aggregate(expr: str, by: Sequence[str] = (), op: str = "sum") -> str:
    grouping = f" by ({', '.join(by)})" if by else ""
    return f"{op}{grouping} ({expr})"


def rate(stored_name: str, labels: str = "") -> str:
    return f"rate({stored_name}{labels}[{RATE_WINDOW}])"


def counter_rate(counter: str, labels: str = "", by: Sequence[str] = ()) -> str:
    """Per-second rate of a counter declared without `_total`, summed over everything but `by`."""
    return aggregate(rate(series(counter), labels), by)


def quantile(q: float, histogram: str, labels: str = "", by: Sequence[str] = ()) -> str:
    return f"histogram_quantile({q}, {aggregate(rate(f'{histogram}_bucket', labels), ('le', *by))})"


def gauge_value(name: str, labels: str = "", by: Sequence[str] = (), op: str = "sum") -> str:
    return aggregate(f"{name}{labels}", by, op)


def ratio(numerator: str, denominator: str) -> str:
    return f"{numerator} / {denominator}"


# -- queries and panels ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = ""


def quantile_queries(histogram: str, labels: str = "", by: Sequence[str] = ()) -> list[Query]:
    prefix = " ".join(f"{{{{{label}}}}}" for label in by)
    return [Query(quantile(q, histogram, labels, by), f"{prefix} p{round(q * 100)}".strip()) for q in QUANTILES]


def target(query: Query, ref_id: str) -> prometheus.Dataquery:
    built = prometheus.Dataquery().expr(query.expr).ref_id(ref_id).datasource(DATASOURCE)
    return built.legend_format(query.legend) if query.legend else built


PanelT = TypeVar("PanelT", timeseries.Panel, stat.Panel, gauge.Panel)


def with_queries(panel: PanelT, title: str, queries: Sequence[Query], unit: str, width: int, height: int,
                 description: str) -> PanelT:
    if not queries:
        raise ValueError(f"panel {title!r} has no query")
    if not 0 < width <= GRID_WIDTH:
        raise ValueError(f"panel {title!r} is {width} wide; the grid is {GRID_WIDTH}")
    panel = panel.title(title).datasource(DATASOURCE).unit(unit).span(width).height(height)
    if description:
        panel = panel.description(description)
    for index, query in enumerate(queries):
        panel = panel.with_target(target(query, chr(ord("A") + index)))
    return panel


def thresholds(*steps: tuple[float | None, str]) -> dashboard_builder.ThresholdsConfig:
    return (dashboard_builder.ThresholdsConfig().mode(dashboard_model.ThresholdsMode.ABSOLUTE)
            .steps([dashboard_model.Threshold(value=value, color=color) for value, color in steps]))


def graph(title: str, queries: Sequence[Query], unit: str = "short", *, width: int = 12, height: int = 8,
          description: str = "") -> timeseries.Panel:
    legend = (common_builder.VizLegendOptions().show_legend(True)
              .display_mode(common.LegendDisplayMode.LIST).placement(common.LegendPlacement.BOTTOM))
    tooltip = common_builder.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI).sort(common.SortOrder.DESCENDING)
    panel = timeseries.Panel().legend(legend).tooltip(tooltip).fill_opacity(10).min(0)
    return with_queries(panel, title, queries, unit, width, height, description)


def single_stat(title: str, queries: Sequence[Query], unit: str = "short", *, width: int = 6, height: int = 4,
                description: str = "",
                steps: Sequence[tuple[float | None, str]] = ((None, "green"),)) -> stat.Panel:
    panel = (stat.Panel().reduce_options(common_builder.ReduceDataOptions().calcs(["lastNotNull"]))
             .graph_mode(common.BigValueGraphMode.AREA).thresholds(thresholds(*steps)))
    return with_queries(panel, title, queries, unit, width, height, description)


def dial(title: str, queries: Sequence[Query], unit: str, *, maximum: float, width: int = 6, height: int = 8,
         description: str = "", steps: Sequence[tuple[float | None, str]] = ((None, "green"),)) -> gauge.Panel:
    panel = (gauge.Panel().reduce_options(common_builder.ReduceDataOptions().calcs(["lastNotNull"]))
             .min(0).max(maximum).thresholds(thresholds(*steps)))
    return with_queries(panel, title, queries, unit, width, height, description)


Panel = timeseries.Panel | stat.Panel | gauge.Panel


@dataclass(frozen=True)
class Row:
    title: str
    panels: tuple[Panel, ...]


# -- variables ---------------------------------------------------------------------------------------


def datasource_variable() -> dashboard_builder.DatasourceVariable:
    return dashboard_builder.DatasourceVariable("datasource").id("datasource").label("Data source").type("prometheus")


def query_variable(name: str, label: str, query: str) -> dashboard_builder.QueryVariable:
    """A multi-valued variable whose "All" is ".*", so `label=~"$name"` matches everything."""
    everything = dashboard_model.VariableOption(selected=True, text="All", value="$__all")
    return (dashboard_builder.QueryVariable(name).id(name).label(label).datasource(DATASOURCE).query(query)
            .refresh(dashboard_model.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(dashboard_model.VariableSort.ALPHABETICAL_ASC)
            .multi(True).include_all(True).all_value(ALL_VALUE).current(everything))


def label_values(metric: str, label: str, labels: str = "") -> str:
    return f"label_values({metric}{labels}, {label})"


def namespace_variable() -> dashboard_builder.QueryVariable:
    return query_variable("namespace", "Namespace", label_values(m.WORKER_RUNNING, "namespace"))


# -- shared panels -----------------------------------------------------------------------------------


def replicas_panel(deployments: str, title: str, width: int = 12) -> timeseries.Panel:
    labels = selector(deployment=deployments, model="$model")
    return graph(title, [
        Query(gauge_value(m.DEPLOYMENT_REPLICAS_DESIRED, labels, ("deployment",), "max"), "{{deployment}} desired"),
        Query(gauge_value(m.DEPLOYMENT_REPLICAS_READY, labels, ("deployment",), "max"), "{{deployment}} ready"),
    ], width=width)


# -- dashboards --------------------------------------------------------------------------------------


def dashboard(uid: str, title: str, description: str, variables: Sequence[Any],
              rows: Sequence[Row]) -> dashboard_builder.Dashboard:
    """Rows and their panels laid out left to right on the 24-wide grid, with ids 1, 2, ... in order."""
    builder = (dashboard_builder.Dashboard(title).uid(uid).description(description).tags(TAGS).refresh(REFRESH)
               .time(TIME_FROM, "now").timezone("browser").tooltip(dashboard_model.DashboardCursorSync.CROSSHAIR)
               .with_variable(datasource_variable()))
    for variable in variables:
        builder = builder.with_variable(variable)
    ids = itertools.count(1)
    for row in rows:
        builder = builder.with_row(dashboard_builder.Row(row.title).id(next(ids)).datasource(DATASOURCE))
        for panel in row.panels:
            builder = builder.with_panel(panel.id(next(ids)))
    return builder


def platform_dashboard() -> dashboard_builder.Dashboard:
    model = selector(model="$model")
    status_class = ('label_replace(' + rate(series(m.GATEWAY_REQUESTS)) +
                    ', "status_class", "$1", "status", "([0-9]).*")')
    requests = Row("Gateway", (
        graph("Requests/s by route and status class", [
            Query(aggregate(status_class, ("route", "status_class")), "{{route}} {{status_class}}xx")], "reqps"),
        graph("5xx ratio", [Query(ratio(counter_rate(m.GATEWAY_REQUESTS, selector(status="5..")),
                                        counter_rate(m.GATEWAY_REQUESTS)), "5xx")], "percentunit"),
        graph("Gateway latency", quantile_queries(m.GATEWAY_LATENCY), "s"),
        graph("Gateway TTFT p95 by model", [Query(quantile(0.95, m.GATEWAY_TTFT, model, ("model",)), "{{model}}")],
              "s"),
        graph("Tokens/s by model and kind", [
            Query(counter_rate(m.GATEWAY_TOKENS, model, ("model", "kind")), "{{model}} {{kind}}")]),
        graph("Refused requests/s (rate limit, quota, concurrency)", [
            Query(counter_rate(m.KEY_REQUESTS, selector(result="rate_limited|quota_exceeded|concurrency_limited"),
                               ("result",)), "{{result}}")], "reqps"),
    ))
    tenant_rates = counter_rate(m.TENANT_TOKENS, model, ("tenant",))
    usage = Row("Tenants and usage", (
        single_stat("Active tenants", [Query(f"count({tenant_rates} > 0) or vector(0)", "tenants")],
                    description="Tenants with a nonzero token rate"),
        single_stat("Database up", [Query(gauge_value(m.DATABASE_UP, op="min"), "up")], "none",
                    steps=((None, "red"), (1, "green"))),
        single_stat("Usage flush lag", [Query(f"max(time() - {m.USAGE_FLUSH_LAST_SUCCESS})", "lag")], "s",
                    description="Time since the last successful usage flush (worst gateway replica)",
                    steps=((None, "green"), (300, "orange"), (900, "red"))),
        single_stat("Pending usage records", [Query(gauge_value(m.USAGE_PENDING_RECORDS), "pending")]),
    ))
    control = Row("Control plane", (
        graph("Operator reconciles/s by result", [
            Query(counter_rate(m.OPERATOR_RECONCILES, by=("result",)), "{{result}}")], "ops"),
        replicas_panel(DEPLOYMENT_OF_NAMESPACE, "Worker replicas ready vs desired"),
    ))
    routing = Row("KV-aware routing", (
        graph("Replica choices/s by policy and outcome", [
            Query(counter_rate(m.GATEWAY_ROUTING_DECISIONS, by=("policy", "outcome")), "{{policy}} {{outcome}}")],
              "ops", width=8,
              description="held: the replica holding most of the prompt's blocks (its KV events say); ring: the "
                          "hash ring, where no replica holds the first block; least_loaded: by load alone"),
        graph("KV blocks indexed", [Query(gauge_value(m.GATEWAY_KV_INDEX_BLOCKS, op="max"), "blocks")], "short",
              width=8, description="Distinct KV blocks the gateway knows some replica holds (the fullest gateway)"),
        graph("KV blocks per replica and medium", [
            Query(gauge_value(m.GATEWAY_KV_INDEX_REPLICA_BLOCKS, by=("replica", "medium"), op="max"),
                  "{{replica}} {{medium}}")], "short", width=8,
              description="What each replica's KV events say it holds: in its pool, memory tier and disk tier"),
    ))
    variables = [namespace_variable(),
                 query_variable("model", "Model", label_values(series(m.GATEWAY_TOKENS), "model"))]
    return dashboard("inferplane-platform", "Inferplane / Platform",
                     "Gateway traffic, tenants, the usage pipeline and the operator.", variables,
                     [requests, usage, control, routing])


def deployment_dashboard() -> dashboard_builder.Dashboard:
    workers = selector(namespace="$namespace", service="$deployment", model="$model")
    autoscaler = selector(deployment=ONE_DEPLOYMENT)
    per_deployment = ("deployment",)

    def autoscaler_gauge(name: str) -> str:
        return gauge_value(name, autoscaler, per_deployment, "max")

    latency = Row("Latency", (
        graph("Time to first token", quantile_queries(m.WORKER_TTFT, workers), "s", width=8),
        graph("Time per output token", quantile_queries(m.WORKER_TPOT, workers), "s", width=8),
        graph("End-to-end latency", quantile_queries(m.WORKER_E2E, workers), "s", width=8),
    ))
    throughput = Row("Throughput", (
        graph("Requests/s by outcome", [
            Query(counter_rate(m.WORKER_REQUESTS, workers, ("outcome",)), "{{outcome}}")], "reqps", width=8),
        graph("Generated tokens/s", [Query(counter_rate(m.WORKER_GENERATION_TOKENS, workers), "tokens/s")],
              width=8),
        graph("Preemptions/s", [Query(counter_rate(m.WORKER_PREEMPTIONS, workers), "preemptions/s")], width=8),
    ))
    per_pod = ("pod",)
    hit_rate = ratio(counter_rate(m.WORKER_PREFIX_HIT_TOKENS, workers),
                     counter_rate(m.WORKER_PREFIX_QUERY_TOKENS, workers))
    engine = Row("Engine", (
        graph("KV cache use", [Query(ratio(gauge_value(m.WORKER_KV_USED, workers, per_pod),
                                           gauge_value(m.WORKER_KV_CAPACITY, workers, per_pod)), "{{pod}}")],
              "percentunit", width=8),
        graph("Prefix cache hit rate", [Query(hit_rate, "hit rate")], "percentunit", width=8,
              description="Prompt tokens served from the prefix cache / prompt tokens looked up"),
        graph("Queue", [Query(gauge_value(m.WORKER_WAITING, workers), "waiting"),
                        Query(gauge_value(m.WORKER_RUNNING, workers), "running")], width=8),
    ))
    per_tier = ("tier",)
    kv_tiers = Row("KV tiers", (
        graph("KV blocks read back by tier", [
            Query(counter_rate(m.WORKER_KV_TIER_HITS, workers, per_tier), "{{tier}}"),
            Query(counter_rate(m.WORKER_KV_TIER_MISSES, workers), "not held")], "short", width=6,
              description="Blocks a prompt found in the memory or disk tier instead of computing them "
                          "(prefetched: read from disk ahead of the request, off the engine thread)"),
        graph("KV tier read time per block", [
            Query(ratio(counter_rate(m.WORKER_KV_TIER_READ_SECONDS, workers, per_tier),
                        counter_rate(m.WORKER_KV_TIER_HITS, workers, per_tier)), "{{tier}}")], "s", width=6,
              description="Mean time to read one block back from each tier, checks and copy included"),
        graph("KV tier bytes", [Query(gauge_value(m.WORKER_KV_TIER_BYTES, workers, per_tier), "{{tier}}")],
              "bytes", width=6),
        graph("KV tier records rejected/s", [Query(counter_rate(m.WORKER_KV_TIER_REJECTED, workers), "rejected")],
              width=6, description="Stored blocks that failed a check (checksum, layout, key) and were computed "
                                   "again: never used"),
    ))
    # A disaggregated deployment's prefill pool: its own Service, <deployment>-prefill (docs/disaggregation.md).
    prefill_workers = selector(namespace="$namespace", service="$deployment-prefill", model="$model")
    both_pools = selector(namespace="$namespace", service="$deployment(-prefill)?", model="$model")
    per_direction = ("direction",)
    disaggregation = Row("Prefill/decode disaggregation", (
        graph("Prefill pool queue", [Query(gauge_value(m.WORKER_WAITING, prefill_workers), "waiting"),
                                     Query(gauge_value(m.WORKER_RUNNING, prefill_workers), "running")], width=6,
              description="Requests the prefill pool's workers hold (its autoscaling signal); empty where the "
                          "deployment is not disaggregated"),
        graph("Decode pool time per output token", quantile_queries(m.WORKER_TPOT, workers), "s", width=6,
              description="The decode workers' inter-token latency: what disaggregation keeps steady"),
        graph("KV moved between workers", [
            Query(counter_rate(m.WORKER_KV_TRANSFER_BYTES, both_pools, per_direction), "{{direction}}")],
              "Bps", width=6, description="Record bytes the decode workers pulled and the prefill workers served"),
        graph("KV pull time per block", [
            Query(ratio(counter_rate(m.WORKER_KV_TRANSFER_SECONDS, workers, per_direction),
                        counter_rate(m.WORKER_KV_TRANSFER_BLOCKS, workers, per_direction)), "{{direction}}"),
            Query(counter_rate(m.WORKER_KV_TRANSFER_FAILURES, workers), "failed pulls/s")], "s", width=6,
              description="Mean time a decode worker took per block pulled (the request waits for it), and "
                          "pulls that failed (their prompts computed on the decode worker)"),
    ))
    per_method = ("method",)
    speculative = Row("Speculative decoding", (
        graph("Draft tokens proposed and accepted/s", [
            Query(counter_rate(m.WORKER_SPEC_PROPOSED, workers, per_method), "{{method}} proposed"),
            Query(counter_rate(m.WORKER_SPEC_ACCEPTED, workers, per_method), "{{method}} accepted")], width=8,
              description="Tokens proposed from text already written (engine.speculative) and verified; the "
                          "accepted ones cost no step of their own"),
        graph("Acceptance rate", [
            Query(ratio(counter_rate(m.WORKER_SPEC_ACCEPTED, workers, per_method),
                        counter_rate(m.WORKER_SPEC_PROPOSED, workers, per_method)), "{{method}}")],
              "percentunit", width=8, description="Accepted / proposed draft tokens, by method"),
        graph("Acceptance length", [
            Query("1 + " + ratio(counter_rate(m.WORKER_SPEC_ACCEPTED, workers, per_method),
                                 counter_rate(m.WORKER_SPEC_VERIFICATIONS, workers, per_method)), "{{method}}")],
              width=8,
              description="Tokens a decode row emits per verifying step (1: no draft token kept)"),
    ))
    flow_control = Row("Flow control", (
        graph("Waiting sequences by tenant and band", [
            Query(gauge_value(m.WORKER_TENANT_SEQUENCES, selector(namespace="$namespace", service="$deployment",
                                                                   model="$model", state="waiting"),
                              ("tenant", "band")), "{{tenant}} ({{band}})")], width=8,
              description="Sequences queued on the workers, per tenant and priority band"),
        graph("Running sequences by tenant and band", [
            Query(gauge_value(m.WORKER_TENANT_SEQUENCES, selector(namespace="$namespace", service="$deployment",
                                                                   model="$model", state="running"),
                              ("tenant", "band")), "{{tenant}} ({{band}})")], width=8,
              description="Batch slots each tenant holds: its fair share, or more while nobody else waits"),
        graph("Fair-share preemptions/s", [Query(counter_rate(m.WORKER_FAIR_SHARE_PREEMPTIONS, workers),
                                                 "preemptions/s")], width=8,
              description="Slots taken back from a tenant over its share, or from a less urgent band"),
    ))
    scaling = Row("Scaling", (
        replicas_panel(ONE_DEPLOYMENT, "Replicas desired vs ready"),
        graph("Autoscaler replicas", [
            Query(autoscaler_gauge(m.AUTOSCALER_DESIRED), "{{deployment}} desired"),
            Query(autoscaler_gauge(m.AUTOSCALER_CURRENT), "{{deployment}} current"),
            Query(autoscaler_gauge(m.AUTOSCALER_MAX), "{{deployment}} max"),
        ]),
        graph("Autoscaler saturation", [Query(autoscaler_gauge(m.AUTOSCALER_SATURATION), "{{deployment}}")],
              description="Load in replicas' worth, averaged over the stable window"),
        graph("Autoscaler panic", [Query(autoscaler_gauge(m.AUTOSCALER_PANIC), "{{deployment}}")], "bool",
              description="1 while the panic window rules"),
    ))
    in_namespace = selector(namespace="$namespace")
    variables = [
        namespace_variable(),
        query_variable("deployment", "Deployment", label_values(m.WORKER_RUNNING, "service", in_namespace)),
        query_variable("model", "Model", label_values(
            m.WORKER_RUNNING, "model", selector(namespace="$namespace", service="$deployment"))),
    ]
    return dashboard("inferplane-deployment", "Inferplane / Deployment",
                     "One deployment: its workers' latency, throughput and engine, and its autoscaler.", variables,
                     [latency, throughput, engine, kv_tiers, disaggregation, speculative, flow_control, scaling])


def tenant_dashboard() -> dashboard_builder.Dashboard:
    tenant = selector(tenant="$tenant")
    per_tenant = ("tenant",)
    quota = gauge_value(m.TENANT_QUOTA_TOKENS, tenant, per_tenant, "max")
    used = gauge_value(m.TENANT_QUOTA_USED_TOKENS, tenant, per_tenant, "max")
    traffic = Row("Traffic", (
        graph("Tokens/s by model and kind", [
            Query(counter_rate(m.TENANT_TOKENS, tenant, ("tenant", "model", "kind")),
                  "{{tenant}} {{model}} {{kind}}")],
              width=8),
        graph("Requests/s by key and result", [
            Query(counter_rate(m.KEY_REQUESTS, tenant, ("key", "result")), "{{key}} {{result}}")], "reqps", width=8),
        graph("Rate-limited (429) requests/s by key", [
            Query(counter_rate(m.KEY_REQUESTS, selector(tenant="$tenant", result="rate_limited"), ("key",)),
                  "{{key}}")], "reqps", width=8),
    ))
    quota_row = Row("Quota", (
        graph("Quota used vs quota", [Query(used, "{{tenant}} used"), Query(quota, "{{tenant}} quota")],
              description="Tokens this month, reservations included; only tenants with a quota"),
        single_stat("Quota left", [Query(f"{quota} - {used}", "{{tenant}}")], height=8,
                    steps=((None, "red"), (1, "green"))),
        dial("Quota used ratio", [Query(ratio(used, quota), "{{tenant}}")], "percentunit", maximum=1,
             steps=((None, "green"), (0.8, "orange"), (0.95, "red"))),
    ))
    variables = [query_variable("tenant", "Tenant", label_values(series(m.KEY_REQUESTS), "tenant"))]
    return dashboard("inferplane-tenant", "Inferplane / Tenant", "One tenant: its traffic, keys and quota.",
                     variables, [traffic, quota_row])


def to_json(builder: dashboard_builder.Dashboard) -> dict[str, Any]:
    """The dashboard as plain JSON data, as the SDK's encoder writes it."""
    return json.loads(json.dumps(builder.build(), cls=JSONEncoder))


def build_dashboards() -> dict[str, dict]:
    """File name ("<uid>.json") -> dashboard JSON, for every dashboard."""
    built = [to_json(make()) for make in (platform_dashboard, deployment_dashboard, tenant_dashboard)]
    return {f"{board['uid']}.json": board for board in built}


# -- reading dashboards back -------------------------------------------------------------------------


def all_panels(dashboard: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, rows and the panels collapsed inside them included."""
    for panel in dashboard.get("panels") or []:
        yield panel
        yield from panel.get("panels") or []


def panel_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target of every panel, rows included."""
    return [(panel.get("title", ""), target["expr"])
            for panel in all_panels(dashboard) for target in panel.get("targets") or [] if target.get("expr")]


# Grafana's forms: $name, ${name}, ${name:format}, [[name]]. `$1` (a label_replace back-reference) is no variable.
_VARIABLE = re.compile(r"\$\{(?P<braced>[A-Za-z_]\w*)(?::[^}]*)?\}"
                       r"|\$(?P<bare>[A-Za-z_]\w*)"
                       r"|\[\[(?P<old>[A-Za-z_]\w*)(?::\w+)?\]\]")
_BUILTINS = {"__rate_interval": "1m", "__interval": "1m", "__range": "1h"}
_METRIC = re.compile(r"(?<![\w:])(?:inferplane|process)_[A-Za-z0-9_:]*")


def _variable_name(match: re.Match[str]) -> str:
    return match["braced"] or match["bare"] or match["old"]


def used_variables(expr: str) -> set[str]:
    """Names of the template variables an expression refers to (Grafana's built-ins, `__*`, left out)."""
    return {name for name in map(_variable_name, _VARIABLE.finditer(expr)) if not name.startswith("__")}


def substitute_variables(expr: str, values: Mapping[str, str] | None = None) -> str:
    """The expression with every variable replaced, as Grafana would send it: built-in intervals become
    "1m" (`$__rate_interval`, `$__interval`) and "1h" (`$__range`); template variables take `values[name]`,
    else ".*" (their "All")."""
    replacements = {**_BUILTINS, **(values or {})}
    return _VARIABLE.sub(lambda match: replacements.get(_variable_name(match), ALL_VALUE), expr)


def used_metric_names(expr: str) -> set[str]:
    """The stored metric names an expression reads (suffixes `_total`, `_bucket`, ... as written)."""
    return set(_METRIC.findall(expr))
