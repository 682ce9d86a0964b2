"""The shape of an InferenceDeployment's status, as the operator writes it (operator/status.py).

Declared as a model so that the CRD's status schema is generated from it (api/crd.py) like the
spec's, and so that tests can hold what the operator computes against what the CRD allows.
"""

from __future__ import annotations

import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from inferplane.api.deployment import ConcreteRuntime

Phase = Literal["Pending", "Progressing", "Ready", "Degraded", "ScaledToZero", "Failed"]


class _StatusPart(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class Condition(_StatusPart):
    """A Kubernetes-style condition; lastTransitionTime changes only when status does."""

    type: Literal["Ready", "Progressing", "Degraded", "ModelResolved"]
    status: Literal["True", "False", "Unknown"]
    reason: str | None = None
    message: str | None = None
    last_transition_time: datetime.datetime | None = None
    observed_generation: int | None = None


class AutoscalerStatus(_StatusPart):
    """The control plane's last scaling decision (see inferplane.control_plane.autoscale)."""

    desired_replicas: int | None = None
    current_replicas: int | None = None
    saturation: float | None = Field(None, description="Load in replicas' worth over the stable window.")
    panic: bool | None = None
    last_scale_time: datetime.datetime | None = None
    reason: str | None = None


class ModelStatus(_StatusPart):
    """The registry entry `spec.model.name` resolved to: what the workers fetch and verify."""

    name: str
    version: str
    sha256: str
    uri: str
    format: str


class AdapterStatus(_StatusPart):
    """A LoRA adapter of spec.adapters as the registry resolved it: every worker loads it at start."""

    name: str
    version: str
    sha256: str


class InferenceDeploymentStatus(_StatusPart):
    phase: Phase | None = None
    observed_generation: int | None = None
    replicas: int | None = None
    ready_replicas: int | None = None
    selector: str | None = None
    selected_runtime: ConcreteRuntime | None = None
    runtime_reason: str | None = None
    endpoints: list[str] = Field(default_factory=list)
    autoscaler: AutoscalerStatus | None = None
    model: ModelStatus | None = None
    adapters: list[AdapterStatus] = Field(default_factory=list)
    conditions: list[Condition] = Field(default_factory=list, json_schema_extra={
        "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]})
