"""spec.disaggregation: its defaults, its rules (Python and CEL alike) and what resolve() makes of it."""

from __future__ import annotations

import re
from typing import Any

import pytest

from inferplane.api.deployment import MIN_WORKER_MEMORY, InferenceDeploymentSpec, SpecError
from inferplane.api.quantities import BYTES_PATTERN, parse_bytes
from inferplane.api.resolve import DISAGGREGATION_TIER_MEMORY, prefill_spec, resolve
from tests.operator import crd

ON = {"enabled": True}


def parse(**spec: Any) -> InferenceDeploymentSpec:
    return InferenceDeploymentSpec.from_dict({"model": {"name": "m"}, **spec})


def test_left_out_it_is_off_with_one_prefill_replica_and_llm_d_threshold() -> None:
    section = parse().disaggregation
    assert section.enabled is False and section.min_prefill_tokens == 512
    pool = section.prefill
    assert (pool.replicas, pool.min_replicas, pool.max_replicas, pool.resources) == (1, 1, 1, None)


@pytest.mark.parametrize(("prefill", "bounds"), [
    ({}, (1, 1, 1)),
    ({"replicas": 4}, (4, 1, 4)),
    ({"replicas": 0, "minReplicas": 0}, (0, 0, 1)),
    ({"minReplicas": 3, "replicas": 3}, (3, 3, 3)),
    ({"replicas": 2, "maxReplicas": 8}, (2, 1, 8)),
])
def test_prefill_max_replicas_defaults_like_the_specs_own(prefill: dict, bounds: tuple[int, int, int]) -> None:
    """max(replicas, minReplicas), each as given or defaulted: the spec's own rule, one helper for both."""
    pool = parse(disaggregation={"prefill": prefill}).disaggregation.prefill
    assert (pool.replicas, pool.min_replicas, pool.max_replicas) == bounds
    spec = parse(**prefill)
    assert (spec.replicas, spec.min_replicas, spec.max_replicas) == bounds


# (spec, the field the error names, words of its message); each is refused by Python and by CEL
# where the rule has a CEL form (the last two are the webhook's alone: quantities compared as numbers).
REFUSED = [
    ({"runtime": "paged", "resources": {"gpus": 1}, "disaggregation": ON}, "disaggregation.enabled",
     "needs the radix KV manager"),
    ({"kind": "embedding", "disaggregation": ON}, "disaggregation.enabled", "kind generate"),
    ({"disaggregation": {"prefill": {"replicas": 5, "maxReplicas": 4}}}, "disaggregation.prefill.replicas",
     "must lie within"),
    ({"disaggregation": {"prefill": {"replicas": 1, "minReplicas": 2}}}, "disaggregation.prefill.replicas",
     "must lie within"),
    ({"disaggregation": {"prefill": {"replicas": 3, "minReplicas": 3, "maxReplicas": 2}}},
     "disaggregation.prefill.minReplicas", "must not exceed"),
    ({"resources": {"gpus": 1}, "disaggregation": {"enabled": True, "prefill": {"resources": {"gpus": 0}}}},
     "disaggregation.prefill.resources.gpus", "where the decode pool does"),
    ({"disaggregation": {"enabled": True, "prefill": {"resources": {"gpus": 1}}}},
     "disaggregation.prefill.resources.gpus", "where the decode pool does"),
    ({"disaggregation": {"enabled": True, "prefill": {"resources": {"memory": "1Gi"}}}},
     "disaggregation.prefill.resources.memory", f"at least {MIN_WORKER_MEMORY}"),
    ({"disaggregation": {"prefill": {"resources": {"cpu": "0"}}}}, "disaggregation.prefill.resources.cpu",
     "positive"),
]


@pytest.mark.parametrize(("spec", "field", "words"), REFUSED, ids=[f"{r[1]}-{i}" for i, r in enumerate(REFUSED)])
def test_python_refuses_naming_the_field(spec: dict, field: str, words: str) -> None:
    with pytest.raises(SpecError) as refused:
        parse(**spec)
    assert refused.value.field == field
    assert str(refused.value).startswith(f"spec.{field}: ") and words in refused.value.reason


def _crd_errors(spec: dict) -> list[str]:
    _, errors = crd.validate({"apiVersion": "inferplane.io/v1alpha1", "kind": "InferenceDeployment",
                              "metadata": {"name": "x"}, "spec": {"model": {"name": "m"}, **spec}})
    return errors


@pytest.mark.parametrize(("spec", "field", "words"), REFUSED[:7], ids=[r[1] for r in REFUSED[:7]])
def test_cel_refuses_what_python_refuses_at_the_same_field(spec: dict, field: str, words: str) -> None:
    errors = _crd_errors(spec)
    assert any(error.startswith(f"spec.{field}: ") and words in error for error in errors), errors


@pytest.mark.parametrize("spec", [
    {"disaggregation": ON},
    {"runtime": "radix", "disaggregation": ON},
    {"runtime": "cpu-int8", "disaggregation": {"enabled": True, "minPrefillTokens": 0}},
    {"resources": {"gpus": 1}, "disaggregation": {"enabled": True, "prefill": {
        "replicas": 2, "maxReplicas": 6, "resources": {"gpus": 2, "cpu": "8", "memory": "32Gi"}}}},
    {"runtime": "paged", "disaggregation": {"enabled": False, "prefill": {"replicas": 0, "minReplicas": 0}}},
    {"disaggregation": {"prefill": {"replicas": 3}}},
])
def test_cel_and_python_accept_the_same_specs_and_default_alike(spec: dict) -> None:
    defaulted, errors = crd.validate({"apiVersion": "inferplane.io/v1alpha1", "kind": "InferenceDeployment",
                                      "metadata": {"name": "x"}, "spec": {"model": {"name": "m"}, **spec}})
    assert errors == []
    # What the API server stores (its defaults applied) parses to what the user's spec parses to.
    assert InferenceDeploymentSpec.from_dict(defaulted["spec"]) == parse(**spec)


def test_a_disaggregated_worker_keeps_a_memory_tier_by_default() -> None:
    """The prefill worker keeps a prompt's blocks in it for the decode worker, which receives them there."""
    assert parse().disaggregation.enabled is False and resolve(parse()).engine["kv_offload_memory"] is None
    resolved = resolve(parse(disaggregation=ON))
    assert resolved.engine["kv_offload_memory"] == DISAGGREGATION_TIER_MEMORY
    args = resolved.engine_args()
    assert args[args.index("--kv-offload-memory") + 1] == DISAGGREGATION_TIER_MEMORY
    # One the spec asks for is kept.
    asked = resolve(parse(disaggregation=ON, engine={"kvOffloadMemory": "2GiB"}))
    assert asked.engine["kv_offload_memory"] == "2GiB"


def test_the_default_tier_is_a_byte_size_the_worker_parses() -> None:
    assert re.match(BYTES_PATTERN, DISAGGREGATION_TIER_MEMORY)
    assert parse_bytes(DISAGGREGATION_TIER_MEMORY) == 512 * 2**20


def test_the_worker_reads_the_default_tier_as_resolved() -> None:
    from tests.test_resolve import worker_options

    resolved = resolve(parse(disaggregation=ON))
    options = worker_options(resolved.engine_args())
    assert options.kv_offload_memory == DISAGGREGATION_TIER_MEMORY and options.runtime == "cpu-int8"


@pytest.mark.parametrize(("spec", "policy"), [
    ({"disaggregation": ON}, "kv-aware"),
    ({"resources": {"gpus": 1}, "disaggregation": ON}, "kv-aware"),
    ({"disaggregation": ON, "engine": {"kvEvents": False}}, "prefix-hash"),
    ({"disaggregation": ON, "routing": {"policy": "least-loaded"}}, "least-loaded"),
    ({}, "prefix-hash"),
])
def test_disaggregated_routing_defaults_to_kv_aware(spec: dict, policy: str) -> None:
    assert resolve(parse(**spec)).routing_policy == policy


def test_auto_on_a_gpu_picks_radix_when_disaggregated() -> None:
    plain = resolve(parse(resources={"gpus": 1}))
    assert plain.runtime == "paged"
    resolved = resolve(parse(resources={"gpus": 1}, disaggregation=ON))
    assert (resolved.runtime, resolved.device) == ("radix", "cuda")
    assert "disaggregation" in resolved.reason
    # Without a GPU auto stays cpu-int8, which has the radix KV manager too.
    assert resolve(parse(disaggregation=ON)).runtime == "cpu-int8"


def test_the_prefill_pool_runs_the_same_engine_on_its_own_resources() -> None:
    spec = parse(resources={"cpu": "4", "memory": "8Gi"}, replicas=2, maxReplicas=5, disaggregation={
        "enabled": True, "prefill": {"replicas": 3, "resources": {"cpu": "12", "memory": "16Gi"}}})
    prefill = prefill_spec(spec)
    assert (prefill.replicas, prefill.min_replicas, prefill.max_replicas) == (3, 1, 3)
    assert (prefill.resources.cpu, prefill.resources.memory) == ("12", "16Gi")
    decode, pooled = resolve(spec), resolve(prefill)
    assert (decode.cpu_threads, pooled.cpu_threads) == (4, 12)
    assert pooled.engine == decode.engine and pooled.runtime == decode.runtime and pooled.device == decode.device
    assert pooled.routing_policy == decode.routing_policy
    # Without its own resources, the prefill pool's are spec.resources.
    same = prefill_spec(parse(resources={"cpu": "6"}, disaggregation=ON))
    assert same.resources == parse(resources={"cpu": "6"}).resources and resolve(same).cpu_threads == 6
