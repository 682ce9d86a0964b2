"""Worker metrics: request outcomes and latencies recorded on finish, engine gauges read at scrape time."""

from __future__ import annotations

from prometheus_client import generate_latest

from inferplane.worker.engine.outputs import StepOutput
from inferplane.worker.serve.metrics import WorkerMetrics


def _finished(reason: str, ttft: float = 0.1, latency: float = 0.5, tokens: int = 5) -> StepOutput:
    return StepOutput("r", [], [], "", True, reason, num_prompt_tokens=7, num_output_tokens=tokens,
                      ttft=ttft, latency=latency)


def test_outcomes_latencies_and_engine_gauges_are_exported():
    stats = {"num_running": 3, "num_waiting": 2, "blocks_used": 40, "blocks_total": 100, "preemptions": 4,
             "prefix_query_tokens": 90, "prefix_hit_tokens": 30}
    metrics = WorkerMetrics("m", "radix", lambda: stats)
    metrics.observe_finished(_finished("length"))
    metrics.observe_finished(_finished("abort", tokens=1))
    metrics.observe_finished(_finished("error", tokens=0))
    text = generate_latest(metrics.registry).decode()
    labels = 'model="m",outcome="{}",runtime="radix"'
    assert f'inferplane_worker_requests_total{{finish_reason="length",{labels.format("ok")}}} 1.0' in text
    assert f'inferplane_worker_requests_total{{finish_reason="abort",{labels.format("cancelled")}}} 1.0' in text
    assert f'inferplane_worker_requests_total{{finish_reason="error",{labels.format("error")}}} 1.0' in text
    assert 'inferplane_worker_time_to_first_token_seconds_count{model="m",runtime="radix"} 3.0' in text
    # (0.5 - 0.1) / (5 - 1) = 0.1 s per output token after the first, observed once (1-token requests skip it)
    assert 'inferplane_worker_time_per_output_token_seconds_sum{model="m",runtime="radix"} 0.1' in text
    assert 'inferplane_worker_prompt_tokens_total{model="m",runtime="radix"} 21.0' in text
    assert 'inferplane_worker_kv_blocks_used{model="m",runtime="radix"} 40.0' in text
    assert 'inferplane_worker_preemptions_total{model="m",runtime="radix"} 4.0' in text
    stats["blocks_used"] = 10  # read at scrape time, not copied at start
    scraped = generate_latest(metrics.registry).decode()
    assert 'inferplane_worker_kv_blocks_used{model="m",runtime="radix"} 10.0' in scraped


def test_a_workers_kv_tiers_are_exported_per_tier(tiny_llama, tmp_path):
    """A real engine's tier stats, as the scrape shows them: per tier where they have one."""
    from inferplane.worker.engine.sampling import SamplingParams
    from inferplane.worker.llm import LLM

    llm = LLM(tiny_llama, runtime="radix", block_size=4, num_kv_blocks=64, kv_offload_memory="1MiB",
              kv_offload_disk="1MiB", kv_offload_dir=str(tmp_path))
    llm.generate(list(range(40)), SamplingParams(max_tokens=4, temperature=0.0))
    text = generate_latest(WorkerMetrics("m", "radix", llm.stats).registry).decode()
    labels = 'model="m",runtime="radix"'
    assert f'inferplane_worker_kv_tier_blocks{{{labels},tier="memory"}} 10.0' in text
    assert f'inferplane_worker_kv_tier_stored_total{{{labels},tier="memory"}} 10.0' in text
    assert f'inferplane_worker_kv_tier_blocks{{{labels},tier="disk"}} 10.0' in text  # written through
    assert f'inferplane_worker_kv_tier_saved_blocks_total{{{labels}}} 10.0' in text
    assert f'inferplane_worker_kv_tier_misses_total{{{labels}}} 0.0' in text


def test_speculative_decoding_is_exported_by_method(tiny_llama):
    """A real engine that verified drafts: proposed, accepted and verifying rows by method, their
    counts as the engine kept them."""
    from inferplane.worker.engine.sampling import SamplingParams
    from inferplane.worker.llm import LLM

    llm = LLM(tiny_llama, runtime="paged", speculative={"method": "ngram", "num_tokens": 4})
    # the bias keeps the random model's tokens among the prompt's, whose runs then propose drafts
    llm.generate([5, 6, 7, 8] * 10, SamplingParams(max_tokens=24, temperature=0.0,
                                                   logit_bias={t: 100.0 for t in (5, 6, 7, 8)}))
    stats = llm.stats()
    proposed = stats["spec_proposed_tokens_total:ngram"]
    assert proposed > 0  # the prompt repeats itself: drafts were proposed
    text = generate_latest(WorkerMetrics("m", "paged", llm.stats).registry).decode()
    labels = 'method="ngram",model="m",runtime="paged"'
    assert f"inferplane_worker_spec_proposed_tokens_total{{{labels}}} {float(proposed)}" in text
    accepted = stats["spec_accepted_tokens_total:ngram"]
    assert f"inferplane_worker_spec_accepted_tokens_total{{{labels}}} {float(accepted)}" in text
    verified = stats["spec_verifications_total:ngram"]
    assert f"inferplane_worker_spec_verifications_total{{{labels}}} {float(verified)}" in text
