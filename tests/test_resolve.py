"""resolve(): one answer for what a spec runs, and the worker reads exactly that answer."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from inferplane.api.deployment import ConcreteRuntime, EngineConfig, InferenceDeploymentSpec
from inferplane.api.resolve import PRESETS, resolve
from inferplane.worker.engine.options import EngineOptions
from inferplane.worker.engine.runtimes import available_runtimes, kv_manager_kind
from inferplane.worker.serve import cli as worker_cli

SPECS = [
    {},
    {"runtime": "radix", "resources": {"gpus": 1}, "engine": {"maxNumSeqs": 512}},
    {"resources": {"gpus": 2}, "workload": {"agent": True}, "engine": {"dtype": "float16", "kvCacheMemory": "0.5"}},
    {"runtime": "cpu-int8", "engine": {"quantizeHead": False, "maxModelLen": 512, "blockSize": 32,
                                      "kvCacheDtype": "float16"}},
    {"runtime": "auto", "engine": {"quantizeHead": True, "requantizeQ4": True}},
    {"resources": {"gpus": 1}, "engine": {"quantizeHead": False, "maxNumBatchedTokens": 100, "maxNumSeqs": 50}},
    {"engine": {"speculative": {"method": "suffix", "numTokens": 7}}},
    {"kind": "embedding"},
    {"kind": "embedding", "runtime": "embedding", "resources": {"gpus": 1}, "engine": {"maxNumSeqs": 32}},
]


def worker_options(args: list[str]) -> EngineOptions:
    parser = argparse.ArgumentParser()
    worker_cli.configure(parser)
    return worker_cli.engine_options(parser.parse_args(["--model", "m", *args]))


@pytest.mark.parametrize("spec", SPECS)
def test_the_worker_parses_the_resolved_engine_as_resolved(spec: dict) -> None:
    resolved = resolve(InferenceDeploymentSpec.from_dict({"model": {"name": "m"}, **spec}))
    options = worker_options(resolved.engine_args())
    assert (options.runtime, options.device) == (resolved.runtime, resolved.device)
    for name, value in resolved.engine.items():
        assert getattr(options, name) == (value if value is not None else getattr(EngineOptions(), name)), name


def test_every_engine_field_of_the_spec_is_a_worker_option_of_the_same_name() -> None:
    """What lets a new engine field reach the worker without touching resolve() or the operator."""
    options = {f.name for f in dataclasses.fields(EngineOptions)}
    assert set(EngineConfig.model_fields) <= options


def test_each_runtime_is_one_preset_the_worker_can_build() -> None:
    assert tuple(PRESETS) == ConcreteRuntime.__args__
    assert available_runtimes() == tuple(PRESETS)
    for name, preset in PRESETS.items():
        assert kv_manager_kind(EngineOptions(runtime=name)) == preset.kv_manager


@pytest.mark.parametrize(("spec", "runtime", "device", "dtype"), [
    ({}, "cpu-int8", "cpu", "float32"),
    ({"resources": {"gpus": 1}}, "paged", "cuda", "bfloat16"),
    ({"resources": {"gpus": 1}, "workload": {"multiTurn": True}}, "radix", "cuda", "bfloat16"),
    ({"runtime": "paged", "engine": {"dtype": "bfloat16"}}, "paged", "cpu", "bfloat16"),
    ({"kind": "embedding"}, "embedding", "cpu", "float32"),
    ({"kind": "embedding", "resources": {"gpus": 1}}, "embedding", "cuda", "bfloat16"),
])
def test_auto_device_and_dtype(spec: dict, runtime: str, device: str, dtype: str) -> None:
    resolved = resolve(InferenceDeploymentSpec.from_dict({"model": {"name": "m"}, **spec}))
    assert (resolved.runtime, resolved.device, resolved.dtype) == (runtime, device, dtype)
    assert (resolved.cpu_threads is None) is (device == "cuda")


def test_presets_fill_only_what_the_spec_left_open() -> None:
    spec = InferenceDeploymentSpec.from_dict({"model": {"name": "m"}, "runtime": "radix",
                                              "engine": {"maxNumSeqs": 9000 // 9}})
    resolved = resolve(spec)
    assert resolved.engine["max_num_seqs"] == 1000
    assert resolved.engine["max_num_batched_tokens"] == PRESETS["radix"].max_num_batched_tokens
    assert resolved.engine["kv_cache_memory"] == PRESETS["radix"].kv_cache_memory_cpu


def test_an_embedding_deployment_has_no_kv_cache_to_size() -> None:
    resolved = resolve(InferenceDeploymentSpec.from_dict({"model": {"name": "m"}, "kind": "embedding"}))
    assert resolved.engine["kv_cache_memory"] is None and "--kv-cache-memory" not in resolved.engine_args()
    assert resolved.reason.startswith("auto: kind embedding")
    assert resolved.engine["max_num_seqs"] == PRESETS["embedding"].max_num_seqs


@pytest.mark.parametrize(("memory", "ok"), [("1Gi", False), ("1000Mi", False), ("1535Mi", False),
                                            ("1536Mi", True), ("2Gi", True), ("1.5Gi", True)])
def test_a_worker_needs_more_memory_than_its_runtime_takes(memory: str, ok: bool) -> None:
    """Issue 53: below api.deployment.MIN_WORKER_MEMORY no model can start (the worker process
    alone takes about 1 GiB; api/footprint.py); the spec is refused naming resources.memory. What a
    model needs beyond it the worker checks against its own footprint at start."""
    from inferplane.api.deployment import SpecError

    spec = {"model": {"name": "m"}, "resources": {"memory": memory}}
    if ok:
        assert InferenceDeploymentSpec.from_dict(spec).resources.memory == memory
        return
    with pytest.raises(SpecError) as refused:
        InferenceDeploymentSpec.from_dict(spec)
    assert refused.value.field == "resources.memory" and "at least 1536Mi" in str(refused.value)


def test_speculative_decoding_reaches_the_worker_as_the_spec_says() -> None:
    resolved = resolve(InferenceDeploymentSpec.from_dict({"model": {"name": "m"},
                                                           "engine": {"speculative": {"method": "ngram"}}}))
    section = worker_options(resolved.engine_args()).speculation()
    assert (section.method, section.num_tokens) == ("ngram", 5)
    assert worker_options([]).speculation() is None


@pytest.mark.parametrize(("value", "field"), [({"method": "draft"}, "speculative.method"),
                                               ('{"method": "ngram", "numTokens": 0}', "speculative.numTokens"),
                                               ("ngram", "speculative")])
def test_a_bad_speculative_option_names_its_field(value, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}: "):
        EngineOptions(speculative=value).validate()
