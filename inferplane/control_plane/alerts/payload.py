"""Alertmanager's webhook body (version "4"), validated in full before anything is written.

https://prometheus.io/docs/alerting/latest/configuration/#webhook_config documents it. Fields the
router uses are strict (status values, string labels, timezone-aware times, a fingerprint); fields
it does not use are accepted as sent, and unknown ones ignored, so a newer Alertmanager adding a
field is not refused.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, field_validator

AlertStatus = Literal["firing", "resolved"]

# Alertmanager sends this as endsAt of an alert that has no end yet.
_NO_END_YEAR = 1


class AlertmanagerAlert(BaseModel):
    model_config = ConfigDict(extra="ignore")

    status: AlertStatus
    labels: dict[str, str]
    annotations: dict[str, str] = Field(default_factory=dict)
    startsAt: AwareDatetime
    endsAt: AwareDatetime | None = None
    generatorURL: str = Field(default="", max_length=4096)
    # Alertmanager's are 16 hex digits; anything else printable and short is taken as an opaque id.
    fingerprint: str = Field(min_length=1, max_length=128, pattern=r"^[0-9A-Za-z_.:-]+$")

    @field_validator("generatorURL")
    @classmethod
    def _no_nul(cls, value: str) -> str:
        if "\x00" in value:  # PostgreSQL text cannot hold it: a 400 here, not a database error later
            raise ValueError("must not contain NUL characters")
        return value

    @property
    def ends_at(self) -> datetime | None:
        """endsAt, or None for Alertmanager's "no end" (year 1)."""
        if self.endsAt is None or self.endsAt.year <= _NO_END_YEAR:
            return None
        return self.endsAt


class AlertmanagerWebhook(BaseModel):
    model_config = ConfigDict(extra="ignore")

    version: Literal["4"]
    status: AlertStatus
    receiver: str
    alerts: list[AlertmanagerAlert] = Field(max_length=10_000)
    groupKey: str = ""
    truncatedAlerts: int = Field(default=0, ge=0)
    groupLabels: dict[str, str] = Field(default_factory=dict)
    commonLabels: dict[str, str] = Field(default_factory=dict)
    commonAnnotations: dict[str, str] = Field(default_factory=dict)
    externalURL: str = ""
