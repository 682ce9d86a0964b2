"""One home for the engine's defaults: a runtime started as a deployment (resolve()), as `LLM(...)`
and as `inferplane worker` runs with the same settings (issue 32: before, `LLM(runtime="radix")` and
the worker ran 256 sequences and 2,048 batched tokens where a radix deployment ran 128 and 8,192)."""

from __future__ import annotations

import argparse

import pytest

from inferplane.api.deployment import InferenceDeploymentSpec
from inferplane.api.resolve import PRESETS, resolve
from inferplane.worker.engine.engine import Engine
from inferplane.worker.engine.options import PRESET_DECIDED
from inferplane.worker.llm import LLM
from inferplane.worker.serve import cli as worker_cli

GENERATIVE = [name for name, preset in PRESETS.items() if preset.kv_manager is not None]
COMPARED = (*PRESET_DECIDED, "block_size", "kv_cache_dtype", "max_model_len")


def _settings(engine: Engine) -> dict:
    """What the engine runs with: its options and what its scheduler and KV pool were built from."""
    return {**{name: getattr(engine.options, name) for name in COMPARED},
            "scheduler_seqs": engine.scheduler.max_num_seqs,
            "scheduler_tokens": engine.scheduler.max_num_batched_tokens, "kv_blocks": engine.kv.num_blocks}


def _from_worker_cli(model: str, args: list[str]) -> Engine:
    parser = argparse.ArgumentParser()
    worker_cli.configure(parser)
    engine, _, _ = worker_cli._build_engine(parser.parse_args(["--model", model, *args]))
    return engine


@pytest.mark.parametrize("runtime", GENERATIVE)
def test_a_runtime_started_three_ways_runs_with_the_same_settings(tiny_llama, runtime):
    resolved = resolve(InferenceDeploymentSpec.from_dict({"model": {"name": "m"}, "runtime": runtime}))
    assert resolved.device == "cpu"
    gate = {"skip_quality_gate": True} if runtime == "cpu-int8" else {}
    by_llm = _settings(LLM(tiny_llama, runtime=runtime, device="cpu", **gate).engine)
    by_cli = _settings(_from_worker_cli(tiny_llama, resolved.engine_args() + (["--skip-quality-gate"] if gate else [])))
    by_flags = _settings(_from_worker_cli(tiny_llama, ["--runtime", runtime, "--device", "cpu",
                                                       *(["--skip-quality-gate"] if gate else [])]))
    assert by_llm == by_cli == by_flags
    preset = PRESETS[runtime]
    assert by_llm["max_num_seqs"] == by_llm["scheduler_seqs"] == preset.max_num_seqs
    assert by_llm["max_num_batched_tokens"] == by_llm["scheduler_tokens"] == preset.max_num_batched_tokens
    for name in COMPARED:
        assert by_llm[name] == resolved.engine[name], name


def test_what_a_caller_sets_wins_over_the_preset(tiny_llama):
    engine = LLM(tiny_llama, runtime="radix", device="cpu", max_num_seqs=3, kv_cache_memory="8MiB").engine
    assert (engine.scheduler.max_num_seqs, engine.options.kv_cache_memory) == (3, "8MiB")
    # The preset's token budget, never below one token per sequence.
    assert engine.scheduler.max_num_batched_tokens == PRESETS["radix"].max_num_batched_tokens
