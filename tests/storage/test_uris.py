"""Model URIs: what parses into which parts, and that every rejection names the URI."""

from __future__ import annotations

import pytest

from inferplane.storage.cache import cached_path
from inferplane.storage.uris import parse_model_uri

SHA = "ab" * 32


@pytest.mark.parametrize(("text", "fields", "basename"), [
    ("/models/tiny.gguf", {"scheme": "file", "path": "/models/tiny.gguf"}, "tiny.gguf"),
    ("file:///models/hf%20tiny", {"scheme": "file", "path": "/models/hf tiny"}, "hf tiny"),
    ("file://localhost/models/x.gguf", {"scheme": "file", "path": "/models/x.gguf"}, "x.gguf"),
    ("pvc://weights/llama/q4.gguf", {"scheme": "pvc", "claim": "weights", "path": "llama/q4.gguf"}, "q4.gguf"),
    ("pvc://weights", {"scheme": "pvc", "claim": "weights", "path": ""}, "weights"),
    ("https://example.com/org/m/resolve/main/m.Q4_K_M.gguf?download=1",
     {"scheme": "https", "url": "https://example.com/org/m/resolve/main/m.Q4_K_M.gguf?download=1"}, "m.Q4_K_M.gguf"),
    ("http://127.0.0.1:8080/a%20b.gguf", {"scheme": "http"}, "a b.gguf"),
    ("s3://models/gguf/tiny.gguf", {"scheme": "s3", "bucket": "models", "key": "gguf/tiny.gguf"}, "tiny.gguf"),
    ("s3://models/hf/tiny/", {"scheme": "s3", "bucket": "models", "key": "hf/tiny/"}, "tiny"),
])
def test_valid_uris(text: str, fields: dict, basename: str) -> None:
    uri = parse_model_uri(text)
    for name, value in fields.items():
        assert getattr(uri, name) == value
    assert uri.basename == basename
    assert str(uri) == text
    assert uri.is_prefix == text.endswith("/")


@pytest.mark.parametrize(("text", "reason"), [
    ("", "empty"),
    ("models/tiny.gguf", "absolute path"),
    ("ftp://host/x.gguf", "unsupported scheme"),
    ("gs://bucket/x", "unsupported scheme"),
    ("file://otherhost/x.gguf", "not on host"),
    ("https:///x.gguf", "no host"),
    ("https://example.com/", "names no file"),
    ("http://example.com:port/x", "port"),
    ("s3://models", "no key"),
    ("s3://models/", "no key"),
    ("s3://Bad_Bucket/x", "bucket name"),
    ("s3://models/a/../b", "'..'"),
    ("pvc://Not_A_Claim/x", "PersistentVolumeClaim name"),
    ("pvc://claim/../etc", "'..'"),
    (" /models/x.gguf", "whitespace"),
])
def test_invalid_uris_name_the_uri(text: str, reason: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_model_uri(text)
    message = str(caught.value)
    assert "\n" not in message
    assert repr(text) in message and reason in message


def test_cached_path_layout_is_pure() -> None:
    root = "/var/cache/inferplane/models"
    assert str(cached_path(root, SHA, "s3://models/gguf/tiny.gguf", folder=False)) == f"{root}/{SHA}/tiny.gguf"
    assert str(cached_path(root, SHA, parse_model_uri("s3://models/hf/tiny/"), folder=True)) == f"{root}/{SHA}/model"
    assert str(cached_path(root, SHA.upper(), "https://h/x/w.gguf", folder=False)) == f"{root}/{SHA}/w.gguf"
    with pytest.raises(ValueError, match="invalid sha256"):
        cached_path(root, "../../etc", "https://h/x/w.gguf", folder=False)
