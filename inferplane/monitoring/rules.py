"""Prometheus rules as data: one `Rule` type, the runbook links, and the rule-file layout.

Deployment rules (`deployment_rules.py`) and platform rules (`platform_rules.py`) are built from
these, then written as plain rule files (`rule_files:`) or wrapped in a PrometheusRule. Every alert
carries `severity`, `summary`, `description` and a `runbook_url` into `deploy/monitoring/RUNBOOK.md`,
whose headings a test holds to the alert names.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

RUNBOOK_URL = "https://github.com/inferplane/inferplane/blob/main/deploy/monitoring/RUNBOOK.md"
Severity = Literal["critical", "warning", "info"]


def runbook_anchor(alert: str) -> str:
    """GitHub's anchor for a `## <alert>` heading: the name lower-cased."""
    return alert.lower()


@dataclass(frozen=True)
class Record:
    """A recording rule: `name` (level:metric:operations) holds `expr` evaluated every interval."""

    name: str
    expr: str
    labels: Mapping[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"record": self.name, "expr": self.expr}
        if self.labels:
            out["labels"] = dict(self.labels)
        return out


@dataclass(frozen=True)
class Alert:
    name: str
    expr: str
    severity: Severity
    summary: str
    description: str
    for_: str = "0m"
    labels: Mapping[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"alert": self.name, "expr": self.expr}
        if self.for_ != "0m":
            out["for"] = self.for_
        out["labels"] = {"severity": self.severity, **self.labels}
        out["annotations"] = {"summary": self.summary, "description": self.description,
                              "runbook_url": f"{RUNBOOK_URL}#{runbook_anchor(self.name)}"}
        return out


@dataclass(frozen=True)
class Group:
    name: str
    rules: tuple[Record | Alert, ...]
    interval: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name}
        if self.interval:
            out["interval"] = self.interval
        out["rules"] = [r.to_dict() for r in self.rules]
        return out

    @property
    def alerts(self) -> list[Alert]:
        return [r for r in self.rules if isinstance(r, Alert)]

    @property
    def records(self) -> list[Record]:
        return [r for r in self.rules if isinstance(r, Record)]


def rule_file(groups: Iterable[Group]) -> dict[str, Any]:
    """The body of a Prometheus rule file, which is also a PrometheusRule's `spec`."""
    return {"groups": [g.to_dict() for g in groups]}


def matchers(labels: Mapping[str, str]) -> str:
    """`a="x", b="y"`: label matchers for a selector, values escaped as PromQL strings."""
    return ", ".join(f'{k}="{_escape(v)}"' for k, v in labels.items())


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


def number(value: float) -> str:
    return f"{value:g}"
