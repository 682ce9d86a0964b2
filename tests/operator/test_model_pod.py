"""Issue 16: how a worker pod gets registry weights (operator/model_pod.py), checked on the manifests."""

from __future__ import annotations

from inferplane.api.deployment import InferenceDeploymentSpec
from inferplane.api.model_resolution import ResolvedModel
from inferplane.operator import model_pod
from inferplane.operator.manifests import children

DIGEST = "ab" * 32
BODY = {"metadata": {"name": "chat", "namespace": "team-a", "uid": "u1"}}


def spec(**model) -> InferenceDeploymentSpec:
    return InferenceDeploymentSpec.from_dict({"model": model, "runtime": "cpu-int8"})


def pod(model: ResolvedModel | None, cache: model_pod.ModelCache | None = None, **ref) -> dict:
    deployment = children(BODY, spec(**(ref or {"name": "llm", "version": "1"})), model=model, cache=cache)[0]
    return deployment["spec"]["template"]


def test_s3_weights_are_fetched_into_the_cache_before_the_worker_starts() -> None:
    model = ResolvedModel("llm", "1", "s3://bucket/llm/model.gguf", DIGEST, "gguf", 100)
    template = pod(model, model_pod.ModelCache(storage_secret="s3-creds", s3_endpoint_url="http://minio:9000"))
    (init,) = template["spec"]["initContainers"]
    assert init["args"][:6] == ["--uri", "s3://bucket/llm/model.gguf", "--sha256", DIGEST, "--cache-dir",
                                "/model-cache"]
    assert init["args"][-2:] == ["--s3-endpoint-url", "http://minio:9000"]
    assert init["envFrom"] == [{"secretRef": {"name": "s3-creds"}}]
    worker = template["spec"]["containers"][0]
    assert worker["args"][worker["args"].index("--model") + 1] == f"/model-cache/{DIGEST}/model.gguf"
    assert {"name": "model-cache", "mountPath": "/model-cache", "readOnly": True} in worker["volumeMounts"]
    assert template["metadata"]["annotations"][model_pod.ANNOTATION_DIGEST] == DIGEST


def test_a_folder_loads_from_the_entrys_model_folder_and_a_host_path_cache_is_shared() -> None:
    model = ResolvedModel("llm", "1", "https://weights.example/llm/", DIGEST, "hf")
    template = pod(model, model_pod.ModelCache(host_path="/var/cache/inferplane"))
    worker = template["spec"]["containers"][0]
    assert worker["args"][worker["args"].index("--model") + 1] == f"/model-cache/{DIGEST}/model"
    assert {"name": "model-cache", "hostPath": {"path": "/var/cache/inferplane", "type": "DirectoryOrCreate"}} \
        in template["spec"]["volumes"]


def test_a_pvc_entry_is_mounted_and_verified_in_place() -> None:
    model = ResolvedModel("llm", "1", "pvc://weights/llama/model.gguf", DIGEST, "gguf")
    template = pod(model)
    (init,) = template["spec"]["initContainers"]
    assert init["args"][1] == "/models/llama/model.gguf"
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in init["volumeMounts"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}} \
        in template["spec"]["volumes"]
    worker = template["spec"]["containers"][0]
    assert worker["args"][worker["args"].index("--model") + 1] == "/models/llama/model.gguf"


def test_without_a_registry_answer_nothing_is_fetched() -> None:
    template = pod(None, name="smollm2-135m")
    assert "initContainers" not in template["spec"]
    worker = template["spec"]["containers"][0]
    assert worker["args"][worker["args"].index("--model") + 1] == "smollm2-135m"
    assert model_pod.ANNOTATION_DIGEST not in template["metadata"]["annotations"]


def test_two_versions_differ_in_the_pod_template_so_the_deployment_rolls() -> None:
    first = pod(ResolvedModel("llm", "1", "s3://bucket/llm/1.gguf", DIGEST, "gguf"))
    second = pod(ResolvedModel("llm", "2", "s3://bucket/llm/2.gguf", "cd" * 32, "gguf"))
    assert first != second
    assert second["metadata"]["annotations"][model_pod.ANNOTATION_VERSION] == "2"
