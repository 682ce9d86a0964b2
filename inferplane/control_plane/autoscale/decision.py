"""The scaling decision, Knative's KPA rule as a pure function (no clock, no I/O, no state of its own).

`decide(samples, now, current, policy, state)` → `Decision` (desired replicas, why, next state):
- stable load = mean saturation over the stable window (60 s); desired = its ceiling, unless it is
  within `tolerance` of the current count (no churn for noise);
- panic: when the panic window's mean (6 s) asks for `panic_threshold` (2x) the current replicas,
  scale to it at once and refuse to scale down until a whole stable window passes without panic;
- one step grows by at most `max_scale_up_rate` times the current count;
- scaling down goes only to the highest count recommended over `scale_down_delay` (so a short lull
  does not shed replicas a returning load needs);
- to zero only with `min_replicas` 0, after `idle_seconds` without load; a held request (saturation
  > 0) brings a replica back at once;
- always within [min_replicas, max_replicas].
Saturation is in replicas' worth of load (see signals.py), so "desired = ceil(load)" is the whole
model; everything else is damping.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from inferplane.api.deployment import Autoscaling, InferenceDeploymentSpec

_SPEC = Autoscaling()  # the spec's defaults are the policy's: one home for each


@dataclass(frozen=True)
class Policy:
    """The damping of one deployment; what a caller leaves out is the spec's `autoscaling` default."""

    min_replicas: int
    max_replicas: int
    stable_window: float = _SPEC.stable_window_seconds
    panic_window: float = _SPEC.panic_window_seconds
    panic_threshold: float = _SPEC.panic_threshold
    tolerance: float = _SPEC.tolerance
    max_scale_up_rate: float = _SPEC.max_scale_up_rate
    scale_down_delay: float = _SPEC.scale_down_delay_seconds
    idle_seconds: float = _SPEC.idle_seconds

    @classmethod
    def from_spec(cls, spec: InferenceDeploymentSpec) -> Policy:
        a = spec.autoscaling
        return cls(min_replicas=spec.min_replicas, max_replicas=spec.max_replicas or spec.replicas,
                   stable_window=a.stable_window_seconds, panic_window=a.panic_window_seconds,
                   panic_threshold=a.panic_threshold, tolerance=a.tolerance, max_scale_up_rate=a.max_scale_up_rate,
                   scale_down_delay=a.scale_down_delay_seconds, idle_seconds=a.idle_seconds)


@dataclass(frozen=True)
class Sample:
    at: float
    saturation: float  # replicas' worth of load, see signals.saturation


@dataclass(frozen=True)
class State:
    panic_until: float | None = None
    recommendations: tuple[tuple[float, int], ...] = ()  # (when, count) within scale_down_delay
    last_active: float | None = None  # last sample with any load


@dataclass(frozen=True)
class Decision:
    desired: int
    panic: bool
    reason: str
    stable_load: float
    panic_load: float
    state: State = field(default_factory=State)


def _ceil(load: float) -> int:
    return max(0, math.ceil(load - 1e-9))


def decide(samples: Sequence[Sample], now: float, current: int, policy: Policy, state: State) -> Decision:
    window = [s for s in samples if now - policy.stable_window <= s.at <= now]
    low, high = policy.min_replicas, policy.max_replicas
    if not window:
        desired = min(max(current, low), high)
        return Decision(desired, False, "no signal yet", 0.0, 0.0, state)
    stable = sum(s.saturation for s in window) / len(window)
    recent = [s for s in window if s.at >= now - policy.panic_window] or window[-1:]  # a late tick: the newest
    burst = sum(s.saturation for s in recent) / len(recent)
    last_active = state.last_active if state.last_active is not None else window[0].at
    if window[-1].saturation > 0:
        last_active = now

    within_tolerance = current > 0 and abs(stable - current) <= policy.tolerance * current
    want_stable = current if within_tolerance else _ceil(stable)
    want_panic = _ceil(burst)
    panic_until = state.panic_until if state.panic_until is not None and now < state.panic_until else None
    if want_panic > current and want_panic >= policy.panic_threshold * max(current, 1):
        panic_until = now + policy.stable_window
    panic = panic_until is not None

    want = max(current, want_panic, want_stable) if panic else want_stable
    reason = (f"panic: the last {policy.panic_window:g} s carry {burst:.2f} replicas of load" if panic
              else f"{policy.stable_window:g}-s load {stable:.2f} replicas")
    cap = max(1, math.ceil(max(current, 1) * policy.max_scale_up_rate))
    if want > cap:
        want, reason = cap, f"{reason}; growth capped at {policy.max_scale_up_rate:g}x"
    recommendations = tuple((at, n) for at, n in state.recommendations if at > now - policy.scale_down_delay)
    recommendations += ((now, want),)
    desired = max(n for _, n in recommendations)
    if desired > want:
        reason = f"{reason}; scale-down delayed ({desired} wanted within {policy.scale_down_delay:g} s)"
    if panic:
        desired = max(desired, current)
    if low == 0 and desired == 0 and current > 0 and now - last_active < policy.idle_seconds:
        desired, reason = 1, f"{reason}; idle for {now - last_active:.0f} s of {policy.idle_seconds:g} s"
    clamped = min(max(desired, low), high)
    if clamped != desired:
        reason = f"{reason}; held within {low}..{high}"
    return Decision(clamped, panic, reason, stable, burst,
                    State(panic_until=panic_until, recommendations=recommendations, last_active=last_active))
