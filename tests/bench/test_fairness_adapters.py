"""`inferplane bench fairness`'s adapter cases (issue 53, classes 1 and 2): what the flooding tenant
registers is what the case says (each poisoned adapter non-finite in exactly the named way and
otherwise a fit for the base; each pattern adapter's keys catastrophic for a backtracking matcher or
past any sane size, in a config small enough to reach the pattern checks), the cases are selected
as the others are, and (slow) the harness serves each tenant its own adapter beside the base while
the admin API refuses the poisoned ones."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
from itertools import islice
from pathlib import Path

import httpx
import numpy as np
import pytest
from safetensors.numpy import load_file

from inferplane.api.lora_manifest import CONFIG_FILE, WEIGHTS_FILE, BaseShape, read_manifest
from inferplane.api.model_config import read_model_config
from inferplane.bench import fairness, fairness_harness
from inferplane.bench.fairness_adapters import (
    ADAPTER_CASES,
    NESTED,
    NESTED_ALTERNATION,
    OWN,
    POISONS,
    AdapterSetup,
    _flood_attempts,
    case_flood,
    pattern_variants,
)
from inferplane.storage.digest import digest

# The tiny bench model's shapes (bench/tiny_model.py): a config.json is all the adapters are checked against.
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "vocab_size": 320, "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
MODULE_NAMES = [f"model.layers.{layer}.self_attn.{m}" for layer in range(2) for m in ("q_proj", "k_proj", "v_proj",
                                                                                      "o_proj")]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny")
    (folder / "config.json").write_text(json.dumps(TINY))
    return folder


@pytest.fixture(scope="module")
def setup(tmp_path_factory, base: Path) -> AdapterSetup:
    return AdapterSetup.prepare(tmp_path_factory.mktemp("root") / "adapters", str(base))


def _nonfinite(folder: Path) -> dict[str, np.ndarray]:
    """Tensor name -> its values, for each tensor holding a value that is not finite."""
    return {name: values for name, values in load_file(str(folder / WEIGHTS_FILE)).items()
            if not np.isfinite(values).all()}


def _fits(folder: Path, base: Path) -> None:
    read_manifest(folder, folder.name).check(BaseShape.of(read_model_config(base)))


def test_each_poisoned_adapter_holds_its_poison_and_nothing_else(setup: AdapterSetup, base: Path) -> None:
    assert set(setup.poisoned) == set(POISONS)
    bad = {poison: _nonfinite(folder) for poison, folder in setup.poisoned.items()}
    configs = {poison: json.loads((folder / CONFIG_FILE).read_text()) for poison, folder in setup.poisoned.items()}

    (name, values), = bad["nan-lora_B"].items()
    assert name.endswith("lora_B.weight") and np.isnan(values).all()
    (name, values), = bad["one-nan-lora_B"].items()
    assert name.endswith("lora_B.weight") and np.isnan(values).sum() == 1 == (~np.isfinite(values)).sum()
    (name, values), = bad["inf-lora_A"].items()
    assert name.endswith("lora_A.weight") and (values == np.inf).all()
    (name, values), = bad["neg-inf-lora_B"].items()
    assert name.endswith("lora_B.weight") and (values == -np.inf).sum() == 1 == (~np.isfinite(values)).sum()
    assert bad["alpha-Infinity"] == {} and configs["alpha-Infinity"]["lora_alpha"] == math.inf
    assert bad["alpha_pattern-NaN"] == {} and math.isnan(configs["alpha_pattern-NaN"]["alpha_pattern"]["q_proj"])
    assert all(math.isfinite(c["lora_alpha"]) for p, c in configs.items() if p != "alpha-Infinity")
    for poison in ("nan-lora_B", "one-nan-lora_B", "inf-lora_A", "neg-inf-lora_B"):
        _fits(setup.poisoned[poison], base)  # the value is the only thing wrong with it


def test_the_tenants_own_adapters_and_the_pattern_template_are_valid(setup: AdapterSetup, base: Path) -> None:
    folders = [*setup.own.values(), setup.template]
    assert set(setup.own) == set(OWN)
    for folder in folders:
        assert _nonfinite(folder) == {}
        assert math.isfinite(json.loads((folder / CONFIG_FILE).read_text())["lora_alpha"])
        _fits(folder, base)
    assert len({digest(folder) for folder in folders}) == len(folders)  # three different adapters


def test_pattern_adapters_are_catastrophic_or_oversized_and_new_each_time(setup: AdapterSetup, base: Path) -> None:
    variants = pattern_variants()
    flood = case_flood("adapter-patterns", setup, copies=2, base="tiny")
    attempts = list(islice(_flood_attempts(flood), 2 * len(variants)))
    assert [label for label, _ in attempts] == list(variants) * 2  # each variant, in a loop
    assert len({digest(Path(folder)) for _, folder in attempts}) == len(attempts)  # each a first use
    for label, folder in attempts:
        config = json.loads((Path(folder) / CONFIG_FILE).read_text())
        assert list(config["alpha_pattern"]) == list(config["rank_pattern"]) == variants[label]
        assert (Path(folder) / CONFIG_FILE).stat().st_size < 1 << 20  # past the config's size bound: no
        assert load_file(str(Path(folder) / WEIGHTS_FILE)).keys() == load_file(
            str(setup.template / WEIGHTS_FILE)).keys()
    # Nested quantifiers that fail against every module name (none holds a "!"), so a backtracking
    # matcher tries every way to split the name among the repetitions.
    nested_group = re.compile(r"\((?:\?:)?(?:\[[^\]]+\]\+|\[[^\]]+\]\|\[[^\]]+\])\)\+!$")
    for pattern in (NESTED, NESTED_ALTERNATION):
        assert nested_group.search(pattern)
        assert all("!" not in name for name in MODULE_NAMES)
        prefix = pattern.split("(")[0].replace("\\", "")
        assert all(name.startswith(prefix) for name in MODULE_NAMES)  # every name reaches the group
    assert variants["nested-plus"] == ["(a+)+$"]
    assert len(variants["long-pattern"][0]) >= 10_000
    assert len(variants["many-patterns"]) >= 1_000
    assert variants["huge-alternation"][0].count("|") >= 10_000
    assert re.search(r"\\1", variants["backreference"][0])
    assert re.fullmatch(r"(\(+a\{100\}\)\{100\}\)\{100\})", variants["counted-repetition"][0])


def test_the_adapter_cases_are_selected_as_the_other_floods(setup: AdapterSetup) -> None:
    assert fairness.ADAPTER_CASES == ADAPTER_CASES == ("adapter-poison", "adapter-patterns")
    assert fairness._adapter_cases(argparse.Namespace(cases=None)) == list(ADAPTER_CASES)  # the default: all
    assert fairness._adapter_cases(argparse.Namespace(cases=["fan-out", "adapter-patterns"])) == ["adapter-patterns"]
    assert fairness._adapter_cases(argparse.Namespace(cases=["fan-out"])) == []
    assert not set(ADAPTER_CASES) & set(fairness.flood_cases(4))
    poison = case_flood("adapter-poison", setup, copies=2, base="tiny")
    assert [label for label, _ in poison.attempts] == list(POISONS)
    assert [label for label, _ in islice(_flood_attempts(poison), len(POISONS) + 1)] == [*POISONS, POISONS[0]]
    with pytest.raises(ValueError, match="unknown adapter case"):
        case_flood("adapter-nothing", setup, copies=2, base="tiny")
    worker, gateway = AdapterSetup.worker_args(), setup.gateway_args()
    assert worker[:2] == ("--max-loras", "4") and "--max-lora-rank" in worker
    assert {"--bootstrap-admin", "--register-base", "--model-root"} <= set(gateway)
    assert f"interactive={OWN['interactive']}={setup.own['interactive']}" in gateway
    assert f"flood={OWN['flood']}={setup.own['flood']}" in gateway


@pytest.mark.slow  # a worker and a gateway process, each importing torch
def test_the_harness_serves_each_tenant_its_adapter_and_refuses_poisoned_ones(tmp_path: Path) -> None:
    from inferplane.bench.fairness_adapters import probe_answers
    from inferplane.bench.fairness_harness import Tenants
    from inferplane.bench.gateway_harness import free_port, start_gateway, start_worker, stop_worker, wait_serving
    from inferplane.bench.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "tiny")
    setup = AdapterSetup.prepare(tmp_path / "adapters", model)
    port = free_port()
    worker = start_worker(model, port, "--runtime", "radix", "--max-model-len", "1024", *setup.worker_args(),
                          log_path=str(tmp_path / "worker.log"))
    gateway = None
    try:
        wait_serving(f"127.0.0.1:{port}", worker)
        gateway = start_gateway([f"127.0.0.1:{port}"], log_path=str(tmp_path / "gateway.log"),
                                extra=("--tenant", "interactive", "--tenant", "flood", *setup.gateway_args()))
        setup.with_keys(gateway)
        t = Tenants(gateway.base_url, gateway.keys, "tiny")
        with httpx.Client(base_url=gateway.base_url, timeout=120) as http:
            listed = http.get("/v1/models", headers=t.headers("interactive")).json()["data"]
            assert {m["id"] for m in listed} == {"tiny", OWN["interactive"]}  # not the flood's
            answers = asyncio.run(probe_answers(t, ["tiny", OWN["interactive"]], 1))
            assert answers.probe.errors == 0
            assert answers.texts["tiny"] != answers.texts[OWN["interactive"]]  # the adapter is applied
            other = http.post("/v1/chat/completions", headers=t.headers("flood"),
                              json={"model": OWN["interactive"], "messages": fairness_harness.CHAT, "max_tokens": 2})
            assert other.status_code == 404
            for poison, folder in setup.poisoned.items():
                body = {"source": str(folder), "base": "tiny", "name": f"flood-{poison}".lower().replace("_", "-")}
                as_tenant = http.post("/admin/v1/adapters", json=body,
                                      headers={"Authorization": f"Bearer {setup.admin_keys['flood']}"})
                assert as_tenant.status_code == 403, as_tenant.text  # a tenant admin registers aliases only
                as_platform = http.post("/admin/v1/adapters", json=body,
                                        headers={"Authorization": f"Bearer {setup.platform_key}"})
                assert as_platform.status_code == 400, (poison, as_platform.text)
                assert as_platform.json()["error"]["param"] == "source", as_platform.text
            listed = http.get("/admin/v1/adapters", headers={"Authorization": f"Bearer {setup.platform_key}"})
            assert {a["name"] for a in listed.json()["data"]} == set(OWN.values())
    finally:
        if gateway is not None:
            gateway.stop()
        stop_worker(worker)


def test_answers_count_every_answer_that_differs_from_alone() -> None:
    from inferplane.bench.fairness_adapters import Answers

    answers = Answers(texts={"tiny": ["abc", "abc", "", "<error>"], "bot": ["xyz", "xyz"]})
    reference = {"tiny": "abc", "bot": "xyz"}
    assert answers.mismatches(reference) == {"tiny": 2, "bot": 0}
    assert answers.first_differing(reference) == {"tiny": ""}
