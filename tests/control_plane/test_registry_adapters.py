"""LoRA adapters in the registry: checked against their base at registration (400 naming what does
not fit, nothing recorded), bound to the base version's digest, private to their tenant."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy.orm import Session, sessionmaker

from inferplane.api.model_resolution import ModelResolutionError
from inferplane.control_plane import audit
from inferplane.control_plane.auth import ALL_TENANTS
from inferplane.control_plane.errors import Conflict, InvalidInput, NotFound
from inferplane.control_plane.registry import (
    get_model,
    list_adapters,
    list_models,
    register_adapter,
    register_model,
    resolve_for_deployment,
    verify_model,
)
from inferplane.storage.digest import digest
from tests.worker.conftest import save_tiny

Sessions = sessionmaker[Session]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    """A tiny base, a base of other widths, and adapters for each (made and saved by peft)."""
    pytest.importorskip("peft")
    from tests.worker.test_lora import make_adapter

    root = tmp_path_factory.mktemp("adapters")
    base = save_tiny(root / "tiny", "llama", seed=1)
    from transformers import AutoModelForCausalLM, LlamaConfig

    AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=320, hidden_size=96, intermediate_size=128,
                                                 num_hidden_layers=3, num_attention_heads=4,
                                                 num_key_value_heads=2)).save_pretrained(root / "wide")
    return {
        "base": base,
        "support": make_adapter(base, str(root / "support"), 8, ["q_proj", "v_proj", "down_proj"], seed=1),
        "sales": make_adapter(base, str(root / "sales"), 16, ["q_proj", "k_proj", "v_proj", "o_proj"], seed=2),
        "misfit": make_adapter(str(root / "wide"), str(root / "misfit"), 8, ["q_proj"], seed=3),
    }


@pytest.fixture
def base(sessions: Sessions, folders) -> str:
    with sessions.begin() as s:
        info = register_model(s, folders["base"], actor="test", name="tiny")
    assert info.status == "verified"
    return info.sha256


def test_an_adapter_is_checked_and_bound_to_its_base(sessions: Sessions, folders, base: str) -> None:
    with sessions.begin() as s:
        info = register_adapter(s, folders["support"], actor="test", base="tiny")
    assert (info.name, info.version, info.kind, info.format, info.status) == ("support", "1", "adapter", "peft",
                                                                             "verified")
    assert (info.base_model, info.base_sha256, info.lora_rank) == ("tiny:1", base, 8)
    assert info.sha256 == digest(folders["support"]) and info.visibility == "public"
    assert info.architecture == "llama"
    with sessions() as s:
        assert "adapter.register" in [e.action for e in audit.list_entries(s)]
        assert [a.name for a in list_adapters(s, base_sha256=base)] == ["support"]
        assert list_adapters(s, base_sha256="0" * 64) == []
        with pytest.raises(ModelResolutionError) as err:  # a deployment runs models, not adapters
            resolve_for_deployment(s, "support", None)
        assert err.value.reason == "ModelIsAdapter" and "adapter of tiny:1" in err.value.message


def test_misfits_are_refused_naming_what_and_nothing_is_recorded(sessions: Sessions, folders, base: str,
                                                                tmp_path: Path) -> None:
    with sessions.begin() as s:
        with pytest.raises(InvalidInput) as err:
            register_adapter(s, folders["misfit"], actor="test", base="tiny")
        assert err.value.status == 400 and err.value.param == "source"
        assert "layer 0 q_proj: lora_A (8, 96)" in str(err.value) and "64 -> 64" in str(err.value)
        plain = tmp_path / "not-an-adapter"
        plain.mkdir()
        (plain / "adapter_config.json").write_text('{"peft_type": "LORA", "use_dora": true}')
        with pytest.raises(InvalidInput, match="use_dora is not served"):
            register_adapter(s, plain, actor="test", base="tiny")
        with pytest.raises(InvalidInput, match="sha256 mismatch"):
            register_adapter(s, folders["support"], actor="test", base="tiny", expected_sha256="0" * 64)
        with pytest.raises(NotFound):
            register_adapter(s, folders["support"], actor="test", base="no-such-model")
    with sessions() as s:
        assert list_adapters(s) == [] and [m.name for m in list_models(s, ALL_TENANTS)] == ["tiny"]


def test_names_and_versions(sessions: Sessions, folders, base: str) -> None:
    with sessions.begin() as s:
        register_adapter(s, folders["support"], actor="test", base="tiny", name="bot")
        second = register_adapter(s, folders["sales"], actor="test", base="tiny", name="bot")
        assert (second.version, second.lora_rank) == ("2", 16)
        with pytest.raises(Conflict, match="is a model's name"):
            register_adapter(s, folders["support"], actor="test", base="tiny", name="tiny")


def test_a_tenants_adapter_is_invisible_to_other_tenants(sessions: Sessions, folders, base: str,
                                                       two_tenants: tuple[str, str]) -> None:
    a, b = two_tenants
    with sessions.begin() as s:
        mine = register_adapter(s, folders["support"], actor="key:a", base="tiny", name="a-bot", owner_tenant_id=a)
    assert mine.visibility == "private" and mine.owner_tenant_id == a
    with sessions() as s:
        assert [x.name for x in list_adapters(s, a)] == ["a-bot"]
        assert list_adapters(s, b) == [] and "a-bot" not in [m.name for m in list_models(s, b)]
        with pytest.raises(NotFound) as hidden:
            get_model(s, b, "a-bot")
        with pytest.raises(NotFound) as missing:
            get_model(s, b, "no-such-bot")
        assert str(hidden.value).replace("a-bot", "X") == str(missing.value).replace("no-such-bot", "X")
    with sessions.begin() as s:  # nor may B bind an adapter to A's private model
        register_model(s, folders["base"], actor="key:a", name="a-model", owner_tenant_id=a)
        with pytest.raises(NotFound):
            register_adapter(s, folders["sales"], actor="key:b", base="a-model", owner_tenant_id=b)
        with pytest.raises(NotFound):  # a platform adapter binds to platform models only
            register_adapter(s, folders["sales"], actor="test", base="a-model")


def test_an_adapter_of_the_builtin_gguf_model(sessions: Sessions, tmp_path: Path) -> None:
    """The base's numbers come from a GGUF header by the workers' rule (api/model_config.py)."""
    from inferplane.api.model_config import read_model_config
    from inferplane.api.model_resolution import builtin_model_path
    from inferplane.bench.lora import write_random_adapter

    config = read_model_config(builtin_model_path("smollm2-135m"))
    folder = write_random_adapter(tmp_path / "smol-bot", config, 4, ["q_proj", "v_proj", "gate_proj"], seed=0)
    with sessions.begin() as s:
        register_model(s, "smollm2-135m", actor="test")
        info = register_adapter(s, folder, actor="test", base="smollm2-135m")
    assert (info.base_model, info.lora_rank, info.architecture) == ("smollm2-135m:1", 4, "llama")
    (folder / "adapter_model.safetensors").write_bytes(b"changed")
    with sessions.begin() as s:
        assert verify_model(s, ALL_TENANTS, "smol-bot", actor="test").status == "failed"


def _broken(kind: str, good: str, folder: Path) -> Path:
    """A copy of a good adapter broken one way a tenant might break it."""
    import json
    import math
    import os
    import shutil
    import struct

    shutil.copytree(good, folder)
    weights, config = folder / "adapter_model.safetensors", folder / "adapter_config.json"
    settings = json.loads(config.read_text())
    if kind in ("nan", "inf"):
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(weights))
        half = "lora_B" if kind == "nan" else "lora_A"
        next(t for n, t in sorted(tensors.items()) if half in n).view(-1)[5] = math.nan if kind == "nan" else math.inf
        save_file(tensors, str(weights))
    elif kind == "alpha-infinity":
        config.write_text(json.dumps({**settings, "lora_alpha": math.inf}))  # written as Infinity
    elif kind == "alpha-bool":
        config.write_text(json.dumps({**settings, "lora_alpha": True}))
    elif kind == "pattern":
        config.write_text(json.dumps({**settings, "alpha_pattern": {"(?<=self_attn\\.)q_proj": 4}}))
    elif kind == "rank-pattern":
        config.write_text(json.dumps({**settings, "rank_pattern": {"q_proj(": 4}}))
    elif kind in ("fifo-config", "fifo-weights"):
        target = config if kind == "fifo-config" else weights
        target.unlink()
        os.mkfifo(target)
    elif kind == "rank-2^40":  # the header claims a rank the bytes cannot hold
        raw = weights.read_bytes()
        (length,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + length])
        name = next(n for n in sorted(header) if "lora_A" in n)
        header[name]["shape"][0] = 2**40
        text = json.dumps(header).encode()
        weights.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length:])
    elif kind == "header-26mb":
        weights.write_bytes(struct.pack("<Q", 26 << 20) + b"{" + b" " * (26 << 20))
    return folder


@pytest.mark.parametrize("kind,words", [
    ("nan", "holds an infinity or a NaN"),
    ("inf", "holds an infinity or a NaN"),
    ("alpha-infinity", "lora_alpha must be a finite number"),
    ("alpha-bool", "lora_alpha must be a number, not bool"),
    ("pattern", "alpha_pattern: the key '(?<=self_attn\\\\.)q_proj' is not a pattern served here"),
    ("rank-pattern", "rank_pattern: the key 'q_proj(' is not a pattern served here"),
    ("fifo-config", "adapter_config.json is not a regular file"),
    ("fifo-weights", "adapter_model.safetensors is not a regular file"),
    ("rank-2^40", "lora_A.weight: shape must be a list of at most 4 whole numbers"),
    ("header-26mb", "its header is 27262976 bytes; at most 1048576 are read"),
])
def test_a_tenants_broken_adapter_is_refused_naming_what_and_nothing_is_recorded(
        sessions: Sessions, folders, base: str, tmp_path: Path, kind: str, words: str) -> None:
    """Validated whole at registration (api/lora_manifest.py): nothing that would fail or misbehave
    at use (non-finite weights, a file the format does not allow, a pattern Python's re would
    backtrack on or RE2 does not take, a FIFO that would hang the thread) is recorded as verified."""
    folder = _broken(kind, folders["support"], tmp_path / kind)
    with sessions.begin() as s:
        with pytest.raises(InvalidInput) as err:
            register_adapter(s, folder, actor="test", base="tiny", name="broken")
    assert err.value.status == 400 and err.value.param == "source"
    assert str(err.value).startswith("adapter 'broken': ") and words in str(err.value), str(err.value)
    with sessions() as s:
        assert list_adapters(s) == []


def test_a_nul_byte_in_the_source_or_name_is_a_400_naming_it(sessions: Sessions, folders, base: str) -> None:
    with sessions.begin() as s:
        for source, name, param in ((folders["support"] + "\x00x", None, "source"),
                                    ("https://example.com/a\x00b/", None, "source"),
                                    (folders["support"], "bot\x00", "name")):
            with pytest.raises(InvalidInput) as err:
                register_adapter(s, source, actor="test", base="tiny", name=name)
            assert err.value.status == 400 and err.value.param == param and "NUL byte" in str(err.value)
