"""The CRD's schema and every CEL rule, evaluated by a real kube-apiserver.

Each rule (`x-kubernetes-validations`) gets one resource the server accepts and one it refuses;
the refusal must carry the rule's message at the rule's field path. Requests are server-side dry
runs: the server defaults, validates and runs CEL exactly as for a real create, and stores nothing.
The in-memory test API's verdict (`tests.operator.crd`) is compared with the server's, so the
fast kmock tests cannot drift from what a cluster does.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import Any

import pytest

from tests.k8s.cluster import Cluster
from tests.k8s.conftest import idep, idep_path, namespace
from tests.operator import crd

NAMESPACE = "cel"

# rule message -> (a spec the rule accepts, a spec it refuses); both are otherwise valid.
CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "minReplicas must not exceed maxReplicas": (
        {"minReplicas": 2, "maxReplicas": 2, "replicas": 2}, {"minReplicas": 3, "maxReplicas": 2, "replicas": 3}),
    "replicas must lie within minReplicas..maxReplicas": (
        {"replicas": 4, "maxReplicas": 4}, {"replicas": 5, "maxReplicas": 4}),
    "runtime cpu-int8 runs on CPU; set resources.gpus to 0 or choose paged, radix or auto": (
        {"runtime": "cpu-int8", "resources": {"gpus": 0}}, {"runtime": "cpu-int8", "resources": {"gpus": 1}}),
    "runtime cpu-int8 computes in float32": (
        {"runtime": "cpu-int8", "engine": {"dtype": "float32"}},
        {"runtime": "cpu-int8", "engine": {"dtype": "bfloat16"}}),
    "engine.quantizeHead is a cpu-int8 option (runtime cpu-int8 or auto)": (
        {"runtime": "auto", "engine": {"quantizeHead": False}},
        {"runtime": "paged", "engine": {"quantizeHead": False}}),
    "engine.kvOffloadMemory needs the radix KV manager: runtime radix, cpu-int8 or auto (an embedding model "
    "keeps no KV)": (
        {"runtime": "radix", "engine": {"kvOffloadMemory": "1GiB"}},
        {"runtime": "paged", "engine": {"kvOffloadMemory": "1GiB"}}),
    "engine.kvOffloadDisk needs the radix KV manager: runtime radix, cpu-int8 or auto (an embedding model "
    "keeps no KV)": (
        {"runtime": "cpu-int8", "engine": {"kvOffloadDisk": "4GiB"}},
        {"kind": "embedding", "engine": {"kvOffloadDisk": "4GiB"}}),
    "engine.decodeSteps is a cpu-int8 option (runtime cpu-int8 or auto)": (
        {"runtime": "cpu-int8", "engine": {"decodeSteps": 4}}, {"runtime": "radix", "engine": {"decodeSteps": 4}}),
    "engine.decodeSteps is a generation setting; an embedding model does not decode": (
        {"engine": {"decodeSteps": 1}}, {"kind": "embedding", "engine": {"decodeSteps": 1}}),
    "engine.requantizeQ4 is a cpu-int8 option (runtime cpu-int8 or auto)": (
        {"runtime": "cpu-int8", "engine": {"requantizeQ4": True}},
        {"runtime": "radix", "engine": {"requantizeQ4": True}}),
    "float16 needs a GPU (resources.gpus > 0); use float32 or bfloat16": (
        {"resources": {"gpus": 1}, "engine": {"dtype": "float16"}}, {"engine": {"dtype": "float16"}}),
    "set exactly one of model.name (a registry entry) or model.uri (a path)": (
        {"model": {"name": "smollm2-135m"}},
        {"model": {"name": "smollm2-135m", "uri": "/models/a.gguf", "format": "gguf"}}),
    "model.format is required with model.uri (safetensors or gguf)": (
        {"model": {"uri": "/models/a.gguf", "format": "gguf"}}, {"model": {"uri": "/models/a.gguf"}}),
    "maxNumBatchedTokens must be at least maxNumSeqs: every running sequence needs one token per step": (
        {"engine": {"maxNumSeqs": 16, "maxNumBatchedTokens": 16}},
        {"engine": {"maxNumSeqs": 32, "maxNumBatchedTokens": 16}}),
    "kind embedding runs in runtime embedding (or auto, which picks it)": (
        {"kind": "embedding", "runtime": "auto"}, {"kind": "embedding", "runtime": "paged"}),
    "runtime embedding serves embedding models; set kind: embedding": (
        {"kind": "embedding", "runtime": "embedding"}, {"runtime": "embedding"}),
    "engine.kvCacheMemory is a generation setting; an embedding model keeps no KV cache": (
        {"engine": {"kvCacheMemory": "1GiB"}}, {"kind": "embedding", "engine": {"kvCacheMemory": "1GiB"}}),
    "engine.kvCacheDtype is a generation setting; an embedding model keeps no KV cache": (
        {"kind": "embedding", "engine": {"kvCacheDtype": "auto"}},
        {"kind": "embedding", "engine": {"kvCacheDtype": "float16"}}),
    "engine.quantizeHead is a generation setting; an embedding model has no output head": (
        {"engine": {"quantizeHead": False}}, {"kind": "embedding", "engine": {"quantizeHead": False}}),
    "engine.requantizeQ4 is a generation setting (cpu-int8's GGUF weights)": (
        {"kind": "embedding", "engine": {"requantizeQ4": False}},
        {"kind": "embedding", "engine": {"requantizeQ4": True}}),
    "workload hints choose among generative runtimes; an embedding deployment takes none": (
        {"kind": "embedding", "workload": {"agent": False}}, {"kind": "embedding", "workload": {"agent": True}}),
    "engine.speculative is a generation setting; an embedding model does not decode": (
        {"engine": {"speculative": {"method": "suffix"}}},
        {"kind": "embedding", "engine": {"speculative": {"method": "ngram"}}}),
    "engine.maxLoras is a generation setting; an embedding model serves no LoRA adapters": (
        {"kind": "embedding", "engine": {"maxLoras": 0}}, {"kind": "embedding", "engine": {"maxLoras": 2}}),
    "adapters: preloading them needs engine.maxLoras at least the number listed": (
        {"adapters": [{"name": "bot"}], "engine": {"maxLoras": 1}},
        {"adapters": [{"name": "bot"}, {"name": "helper"}], "engine": {"maxLoras": 1}}),
    "engine.kvEvents needs the radix KV manager: runtime radix, cpu-int8 or auto (an embedding model keeps no KV)": (
        {"runtime": "radix", "engine": {"kvEvents": True}},
        {"runtime": "paged", "resources": {"gpus": 1}, "engine": {"kvEvents": True}}),
    "routing.policy kv-aware reads the workers' KV events: it needs the radix KV manager (runtime radix, cpu-int8 "
    "or auto) and engine.kvEvents not false": (
        {"routing": {"policy": "kv-aware"}},
        {"routing": {"policy": "kv-aware"}, "engine": {"kvEvents": False}}),
    "engine.enforceEager turns off CUDA graphs: it needs a GPU (resources.gpus > 0)": (
        {"runtime": "paged", "resources": {"gpus": 1}, "engine": {"enforceEager": True}},
        {"runtime": "paged", "engine": {"enforceEager": True}}),
    "autoscaling.panicWindowSeconds must be shorter than autoscaling.stableWindowSeconds": (
        {"autoscaling": {"panicWindowSeconds": 10, "stableWindowSeconds": 30}},
        {"autoscaling": {"panicWindowSeconds": 61}}),  # against the default stable window, 60
    "disaggregation.enabled needs the radix KV manager: runtime radix, cpu-int8 or auto, and kind generate "
    "(prompts' KV moves between the pools through its memory tier)": (
        {"runtime": "radix", "disaggregation": {"enabled": True}},
        {"runtime": "paged", "disaggregation": {"enabled": True}}),
    "disaggregation.prefill.minReplicas must not exceed disaggregation.prefill.maxReplicas": (
        {"disaggregation": {"prefill": {"minReplicas": 2, "replicas": 2, "maxReplicas": 2}}},
        {"disaggregation": {"prefill": {"minReplicas": 3, "replicas": 3, "maxReplicas": 2}}}),
    "disaggregation.prefill.replicas must lie within disaggregation.prefill.minReplicas..maxReplicas": (
        {"disaggregation": {"prefill": {"replicas": 4, "maxReplicas": 4}}},
        {"disaggregation": {"prefill": {"replicas": 5, "maxReplicas": 4}}}),
    "the prefill pool runs where the decode pool does: disaggregation.prefill.resources.gpus must be above 0 "
    "exactly when resources.gpus is (a decode worker uses the KV a prefill worker computed, in its layout)": (
        {"resources": {"gpus": 1}, "disaggregation": {"prefill": {"resources": {"gpus": 2}}}},
        {"resources": {"gpus": 1}, "disaggregation": {"prefill": {"resources": {"cpu": "8"}}}}),
    "disaggregation.prefill.minReplicas must be at least 1 with autoscaling enabled (a prefill pool at zero has no "
    "workers' load to scale back up by); to stop using the pool, set disaggregation.enabled false": (
        {"runtime": "radix", "autoscaling": {"enabled": True},
         "disaggregation": {"enabled": True, "prefill": {"minReplicas": 1}}},
        {"runtime": "radix", "autoscaling": {"enabled": True},
         "disaggregation": {"enabled": True, "prefill": {"minReplicas": 0, "replicas": 0}}}),
}


def crd_rules(schema: Mapping[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """(field path the server reports, rule) for every x-kubernetes-validations rule in the schema."""
    for rule in schema.get("x-kubernetes-validations") or []:
        yield (path + rule.get("fieldPath", "")).lstrip("."), rule
    for name, sub in (schema.get("properties") or {}).items():
        yield from crd_rules(sub, f"{path}.{name}")
    if isinstance(schema.get("items"), Mapping):
        yield from crd_rules(schema["items"], f"{path}[*]")


RULES = {rule["message"]: field for field, rule in crd_rules(crd.version_schema())}


@pytest.fixture(scope="module")
def ns(crds: Cluster) -> Iterator[str]:
    with namespace(crds, NAMESPACE) as name:
        yield name


def dry_run_create(cluster: Cluster, spec: dict[str, Any], name: str) -> tuple[int, Any]:
    body = idep(name, NAMESPACE)
    body["spec"].update(copy.deepcopy(spec))
    return cluster.request("POST", idep_path(NAMESPACE), body, params={"dryRun": "All", "fieldValidation": "Strict"})


def test_every_rule_in_the_crd_has_a_case() -> None:
    assert len(RULES) >= 10
    assert set(RULES) == set(CASES), "add a case for each new rule (and drop the cases of removed ones)"


@pytest.mark.parametrize("message", sorted(CASES), ids=lambda m: m.split(" (")[0][:40])
def test_rule_accepts_one_and_refuses_the_other(crds: Cluster, ns: str, message: str) -> None:
    accepted, refused = CASES[message]
    status, body = dry_run_create(crds, accepted, "accepted")
    assert status == 201, body.get("message")
    # What the server stored (defaults applied) is what the in-memory API's defaulting produces.
    local, errors = crd.validate({**idep("accepted", NAMESPACE), "spec": {**idep("a", NAMESPACE)["spec"], **accepted}})
    assert errors == []
    assert body["spec"] == local["spec"]

    status, body = dry_run_create(crds, refused, "refused")
    assert status == 422, body.get("message")
    assert body["reason"] == "Invalid"
    field = RULES[message]
    assert f"{field}: Invalid value" in body["message"], body["message"]
    assert message in body["message"]
    assert any(message in (cause.get("message") or "") for cause in body["details"]["causes"])
    # The in-memory API refuses it for the same rule.
    _, errors = crd.validate({**idep("refused", NAMESPACE), "spec": {**idep("r", NAMESPACE)["spec"], **refused}})
    assert any(message in error for error in errors), errors


def test_schema_refuses_unknown_fields_and_bad_enums(crds: Cluster, ns: str) -> None:
    status, body = dry_run_create(crds, {"runtime": "tensorrt"}, "enum")
    assert status == 422 and "spec.runtime" in body["message"] and "tensorrt" in body["message"], body
    status, body = dry_run_create(crds, {"engine": {"blockSize": 17}}, "enum2")
    assert status == 422 and "spec.engine.blockSize" in body["message"], body
    # Strict field validation (kubectl's default) refuses a misspelt field instead of pruning it.
    status, body = dry_run_create(crds, {"replica": 2}, "typo")
    assert status == 400 and 'unknown field "spec.replica"' in body["message"], body
