"""The CRD: one source for deploy/ and the chart, examples valid against it, invalid resources refused."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from inferplane.api.deployment import InferenceDeploymentSpec
from tests.operator import crd
from tests.operator.conftest import EXAMPLES, ROOT, load_example


def test_committed_crds_are_the_generated_one() -> None:
    """deploy/crds and the chart's crds/ hold `inferplane crd`'s output: the models are the only source."""
    from inferplane.api.crd import FILE_NAME, crd_yaml

    generated = crd_yaml()
    for directory in (crd.CRD_DIR, ROOT / "helm" / "inferplane" / "crds"):
        assert (directory / FILE_NAME).read_text() == generated, \
            f"{directory / FILE_NAME} is stale: run `make crds` and commit the result"


def test_chart_carries_the_same_hand_written_crds_as_deploy() -> None:
    for source in sorted(crd.CRD_DIR.glob("*.yaml")):
        copy_in_chart = ROOT / "helm" / "inferplane" / "crds" / source.name
        assert copy_in_chart.read_bytes() == source.read_bytes(), \
            f"{copy_in_chart} differs from {source}: cp deploy/crds/*.yaml helm/inferplane/crds/"


def test_every_python_rule_with_cel_is_in_the_crd_on_its_section() -> None:
    from inferplane.api.deployment import RULES

    spec = crd.version_schema()["properties"]["spec"]
    for rule in RULES:
        node = spec if not rule.scope else spec["properties"][rule.scope]
        rules = [entry["rule"] for entry in node.get("x-kubernetes-validations", [])]
        assert (rule.cel in rules) is (rule.cel is not None), rule.message


def test_crd_declares_subresources_columns_and_short_name() -> None:
    definition = crd.load_crd()
    assert definition["metadata"]["name"] == "inferencedeployments.inferplane.io"
    assert definition["spec"]["names"]["shortNames"] == ["idep"]
    (version,) = definition["spec"]["versions"]
    assert version["name"] == "v1alpha1" and definition["spec"]["scope"] == "Namespaced"
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"
    assert "status" in version["subresources"]
    assert [c["name"] for c in version["additionalPrinterColumns"] if "priority" not in c] == \
        ["Model", "Runtime", "Ready", "Age"]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_examples_validate_against_the_crd_and_the_python_rules(path: Path) -> None:
    defaulted, errors = crd.validate(load_example(path))
    assert errors == []
    # What the API server stores (defaults applied) parses to the same spec as what the user wrote.
    assert InferenceDeploymentSpec.from_dict(defaulted["spec"]) == \
        InferenceDeploymentSpec.from_dict(load_example(path)["spec"])


def test_defaults_match_between_crd_and_python() -> None:
    defaulted, errors = crd.validate({"apiVersion": "inferplane.io/v1alpha1", "kind": "InferenceDeployment",
                                      "metadata": {"name": "x"}, "spec": {"model": {"name": "m"}}})
    assert errors == []
    spec = defaulted["spec"]
    parsed = InferenceDeploymentSpec.from_dict({"model": {"name": "m"}})
    assert (spec["runtime"], spec["replicas"], spec["minReplicas"]) == (parsed.runtime, parsed.replicas,
                                                                        parsed.min_replicas)
    assert spec["engine"]["blockSize"] == parsed.engine.block_size
    assert spec["slo"]["availability"] == parsed.slo.availability
    assert spec["serving"]["tier"] == parsed.serving.tier and spec["cacheIsolation"] == parsed.cache_isolation


BROKEN = [
    ({"runtime": "tensorrt"}, "spec.runtime"),
    ({"replicas": -1}, "spec.replicas"),
    ({"resources": {"gpus": 9}}, "spec.resources.gpus"),
    ({"engine": {"blockSize": 12}}, "spec.engine.blockSize"),
    ({"engine": {"kvCacheMemory": "lots"}}, "spec.engine.kvCacheMemory"),
    ({"serving": {"tier": "gold"}}, "spec.serving.tier"),
    ({"replicas": 1, "minReplicas": 3, "maxReplicas": 2}, "minReplicas must not exceed maxReplicas"),
    ({"replicas": 5, "maxReplicas": 2}, "replicas must lie within"),
    ({"runtime": "cpu-int8", "resources": {"gpus": 1}}, "runtime cpu-int8 runs on CPU"),
    ({"runtime": "cpu-int8", "engine": {"dtype": "bfloat16"}}, "computes in float32"),
    ({"runtime": "paged", "engine": {"quantizeHead": True}}, "is a cpu-int8 option"),
    ({"engine": {"maxNumSeqs": 64, "maxNumBatchedTokens": 32}}, "at least maxNumSeqs"),
    ({"model": {"name": "m", "uri": "/w", "format": "gguf"}}, "exactly one of model.name"),
    ({"model": {"uri": "/w"}}, "model.format is required"),
    ({"unknownField": 1}, "unknownField"),
    ({"autoscaling": {"panicWindowSeconds": 60, "stableWindowSeconds": 30}}, "panicWindowSeconds must be shorter"),
    ({"autoscaling": {"idleSeconds": -1}}, "spec.autoscaling.idleSeconds"),
    ({"engine": {"speculative": {"method": "draft"}}}, "spec.engine.speculative.method"),
    ({"engine": {"speculative": {"method": "ngram", "numTokens": 17}}}, "spec.engine.speculative.numTokens"),
]


@pytest.mark.parametrize(("change", "reason"), BROKEN, ids=[b[1][:30] for b in BROKEN])
def test_invalid_resources_are_refused_with_the_reason(change: dict, reason: str) -> None:
    body = copy.deepcopy(load_example(EXAMPLES[0]))
    body["spec"] = {"model": {"name": "smollm2-135m"}}
    body["spec"].update(change)
    _, errors = crd.validate(body)
    assert errors, f"{change} was accepted"
    assert any(reason in error for error in errors), errors


def test_kv_cache_pattern_is_shared_with_python() -> None:
    from inferplane.api.quantities import KV_CACHE_MEMORY_PATTERN

    engine = crd.version_schema()["properties"]["spec"]["properties"]["engine"]["properties"]
    assert engine["kvCacheMemory"]["pattern"] == KV_CACHE_MEMORY_PATTERN


def test_the_parser_knows_exactly_the_crd_fields() -> None:
    """Each section's fields in the Python parser are the CRD's properties: neither ignores the other's."""
    from inferplane.api.deployment import FIELDS

    spec = crd.version_schema()["properties"]["spec"]
    for section, fields in FIELDS.items():
        node = spec if section == "" else spec["properties"][section]
        assert sorted(fields) == sorted(node["properties"]), section or "spec"


@pytest.mark.parametrize(("spec", "field"), [
    ({"replica": 2}, "spec.replica"),
    ({"engine": {"maxNumSeq": 8}}, "spec.engine.maxNumSeq"),
    ({"workload": {"longGeneration": True}}, "spec.workload.longGeneration"),
])
def test_unknown_fields_are_refused_naming_them(spec: dict, field: str) -> None:
    from inferplane.api.deployment import SpecError

    with pytest.raises(SpecError, match=f"^{field}: unknown field"):
        InferenceDeploymentSpec.from_dict({"model": {"name": "m"}, **spec})


@pytest.mark.parametrize("ready", [0, 2])
def test_the_status_the_operator_writes_fits_the_generated_status_schema(ready: int) -> None:
    from inferplane.api.deployment_status import InferenceDeploymentStatus
    from inferplane.api.resolve import resolve
    from inferplane.operator.status import compute_status, invalid_status

    spec = InferenceDeploymentSpec.from_dict({"model": {"name": "m"}, "replicas": 2})
    child = {"metadata": {"generation": 1}, "status": {"readyReplicas": ready, "updatedReplicas": ready,
                                                       "replicas": 2, "observedGeneration": 1}}
    for status in (compute_status(name="x", namespace="ns", desired_replicas=2, resolved=resolve(spec),
                                  deployment=child, generation=3),
                   invalid_status("bad", generation=3)):
        parsed = InferenceDeploymentStatus.model_validate(status)
        assert parsed.model_dump(by_alias=True, exclude_unset=True).keys() == status.keys()
        _, errors = crd.validate({"apiVersion": "inferplane.io/v1alpha1", "kind": "InferenceDeployment",
                                  "metadata": {"name": "x"}, "spec": {"model": {"name": "m"}}, "status": status})
        assert errors == []
