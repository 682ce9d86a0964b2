"""Alert and recording rules for one InferenceDeployment, from its `slo` and `autoscaling`.

SLO alerts follow the Google SRE workbook's multi-window, multi-burn-rate scheme (as Sloth and
Pyrra generate it): an alert fires when the error budget burns fast over a long window *and* is
still burning over a short one, so it pages quickly on a real outage and stops soon after it ends.
Two SLIs: requests that failed on the workers (`slo.errorRatePercent` is the budget) and worker
scrapes up (`slo.availability`). Saturation alerts cover what every runtime runs out of.

Worker series are scoped by `namespace` and `service` (the labels a ServiceMonitor adds; the
Service has the deployment's name); the gateway's and autoscaler's by `deployment`, their name for
it ("namespace/name" in a cluster). Recorded series keep `namespace` and `service`, so one
recording rule name serves every deployment.
"""

from __future__ import annotations

from dataclasses import dataclass

from inferplane.api import metric_names as m
from inferplane.api.deployment import InferenceDeploymentSpec
from inferplane.monitoring.rules import Alert, Group, Record, matchers, number

BY = "namespace, service"
# (long window, short window, burn factor): page on the first two, ticket on the last two.
FAST_BURNS = (("1h", "5m", 14.4), ("6h", "30m", 6.0))
SLOW_BURNS = (("1d", "2h", 3.0), ("3d", "6h", 1.0))
WINDOWS = ("5m", "30m", "1h", "2h", "6h", "1d", "3d")
ROLLOUT_GRACE = "15m"  # longer than a rollout of model-loading pods takes; then ready < desired is real
KV_FULL = 0.9
RESTARTS = 2  # process restarts in 30 minutes before the alert


@dataclass(frozen=True)
class DeploymentScope:
    """Which series belong to one deployment, and the labels its alerts carry."""

    namespace: str
    name: str
    deployment: str  # the gateway's and autoscaler's `deployment` label value
    tenant: str | None = None

    @classmethod
    def in_cluster(cls, namespace: str, name: str, spec: InferenceDeploymentSpec) -> DeploymentScope:
        return cls(namespace, name, f"{namespace}/{name}", spec.tenant)

    @property
    def workers(self) -> str:
        return matchers({"namespace": self.namespace, "service": self.name})

    @property
    def gateway(self) -> str:
        return matchers({"deployment": self.deployment})

    @property
    def alert_labels(self) -> dict[str, str]:
        labels = {"namespace": self.namespace, "deployment": self.name}
        if self.tenant:
            labels["tenant"] = self.tenant
        return labels


def error_ratio(window: str) -> str:
    return f"inferplane:worker_request_errors:ratio_rate{window}"


def unavailability(window: str) -> str:
    return f"inferplane:worker_scrape_unavailability:ratio_avg{window}"


TTFT_P95 = "inferplane:worker_ttft_seconds:p95_rate5m"
KV_UTILIZATION = "inferplane:worker_kv_utilization:max"
WAITING = "inferplane:worker_requests_waiting:sum"
PREFIX_HIT = "inferplane:worker_prefix_cache_hit:ratio_rate"


def _records(scope: DeploymentScope) -> list[Record]:
    """Every record carries the deployment's `namespace` and `service` as static labels too (the
    values its `by (namespace, service)` gives anyway): several deployments' groups in one rule
    file then record distinct series by promtool's reckoning, not "duplicate rules"."""
    return [Record(r.name, r.expr, {"namespace": scope.namespace, "service": scope.name}) for r in _exprs(scope)]


def _exprs(scope: DeploymentScope) -> list[Record]:
    w = scope.workers
    requests = m.series(m.WORKER_REQUESTS)
    records = []
    for window in WINDOWS:
        total = f"sum by ({BY}) (rate({requests}{{{w}}}[{window}]))"
        errors = f'sum by ({BY}) (rate({requests}{{{w}, outcome="error"}}[{window}]))'
        # No error series yet reads as 0 errors, not as no data.
        records.append(Record(error_ratio(window), f"({errors} or {total} * 0) / {total}"))
        records.append(Record(unavailability(window), f"1 - avg by ({BY}) (avg_over_time(up{{{w}}}[{window}]))"))
    records += [
        Record(TTFT_P95, f"histogram_quantile(0.95, sum by ({BY}, le) (rate({m.WORKER_TTFT}_bucket{{{w}}}[5m])))"),
        Record(KV_UTILIZATION, f"max by ({BY}) ({m.WORKER_KV_USED}{{{w}}} / {m.WORKER_KV_CAPACITY}{{{w}}})"),
        Record(WAITING, f"sum by ({BY}) ({m.WORKER_WAITING}{{{w}}})"),
    ]
    hits, queries = m.series(m.WORKER_PREFIX_HIT_TOKENS), m.series(m.WORKER_PREFIX_QUERY_TOKENS)
    for window in ("30m", "1d"):
        # No prompt looked up in the window: NaN, which no comparison in an alert matches.
        records.append(Record(f"{PREFIX_HIT}{window}", f"sum by ({BY}) (rate({hits}{{{w}}}[{window}])) / "
                                                       f"sum by ({BY}) (rate({queries}{{{w}}}[{window}]))"))
    return records


def _burn(series, budget: float, burns: tuple[tuple[str, str, float], ...], scope: str) -> str:
    pairs = [f"({series(long)}{{{scope}}} > {number(factor * budget)} and "
             f"{series(short)}{{{scope}}} > {number(factor * budget)})" for long, short, factor in burns]
    return "\n or ".join(pairs)


def _slo_alerts(spec: InferenceDeploymentSpec, scope: DeploymentScope) -> list[Alert]:
    w, name, labels = scope.workers, scope.name, scope.alert_labels
    slo = spec.slo
    error_budget = slo.error_rate_percent / 100
    down_budget = 1 - slo.availability / 100
    return [
        Alert("InferplaneErrorBudgetBurnFast", _burn(error_ratio, error_budget, FAST_BURNS, w), "critical",
              f"{name}: failed requests burn the error budget fast",
              f"Failed requests on {scope.namespace}/{name} exceed {number(slo.error_rate_percent)}% by 6x or more "
              "over the last 30 minutes to 6 hours; at this pace the month's budget is gone in days. "
              "Error ratio now: {{ $value | humanizePercentage }}.", for_="2m", labels=labels),
        Alert("InferplaneErrorBudgetBurnSlow", _burn(error_ratio, error_budget, SLOW_BURNS, w), "warning",
              f"{name}: failed requests burn the error budget",
              f"Failed requests on {scope.namespace}/{name} stay above the {number(slo.error_rate_percent)}% "
              "budget over hours to days. Error ratio: {{ $value | humanizePercentage }}.", for_="15m",
              labels=labels),
        Alert("InferplaneAvailabilityBurnFast", _burn(unavailability, down_budget, FAST_BURNS, w), "critical",
              f"{name}: workers down, availability budget burning fast",
              f"Worker scrapes of {scope.namespace}/{name} fail far more than the {number(slo.availability)}% "
              "availability objective allows. Unavailable share: {{ $value | humanizePercentage }}.",
              for_="2m", labels=labels),
        Alert("InferplaneAvailabilityBurnSlow", _burn(unavailability, down_budget, SLOW_BURNS, w), "warning",
              f"{name}: availability budget burning",
              f"Worker scrapes of {scope.namespace}/{name} fail more than the {number(slo.availability)}% "
              "objective allows over hours to days. Unavailable share: {{ $value | humanizePercentage }}.",
              for_="15m", labels=labels),
        Alert("InferplaneTTFTAboveSLO", f"{TTFT_P95}{{{w}}} > {number(slo.ttft_p95_seconds)}", "warning",
              f"{name}: p95 time to first token above {number(slo.ttft_p95_seconds)}s",
              f"p95 time to first token on {scope.namespace}/{name} is {{{{ $value | humanizeDuration }}}} "
              f"over the last 5 minutes, above the {number(slo.ttft_p95_seconds)}s objective.",
              for_="10m", labels=labels),
    ]


def _saturation_alerts(spec: InferenceDeploymentSpec, scope: DeploymentScope) -> list[Alert]:
    w, g, name, labels = scope.workers, scope.gateway, scope.name, scope.alert_labels
    preemptions = m.series(m.WORKER_PREEMPTIONS)
    alerts = [
        Alert("InferplaneKVCacheNearFull",
              f"{KV_UTILIZATION}{{{w}}} > {number(KV_FULL)}\n"
              f" and on({BY}) sum by ({BY}) (rate({preemptions}{{{w}}}[10m])) > 0", "warning",
              f"{name}: KV cache full and sequences preempted",
              f"A worker of {scope.namespace}/{name} uses {{{{ $value | humanizePercentage }}}} of its KV blocks "
              "and preempts running sequences (they are recomputed later): add replicas or KV memory.",
              for_="10m", labels=labels),
        Alert("InferplaneQueueGrowing",
              # deriv first: `and` keeps the left side's value, the growth the description reports.
              f"deriv({WAITING}{{{w}}}[15m]) > 0\n and min_over_time({WAITING}{{{w}}}[15m]) > 0", "warning",
              f"{name}: waiting queue growing",
              f"Requests have waited on {scope.namespace}/{name} for 15 minutes without the queue ever "
              "emptying, and it keeps growing ({{ $value }} more per second): demand exceeds capacity.",
              for_="5m", labels=labels),
        Alert("InferplanePrefixHitRateCollapsed",
              f"{PREFIX_HIT}30m{{{w}}} < 0.5 * {PREFIX_HIT}1d{{{w}}}\n and {PREFIX_HIT}1d{{{w}}} > 0.1", "warning",
              f"{name}: prefix cache hit rate fell below half its daily level",
              f"The prefix cache of {scope.namespace}/{name} hits {{{{ $value | humanizePercentage }}}} of prompt "
              "tokens over 30 minutes, under half its 1-day level: traffic changed, cache isolation changed, "
              "or requests no longer reach the replica holding their prefix.", for_="30m", labels=labels),
        Alert("InferplaneWorkerRestarting",
              f"sum by ({BY}) (changes({m.PROCESS_START_TIME}{{{w}}}[30m])) > {RESTARTS}", "warning",
              f"{name}: workers restarting",
              f"Worker processes of {scope.namespace}/{name} restarted {{{{ $value }}}} times in 30 minutes "
              "(out of memory, a crash at load, or a failing liveness probe).", labels=labels),
        Alert("InferplaneReplicasNotReady",
              # max, not sum: every gateway replica reports the same deployment.
              f"max by (deployment) ({m.DEPLOYMENT_REPLICAS_READY}{{{g}}})\n"
              f" < max by (deployment) ({m.DEPLOYMENT_REPLICAS_DESIRED}{{{g}}})", "warning",
              f"{name}: fewer replicas ready than desired",
              f"{scope.namespace}/{name} has had {{{{ $value }}}} ready replicas, fewer than desired, for longer "
              f"than a rollout takes ({ROLLOUT_GRACE}): pods pending, crashing or failing health checks.",
              for_=ROLLOUT_GRACE, labels=labels),
    ]
    if spec.autoscaling.enabled:
        alerts.append(Alert(
            "InferplaneAutoscalerAtMax",
            # saturation first: its value (the load in replicas' worth) is what the description reports.
            f"{m.AUTOSCALER_SATURATION}{{{g}}} > {m.AUTOSCALER_MAX}{{{g}}}\n"
            f" and {m.AUTOSCALER_DESIRED}{{{g}}} >= {m.AUTOSCALER_MAX}{{{g}}}", "warning",
            f"{name}: autoscaler pinned at maxReplicas",
            f"{scope.namespace}/{name} runs at maxReplicas and its load asks for {{{{ $value }}}} replicas' worth: "
            "raise maxReplicas or expect queueing.", for_="15m", labels=labels))
    return alerts


def deployment_groups(spec: InferenceDeploymentSpec, scope: DeploymentScope) -> list[Group]:
    """The rule groups of one deployment: recording rules first, then alerts that read them."""
    return [Group(f"inferplane.deployment.{scope.namespace}.{scope.name}.records", tuple(_records(scope))),
            Group(f"inferplane.deployment.{scope.namespace}.{scope.name}.alerts",
                  (*_slo_alerts(spec, scope), *_saturation_alerts(spec, scope)))]
