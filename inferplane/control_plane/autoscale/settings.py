"""From a spec's `autoscaling` section to what the autoscaler and the activator need (one place for
both actuators: `inferplane up` and the cluster gateway)."""

from __future__ import annotations

from dataclasses import dataclass

from inferplane.api.deployment import InferenceDeploymentSpec
from inferplane.api.resolve import ResolvedDeployment, resolve
from inferplane.control_plane.autoscale.activator import HoldPolicy
from inferplane.control_plane.autoscale.autoscaler import Autoscaler, ScaleTarget
from inferplane.control_plane.autoscale.decision import Policy
from inferplane.control_plane.autoscale.signals import Targets


@dataclass(frozen=True)
class AutoscaleSettings:
    policy: Policy
    targets: Targets
    hold: HoldPolicy | None  # set when the deployment may sit at zero replicas
    slots: int  # the workers' maxNumSeqs after presets


def autoscale_settings(spec: InferenceDeploymentSpec,
                       resolved: ResolvedDeployment | None = None) -> AutoscaleSettings | None:
    """None when the spec does not enable autoscaling (its replicas are then the user's).
    `resolved`: the spec already resolved, where the caller has it (else resolved here)."""
    a = spec.autoscaling
    if not a.enabled:
        return None
    return AutoscaleSettings(
        policy=Policy.from_spec(spec),
        targets=Targets(queue_depth=a.target_queue_depth, kv_cache_utilization=a.target_kv_cache_utilization,
                        ttft_p95_seconds=spec.slo.ttft_p95_seconds),
        hold=HoldPolicy(a.queue_size, a.queue_timeout_seconds) if spec.min_replicas == 0 else None,
        slots=int((resolved or resolve(spec)).engine["max_num_seqs"]))  # type: ignore[arg-type]


def watch(autoscaler: Autoscaler, name: str, served_model: str, deployment: str, settings: AutoscaleSettings) -> None:
    """Has `autoscaler` scale `name` (a Scaler's name), and its activator hold `served_model`'s requests
    at zero replicas when the settings allow zero."""
    autoscaler.watch(ScaleTarget(name=name, served_model=served_model, deployment=deployment,
                                 policy=settings.policy, targets=settings.targets, slots=settings.slots,
                                 counts_held=settings.hold is not None))
    if settings.hold is not None:
        autoscaler.activator.configure(served_model, settings.hold)
