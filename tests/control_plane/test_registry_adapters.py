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
