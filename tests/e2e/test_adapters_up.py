"""LoRA adapters with `inferplane up`: registered by URI (one in a real S3-compatible server, one a
tenant's folder), one preloaded by the deployment, all served through the openai client under their
own ids beside the base, and a new version rolled in while `up` runs without a failed request."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml
from openai import OpenAI

from inferplane.api.model_config import read_model_config
from inferplane.api.model_resolution import builtin_model_path
from inferplane.bench.lora import write_random_adapter
from inferplane.local.platform import BOOTSTRAP_TENANT
from tests.e2e.test_registry_deployments import BUCKET, inferplane, s3, stop, upload_folder  # noqa: F401 (fixture)
from tests.e2e.test_up_newcomer import Up

pytestmark = pytest.mark.slow
PROMPT = "The capital of France is"


def offline_answers(folders: dict[str, Path]) -> dict[str | None, str]:
    """What each adapter (and the base) answers, from the offline engine on the same weights."""
    from inferplane import LLM, SamplingParams
    from inferplane.worker.lora import LoraRequest

    llm = LLM("smollm2-135m", device="cpu", dtype="float32", max_loras=len(folders), max_lora_rank=8)
    params = SamplingParams(max_tokens=8, temperature=0)
    answers: dict[str | None, str] = {None: llm.generate(PROMPT, params)[0].text}
    for name, folder in folders.items():
        answers[name] = llm.generate(PROMPT, params, lora_request=LoraRequest(name, str(folder)))[0].text
    assert len(set(answers.values())) == len(answers), answers
    return answers


def test_adapters_by_uri_preloaded_private_and_rolled_with_inferplane_up(s3, tmp_path: Path) -> None:  # noqa: F811
    client, env = s3
    home = tmp_path / "home"
    config = read_model_config(builtin_model_path("smollm2-135m"))
    folders = {name: write_random_adapter(tmp_path / name, config, 8, ["q_proj", "v_proj", "down_proj"], seed=seed,
                                          b_scale=0.5)
               for name, seed in (("support", 1), ("support-v2", 2), ("acme-bot", 3))}
    answers = offline_answers(folders)
    upload_folder(client, folders["support"], "adapters/support")
    cache = {"INFERPLANE_MODEL_CACHE": str(tmp_path / "registry-cache")}
    steps = [("models", "register", "smol", "--uri", str(builtin_model_path("smollm2-135m")), "--version", "1"),
             ("models", "register-adapter", f"s3://{BUCKET}/adapters/support/", "--base", "smol", "--name", "support")]
    for step in steps:
        done = inferplane(*step, "--home", str(home), env={**env, **cache})
        assert done.returncode == 0, done.stdout + done.stderr
    spec = {"apiVersion": "inferplane.io/v1alpha1", "kind": "InferenceDeployment", "metadata": {"name": "smol"},
            "spec": {"model": {"name": "smol"}, "runtime": "paged", "adapters": [{"name": "support"}],
                     "resources": {"cpu": "1", "memory": "2Gi"},
                     "engine": {"kvCacheMemory": "64Mi", "maxModelLen": 256, "maxLoras": 2, "maxLoraRank": 8,
                                "dtype": "float32"}}}
    manifest = tmp_path / "smol.yaml"
    manifest.write_text(yaml.safe_dump(spec))
    up = Up(manifest, home)
    try:
        key = up.key
        # the tenant's own adapter, registered while up runs (served within the refresh interval)
        done = inferplane("models", "register-adapter", str(folders["acme-bot"]), "--base", "smol", "--tenant",
                          BOOTSTRAP_TENANT, "--home", str(home))
        assert done.returncode == 0, done.stdout + done.stderr
        openai = OpenAI(base_url=f"http://127.0.0.1:{up.port}/v1", api_key=key, timeout=300, max_retries=0)

        def ask(model: str) -> str:
            return openai.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text

        deadline = time.monotonic() + 60
        while "acme-bot" not in {m.id for m in openai.models.list().data} and time.monotonic() < deadline:
            time.sleep(0.5)
        cards = {m.id: m for m in openai.models.list().data}
        assert set(cards) == {"smol", "support", "acme-bot"}
        assert cards["support"].model_extra["parent"] == "smol" == cards["acme-bot"].model_extra["parent"]
        assert (ask("smol"), ask("support"), ask("acme-bot")) == (answers[None], answers["support"],
                                                                  answers["acme-bot"])
        # version 2 of "support" from a folder: requests keep succeeding, then answer with it
        done = inferplane("models", "register-adapter", str(folders["support-v2"]), "--base", "smol", "--name",
                          "support", "--home", str(home))
        assert done.returncode == 0, done.stdout + done.stderr
        seen = []
        deadline = time.monotonic() + 60
        while (not seen or seen[-1] != answers["support-v2"]) and time.monotonic() < deadline:
            seen.append(ask("support"))  # a failed request raises here
        assert seen[-1] == answers["support-v2"]
        assert set(seen) <= {answers["support"], answers["support-v2"]}
    finally:
        stop(up)
