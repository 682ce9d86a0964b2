"""`inferplane bench NAME`: dispatches to the benchmark modules (never part of the tests)."""

from __future__ import annotations

import argparse
import importlib

BENCHMARKS = {
    "engine": ("inferplane.bench.engine", "paged runtime vs HF generate_batch and generate"),
    "scenarios": ("inferplane.bench.scenarios", "radix vs paged: multi-turn, agent, no reuse"),
    "cpu": ("inferplane.bench.cpu", "cpu-int8 vs our float32 engine vs HF float32 generate"),
    "gateway": ("inferplane.bench.gateway", "gateway requests/s and added latency vs direct worker calls"),
    "fairness": ("inferplane.bench.fairness", "two tenants on one replica: interactive TTFT alone and under floods"),
    "autoscale": ("inferplane.bench.autoscale", "local stack: steady, 10x burst, idle, one request"),
    "embeddings": ("inferplane.bench.embeddings", "embedding runtime vs sentence-transformers: embeddings/s"),
    "lora": ("inferplane.bench.lora", "N LoRA adapters in one batch vs the base alone vs merged models in turn"),
    "operator": ("inferplane.bench.operator", "200 InferenceDeployments against the API server of $KUBECONFIG"),
    "kv": ("inferplane.bench.kv", "a returning conversation's KV read back from the tiers vs computed again"),
    "kv-routing": ("inferplane.bench.kv_routing", "multi-turn over replicas, one added and one removed: kv-aware vs "
                                                  "prefix-hash vs least-loaded routing, real router and KV managers"),
    "faults": ("inferplane.bench.faults", "streams while a worker is SIGKILLed every N seconds: tokens lost, "
                                          "duplicated, latency a migration adds"),
    "disagg": ("inferplane.bench.disagg", "decode streams' inter-token latency while long prompts arrive: two "
                                          "shared replicas vs a prefill replica and a decode replica"),
    "spec": ("inferplane.bench.spec", "speculative decoding (ngram, suffix) vs none: code editing, RAG, agent, "
                                      "chat; batch 1 and 8, greedy and sampled"),
    "footprint": ("inferplane.bench.footprint", "a CPU worker's measured peak and served memory vs its estimate"),
    "serve": ("inferplane.bench.serve", "OpenAI-compatible load test of a running endpoint: TTFT, ITL, TPOT, goodput"),
}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", choices=sorted(BENCHMARKS), help="which benchmark")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for that benchmark (see NAME --help)")


def run(args: argparse.Namespace) -> int:
    module_name, _ = BENCHMARKS[args.name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        print(f"benchmark {args.name!r} is not part of this build ({exc.name} is missing)")
        return 2
    return int(module.main(args.args) or 0)
