"""Issue 59: the banner's examples fit the model: a chat call where its tokenizer has a chat template,
a completion where it has none (a base model answers a chat call with a 400), never an embedding
model. The commands as printed are valid shell and their JSON bodies parse (test_up_newcomer runs
the chat ones against a live `inferplane up`)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from types import SimpleNamespace

from inferplane.control_plane.gateway.catalog import Catalog, ServedModel
from inferplane.local.cli.up import banner


def platform(tmp_path: Path, *served: ServedModel) -> SimpleNamespace:
    catalog = Catalog()
    for model in served:
        catalog.put(model)
    deployments = {m.name: SimpleNamespace(name=m.name, served_model_name=m.name, replicas=[]) for m in served}
    return SimpleNamespace(supervisor=SimpleNamespace(deployments=deployments), tenant_key="ip_abc_def", home=tmp_path,
                           gateway=SimpleNamespace(catalog=catalog), gateway_metrics_url=None)


def model(name: str, *, template: str | None, kind: str = "generate") -> ServedModel:
    return ServedModel(name=name, tokenizer=SimpleNamespace(chat_template=template), max_model_len=256, kind=kind)


def examples(text: str) -> str:
    start = text.index("try it:\n") + len("try it:\n")
    return text[start:text.index("\n\n", start)]


def check_shell(script: str) -> list[dict]:
    assert subprocess.run(["bash", "-n", "-c", script], capture_output=True).returncode == 0, script
    return [json.loads(body) for body in re.findall(r"-d '([^']*)'", script)]


def test_a_model_with_a_chat_template_is_asked_as_a_chat(tmp_path: Path) -> None:
    script = examples(banner(platform(tmp_path, model("smol", template="{{ messages }}")), "127.0.0.1", 8080, None))
    (body,) = check_shell(script)
    assert "/v1/chat/completions" in script and body["messages"][0]["content"] == "Hello!"
    assert "chat.completions.create(model='smol'" in script


def test_the_banner_names_the_models_folder(tmp_path: Path) -> None:
    text = banner(platform(tmp_path, model("smol", template="{{ messages }}")), "127.0.0.1", 8080, None)
    assert f"copy weights into {tmp_path / 'models'}" in text


def test_a_base_model_is_asked_for_a_completion_and_an_embedding_model_is_skipped(tmp_path: Path) -> None:
    served = platform(tmp_path, model("minilm", template=None, kind="embedding"), model("gemma-base", template=None))
    script = examples(banner(served, "127.0.0.1", 8080, None))
    (body,) = check_shell(script)
    assert "/v1/completions" in script and "chat" not in script
    assert body == {"model": "gemma-base", "prompt": "The capital of France is", "max_tokens": 32}
    assert "completions.create(model='gemma-base', prompt=" in script


def test_up_makes_the_models_folder(tmp_path: Path) -> None:
    from inferplane.local.platform import LocalPlatform

    running = LocalPlatform(tmp_path / "home", [], "127.0.0.1", 0, None)
    try:
        assert (tmp_path / "home" / "models").is_dir()
        assert running.gateway.context.model_roots == (str(tmp_path / "home" / "models"),)
    finally:
        running.gateway.engine.dispose()


def test_with_only_an_embedding_model_the_example_is_an_embedding(tmp_path: Path) -> None:
    script = examples(banner(platform(tmp_path, model("minilm", template=None, kind="embedding")), "127.0.0.1",
                             8080, None))
    (body,) = check_shell(script)
    assert "/v1/embeddings" in script and body == {"model": "minilm", "input": "The capital of France is Paris."}
    assert "embeddings.create(model='minilm'" in script
