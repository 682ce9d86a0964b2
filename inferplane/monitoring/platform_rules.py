"""Rules for the platform itself (gateway, database, usage billing, tenants' quota, keys, operator).

Rendered once into `deploy/monitoring/` and the chart (`inferplane monitoring render`), not per
deployment. Alerts about one tenant carry its `tenant` label, which is how the control plane's
alert webhook routes them to that tenant.
"""

from __future__ import annotations

from inferplane.api import metric_names as m
from inferplane.monitoring.rules import Alert, Group, Record

GATEWAY_5XX = "inferplane:gateway_5xx:ratio_rate5m"
AUTH_FAILURES = "inferplane:gateway_auth_failures:rate"
QUOTA_USED = "inferplane:tenant_quota:used_ratio"
KEY_LIMITED = "inferplane:key_rate_limited:ratio_rate5m"
FLUSH_LAG = "inferplane:usage_flush:lag_seconds"

GATEWAY_5XX_RATIO = 0.05
AUTH_SPIKE_FACTOR = 5  # times the day's rate
AUTH_SPIKE_FLOOR = 1.0  # per second: a handful of typos is no spike
KEY_LIMITED_SHARE = 0.25
FLUSH_LAG_SECONDS = 300


def _records() -> list[Record]:
    requests = m.series(m.GATEWAY_REQUESTS)
    keys = m.series(m.KEY_REQUESTS)
    return [
        Record(GATEWAY_5XX, f'(sum(rate({requests}{{status=~"5.."}}[5m])) or sum(rate({requests}[5m])) * 0)\n'
                            f" / sum(rate({requests}[5m]))"),
        Record(f"{AUTH_FAILURES}5m", f'sum(rate({requests}{{status="401"}}[5m]))'),
        Record(f"{AUTH_FAILURES}1d", f'sum(rate({requests}{{status="401"}}[1d]))'),
        # Every gateway replica reports the same database-backed figures: max, not sum.
        Record(QUOTA_USED, f"max by (tenant) ({m.TENANT_QUOTA_USED_TOKENS})\n"
                           f" / max by (tenant) ({m.TENANT_QUOTA_TOKENS} > 0)"),
        Record(KEY_LIMITED, f'sum by (tenant, key) (rate({keys}{{result="rate_limited"}}[5m]))\n'
                            f" / sum by (tenant, key) (rate({keys}[5m]))"),
        Record(FLUSH_LAG, f"time() - {m.USAGE_FLUSH_LAST_SUCCESS}"),
    ]


def _alerts() -> list[Alert]:
    reconciles = m.series(m.OPERATOR_RECONCILES)
    return [
        Alert("InferplaneGatewayErrors", f"{GATEWAY_5XX} > {GATEWAY_5XX_RATIO}", "critical",
              "Gateway answers 5xx to many requests",
              "{{ $value | humanizePercentage }} of tenant API requests got a 5xx over 5 minutes: no replica, "
              "failing workers or a database outage.", for_="5m"),
        Alert("InferplaneAuthFailuresSpike",
              f"{AUTH_FAILURES}5m > {AUTH_SPIKE_FLOOR}\n"
              f" and {AUTH_FAILURES}5m > {AUTH_SPIKE_FACTOR} * {AUTH_FAILURES}1d",
              "warning", "Authentication failures spiking",
              "{{ $value | humanize }} requests per second are refused for a missing or wrong API key, over "
              f"{AUTH_SPIKE_FACTOR} times the day's rate: a leaked or revoked key in use, or key guessing.",
              for_="5m"),
        Alert("InferplaneTenantQuotaNearlySpent", f"{QUOTA_USED} >= 0.8 < 1", "warning",
              "Tenant {{ $labels.tenant }} has used 80% of its monthly token quota",
              "Tenant {{ $labels.tenant }} has used {{ $value | humanizePercentage }} of this month's token "
              "quota; at 100% its requests get 429 until the month rolls over."),
        Alert("InferplaneTenantQuotaExhausted", f"{QUOTA_USED} >= 1", "critical",
              "Tenant {{ $labels.tenant }} has spent its monthly token quota",
              "Tenant {{ $labels.tenant }} used {{ $value | humanizePercentage }} of its quota: its requests are "
              "refused (429) until the month rolls over or the quota is raised."),
        Alert("InferplaneKeyRateLimited", f"{KEY_LIMITED} > {KEY_LIMITED_SHARE}", "warning",
              "Key {{ $labels.key }} of tenant {{ $labels.tenant }} is rate limited",
              "{{ $value | humanizePercentage }} of key {{ $labels.key }}'s requests got 429 over 5 minutes: "
              "the client sends faster than the key's requests or tokens per minute allow.", for_="10m"),
        Alert("InferplaneUsageFlushLagging", f"{FLUSH_LAG} > {FLUSH_LAG_SECONDS}", "critical",
              "Usage records are not reaching the database",
              "Gateway {{ $labels.instance }} last wrote usage {{ $value | humanizeDuration }} ago: billing "
              "and quota lag behind, and the buffered records die with the process.", for_="5m"),
        Alert("InferplaneDatabaseUnreachable", f"{m.DATABASE_UP} == 0", "critical",
              "The control plane cannot reach its database",
              "Gateway {{ $labels.instance }} failed its last database read: keys, tenants and models are "
              "served from cache, new keys and usage writes wait.", for_="2m"),
        Alert("InferplaneOperatorDown", f"absent({m.OPERATOR_BUILD_INFO})", "critical",
              "The inferplane operator is not running",
              "No operator exports metrics: InferenceDeployments are not reconciled (new ones get no pods, "
              "changes are not applied).", for_="10m"),
        Alert("InferplaneReconcileErrors", f'sum(increase({reconciles}{{result="error"}}[15m])) > 3', "warning",
              "The operator's reconciles fail",
              "{{ $value | humanize }} reconciles of InferenceDeployments failed in 15 minutes; the "
              "InferenceDeployments' status conditions and the operator's log say why.", for_="15m"),
    ]


def platform_groups() -> list[Group]:
    return [Group("inferplane.platform.records", tuple(_records())),
            Group("inferplane.platform.alerts", tuple(_alerts()))]
