"""The autoscaler's decision: Knative-style windows on a fake clock, and properties over any history."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from inferplane.api.deployment import InferenceDeploymentSpec
from inferplane.control_plane.autoscale.decision import Policy, Sample, State, decide
from inferplane.control_plane.autoscale.signals import ReplicaSignals, Targets, replica_load, saturation

POLICY = Policy(min_replicas=1, max_replicas=20, stable_window=60, panic_window=6, scale_down_delay=120,
                idle_seconds=300)


class Run:
    """Feeds one sample a second and applies each decision, as the control plane's loop does."""

    def __init__(self, policy: Policy = POLICY, current: int = 1, now: float = 1000.0):
        self.policy, self.current, self.now = policy, current, now
        self.samples: list[Sample] = []
        self.state = State()
        self.decisions = []

    def run(self, seconds: int, load) -> None:
        for _ in range(seconds):
            self.now += 1
            value = load(self.current) if callable(load) else load
            self.samples.append(Sample(self.now, value))
            decision = decide(self.samples, self.now, self.current, self.policy, self.state)
            self.state, self.current = decision.state, decision.desired
            self.decisions.append(decision)


def test_a_tenfold_burst_panics_within_the_panic_window():
    run = Run(current=2)
    run.run(120, 1.6)  # steady: two replicas at 80 %
    assert run.current == 2
    run.run(6, 16.0)  # ten times the load
    assert run.current >= 4 and run.decisions[-1].panic, run.decisions[-1]
    run.run(30, 16.0)
    assert run.current == 16


def test_no_scale_down_while_panicking_and_only_after_the_delay():
    run = Run(current=2)
    run.run(60, 1.6)
    run.run(10, 16.0)
    peak = run.current
    run.run(50, 1.6)  # the burst is over, but the panic lasts a stable window
    assert run.current == peak
    assert all(d.desired >= peak for d in run.decisions[-50:])
    run.run(60, 1.6)  # calm, but within scale_down_delay of the peak's recommendations
    assert run.current > 2
    run.run(200, 1.6)
    assert run.current == 2


def test_idle_scales_to_zero_only_after_the_idle_period_and_a_held_request_wakes_it():
    policy = Policy(min_replicas=0, max_replicas=4, stable_window=60, panic_window=6, scale_down_delay=30,
                    idle_seconds=300)
    run = Run(policy, current=1)
    run.run(30, 0.5)
    run.run(250, 0.0)
    assert run.current == 1  # idle, but not for idle_seconds yet
    run.run(60, 0.0)
    assert run.current == 0 and "idle" not in run.decisions[-1].reason
    run.run(1, saturation([], Targets(), held=1))  # a request is held at zero replicas
    assert run.current == 1


def test_tolerance_and_limits():
    run = Run(Policy(min_replicas=2, max_replicas=5), current=4)
    run.run(120, 4.3)  # within 10 % of 4
    assert run.current == 4
    run.run(200, 100.0)
    assert run.current == 5  # never above max
    run.run(400, 0.0)
    assert run.current == 2  # never below min


def test_growth_is_capped_per_step():
    run = Run(Policy(min_replicas=1, max_replicas=1000, max_scale_up_rate=2), current=1)
    run.run(1, 500.0)
    assert run.current == 2


def test_policy_from_spec():
    spec = InferenceDeploymentSpec.from_dict({"model": {"name": "m"}, "minReplicas": 0, "maxReplicas": 7,
                                              "replicas": 1, "autoscaling": {"enabled": True, "panicWindowSeconds": 3,
                                                                            "idleSeconds": 10}})
    policy = Policy.from_spec(spec)
    assert (policy.min_replicas, policy.max_replicas, policy.panic_window, policy.idle_seconds) == (0, 7, 3, 10)


def test_signals_each_runtime_by_its_dominant_pressure():
    targets = Targets(queue_depth=4, kv_cache_utilization=0.8, ttft_p95_seconds=2.0)
    busy = ReplicaSignals(running=16, waiting=4, max_num_seqs=16, blocks_used=10, blocks_total=100)
    assert replica_load(busy, targets) == 1.0  # slots full and the target queue: exactly one replica's worth
    long_context = ReplicaSignals(running=3, waiting=0, max_num_seqs=16, blocks_used=96, blocks_total=100)
    assert replica_load(long_context, targets) == 1.2  # KV dominates: 96 % against 80 %
    radix = ReplicaSignals(running=3, max_num_seqs=16, blocks_used=16, blocks_cached=80, blocks_total=100)
    assert replica_load(radix, targets) < 0.25  # cached prefixes are reclaimable
    silent = ReplicaSignals(max_num_seqs=16, gateway_in_flight=40)  # no stats: the gateway's count stands in
    assert replica_load(silent, targets) == 2.0
    slow = ReplicaSignals(running=16, waiting=1, max_num_seqs=16, ttft_p95_seconds=6.0)
    assert replica_load(slow, targets) == 3.0  # queueing shows in TTFT three times the SLO


loads = st.floats(0, 200, allow_nan=False)


@settings(max_examples=300, deadline=None)
@given(history=st.lists(st.tuples(st.floats(0, 20), loads), min_size=1, max_size=60),
       current=st.integers(0, 50), low=st.integers(0, 5), span=st.integers(0, 30))
def test_property_never_outside_min_max_and_never_down_in_panic(history, current, low, span):
    policy = Policy(min_replicas=low, max_replicas=low + max(span, 1))
    now, samples, state = 0.0, [], State()
    for gap, load in history:
        now += gap
        samples.append(Sample(now, load))
        decision = decide(samples, now, current, policy, state)
        assert policy.min_replicas <= decision.desired <= policy.max_replicas
        if decision.panic:
            assert decision.desired >= min(current, policy.max_replicas)
        state, current = decision.state, decision.desired


@settings(max_examples=200, deadline=None)
@given(load=st.floats(0.05, 40, allow_nan=False))
def test_property_a_steady_load_at_the_target_never_flaps(load):
    policy = Policy(min_replicas=1, max_replicas=100)
    run = Run(policy, current=max(1, -(-load // 1)).__int__())
    run.run(400, load)
    assert len({d.desired for d in run.decisions}) == 1, {d.desired for d in run.decisions}


def test_a_decision_long_after_the_last_sample_uses_the_newest():
    decision = decide([Sample(0.0, 5.0)], 30.0, 1, POLICY, State())  # nothing in the 6-s panic window
    assert decision.desired == 5 and decision.panic
