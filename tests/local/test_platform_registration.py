"""Issue 53, item 9: restarting `inferplane up` is no new model version.

`inferplane up` registers the weights its manifests name on every start; each restart recorded
one more version of the same file. Now the latest version is reused when it records the same URI
and the weights read the same (digest, status); changed weights are a new version.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from inferplane.api.deployment import InferenceDeploymentSpec
from inferplane.control_plane import auth, registry
from inferplane.local.platform import LocalPlatform, Manifest


def _gguf(path: Path, value: float) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_context_length(2048)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.full((4, 8), value, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    registry.clear_inspect_cache()
    return path


def _start(home: Path, uri: str) -> tuple[LocalPlatform, str]:
    """What one `inferplane up` start does for a manifest naming `uri`: registering its weights."""
    spec = InferenceDeploymentSpec.from_dict({"model": {"uri": uri, "format": "gguf"}, "replicas": 1})
    platform = LocalPlatform(home, [Manifest("chat", spec)], "127.0.0.1", 0, None)
    try:
        return platform, platform._model_path(Manifest("chat", spec))
    finally:
        platform.gateway.engine.dispose()


def _versions(platform: LocalPlatform) -> list[tuple[str, str, str | None]]:
    with platform.gateway.sessions() as session:
        return [(m.version, m.status, m.sha256) for m in registry.list_versions(session, auth.ALL_TENANTS, "chat")]


def test_restarts_reuse_the_version_until_the_weights_change(tmp_path: Path) -> None:
    weights = _gguf(tmp_path / "w.gguf", 1.0)
    uri = str(weights)
    for _ in range(3):
        platform, path = _start(tmp_path / "home", uri)
        assert path == str(weights)
    first = _versions(platform)
    assert [(v, s) for v, s, _ in first] == [("1", "verified")], first
    _gguf(weights, 2.0)  # new weights at the same path: a new version, reused on the next start
    for _ in range(2):
        platform, _ = _start(tmp_path / "home", uri)
    second = _versions(platform)
    assert [(v, s) for v, s, _ in second] == [("1", "verified"), ("2", "verified")], second
    assert second[0][2] != second[1][2]
    _gguf(weights, 1.0)  # back to the first weights: the latest version differs, so one more
    platform, _ = _start(tmp_path / "home", uri)
    assert [v for v, _, _ in _versions(platform)] == ["1", "2", "3"]


def test_a_failed_registration_is_not_repeated_either(tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\xff" * 64)
    for _ in range(3):
        platform, _ = _start(tmp_path / "home", str(broken))
    assert [(v, s) for v, s, _ in _versions(platform)] == [("1", "failed")]


def test_an_explicit_registration_still_adds_a_version(tmp_path: Path) -> None:
    """Only `inferplane up` asks for reuse: `models register` of the same file is a new version."""
    weights = _gguf(tmp_path / "w.gguf", 1.0)
    platform, _ = _start(tmp_path / "home", str(weights))
    with platform.gateway.sessions.begin() as session:
        again = registry.register_model(session, str(weights), actor="test", name="chat")
    assert again.version == "2"
    platform.gateway.engine.dispose()
