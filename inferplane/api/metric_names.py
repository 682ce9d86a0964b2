"""Every Prometheus metric name the platform exports, in one place.

The exporters (worker, gateway, autoscaler, operator) and what reads the series (the generated
alert and recording rules, the Grafana dashboards) both take names from here, so a rename breaks
at import time instead of leaving a dashboard panel on "No data". Counters are named without
`_total` (prometheus_client appends it to the exposed series); `SERIES_*` names are what
Prometheus stores and what PromQL must say.
"""

from __future__ import annotations

# -- worker (one per replica; labels model, runtime; the ServiceMonitor adds namespace, service, pod)
WORKER_REQUESTS = "inferplane_worker_requests"  # labels outcome ("ok"|"error"|"cancelled"), finish_reason
WORKER_TTFT = "inferplane_worker_time_to_first_token_seconds"
WORKER_TPOT = "inferplane_worker_time_per_output_token_seconds"
WORKER_E2E = "inferplane_worker_e2e_request_latency_seconds"
WORKER_PROMPT_TOKENS = "inferplane_worker_prompt_tokens"
WORKER_GENERATION_TOKENS = "inferplane_worker_generation_tokens"
WORKER_PREEMPTIONS = "inferplane_worker_preemptions"
WORKER_PREFIX_QUERY_TOKENS = "inferplane_worker_prefix_cache_query_tokens"
WORKER_PREFIX_HIT_TOKENS = "inferplane_worker_prefix_cache_hit_tokens"
WORKER_PREFIX_EVICTED_BLOCKS = "inferplane_worker_prefix_cache_evicted_blocks"
WORKER_RUNNING = "inferplane_worker_num_requests_running"
WORKER_WAITING = "inferplane_worker_num_requests_waiting"
WORKER_KV_USED = "inferplane_worker_kv_blocks_used"
WORKER_KV_CAPACITY = "inferplane_worker_kv_blocks_capacity"
WORKER_KV_CACHED = "inferplane_worker_kv_blocks_cached"
WORKER_KV_PEAK = "inferplane_worker_kv_blocks_peak_used"
WORKER_TREE_NODES = "inferplane_worker_prefix_cache_tree_nodes"
WORKER_NATIVE_KERNELS = "inferplane_worker_native_kernels"  # how many of the kernels run in C
WORKER_NATIVE_KERNEL = "inferplane_worker_native_kernel"  # 1 per {kernel, isa}; isa="torch": PyTorch's op
WORKER_WEIGHTS_INFO = "inferplane_worker_weights_info"
WORKER_TENANT_SEQUENCES = "inferplane_worker_tenant_sequences"  # labels state (running|waiting), band, tenant
WORKER_FAIR_SHARE_PREEMPTIONS = "inferplane_worker_fair_share_preemptions"  # slots taken back for a share or band
# LoRA adapters (engine.maxLoras slots): loads into a slot, evictions, sequences waiting for a slot,
# and per adapter (label adapter) requests and whether it is loaded now.
WORKER_LORA_SLOTS = "inferplane_worker_lora_slots"
WORKER_LORA_SLOTS_LOADED = "inferplane_worker_lora_slots_loaded"
WORKER_LORA_WAITING = "inferplane_worker_lora_waiting_for_slot"
WORKER_LORA_LOADS = "inferplane_worker_lora_loads"
WORKER_LORA_EVICTIONS = "inferplane_worker_lora_evictions"
WORKER_LORA_REQUESTS = "inferplane_worker_lora_requests"
WORKER_LORA_LOADED = "inferplane_worker_lora_loaded"
# KV tiers (--kv-offload-*): per tier (label tier: memory, disk; hits also "prefetched", read ahead off
# the engine thread) blocks and bytes held, hits, blocks stored and evicted; and without a tier label
# misses, records rejected by a check, blocks read ahead, saved from and loaded into the pool.
WORKER_KV_TIER_BLOCKS = "inferplane_worker_kv_tier_blocks"
WORKER_KV_TIER_BYTES = "inferplane_worker_kv_tier_bytes"
WORKER_KV_TIER_HITS = "inferplane_worker_kv_tier_hits"
WORKER_KV_TIER_STORED = "inferplane_worker_kv_tier_stored"
WORKER_KV_TIER_EVICTED = "inferplane_worker_kv_tier_evicted"
WORKER_KV_TIER_READ_SECONDS = "inferplane_worker_kv_tier_read_seconds"  # label tier: time reading hits
WORKER_KV_TIER_MISSES = "inferplane_worker_kv_tier_misses"
# Prefill/decode disaggregation (worker/serve/kv_transfer.py), label direction: pulled | served
WORKER_KV_TRANSFER_BLOCKS = "inferplane_worker_kv_transfer_blocks"
WORKER_KV_TRANSFER_BYTES = "inferplane_worker_kv_transfer_bytes"
WORKER_KV_TRANSFER_SECONDS = "inferplane_worker_kv_transfer_seconds"
WORKER_KV_TRANSFER_FAILURES = "inferplane_worker_kv_transfer_failures"  # pulls that failed: computed instead
# Speculative decoding, by method: draft tokens verified, kept, and rows that carried a draft (the
# acceptance length is 1 + accepted / verifications: tokens a verifying row emits).
WORKER_SPEC_PROPOSED = "inferplane_worker_spec_proposed_tokens"
WORKER_SPEC_ACCEPTED = "inferplane_worker_spec_accepted_tokens"
WORKER_SPEC_VERIFICATIONS = "inferplane_worker_spec_verifications"
WORKER_SPEC_NO_ROOM = "inferplane_worker_spec_drafts_without_room"  # dropped: the KV pool had no block
WORKER_KV_TIER_REJECTED = "inferplane_worker_kv_tier_rejected"
WORKER_KV_TIER_PREFETCHED = "inferplane_worker_kv_tier_prefetched_blocks"
WORKER_KV_TIER_SAVED = "inferplane_worker_kv_tier_saved_blocks"
WORKER_KV_TIER_LOADED = "inferplane_worker_kv_tier_loaded_blocks"
WORKER_KV_EVENTS = "inferplane_worker_kv_events_published"  # KV events (engine/kv/events.py) published
# prometheus_client's process collector, which every worker registers: a restart moves it.
PROCESS_START_TIME = "process_start_time_seconds"

# -- gateway (control plane; no `namespace` label of its own, the scrape adds the gateway's)
GATEWAY_REQUESTS = "inferplane_gateway_requests"  # labels route, status (HTTP code)
GATEWAY_LATENCY = "inferplane_gateway_request_seconds"
GATEWAY_TTFT = "inferplane_gateway_time_to_first_token_seconds"
GATEWAY_TOKENS = "inferplane_gateway_tokens"  # labels model, kind
GATEWAY_LIMITER_STORE_ERRORS = "inferplane_gateway_limiter_store_errors"
GATEWAY_MIGRATIONS = "inferplane_gateway_migrations"  # label cause: the failed worker call's status
GATEWAY_DISAGGREGATION = "inferplane_gateway_disaggregation_requests"  # label outcome: where the prompt ran
GATEWAY_PREFILL_SECONDS = "inferplane_gateway_prefill_seconds"  # a disaggregated request's time in the prefill pool
# labels tenant, key, result ("admitted"|"rate_limited"|"quota_exceeded"|"concurrency_limited")
KEY_REQUESTS = "inferplane_key_requests"
TENANT_TOKENS = "inferplane_tenant_tokens"  # labels tenant, model, kind ("prompt"|"completion")
TENANT_QUOTA_TOKENS = "inferplane_tenant_quota_tokens"  # label tenant; only tenants with a quota
TENANT_QUOTA_USED_TOKENS = "inferplane_tenant_quota_used_tokens"  # label tenant; this month, reservations included
USAGE_FLUSH_LAST_SUCCESS = "inferplane_usage_flush_last_success_timestamp_seconds"
USAGE_PENDING_RECORDS = "inferplane_usage_pending_records"
DATABASE_UP = "inferplane_database_up"
DEPLOYMENT_REPLICAS_READY = "inferplane_deployment_replicas_ready"  # labels model, deployment
DEPLOYMENT_REPLICAS_DESIRED = "inferplane_deployment_replicas_desired"
# KV-aware routing (control_plane/routing/kv_index.py): labels policy, outcome ("held": the replica
# holding most of the prompt's blocks; "ring": the hash ring; "least_loaded")
GATEWAY_ROUTING_DECISIONS = "inferplane_gateway_routing_decisions"
GATEWAY_KV_INDEX_BLOCKS = "inferplane_gateway_kv_index_blocks"  # distinct blocks some replica holds
GATEWAY_KV_INDEX_REPLICA_BLOCKS = "inferplane_gateway_kv_index_replica_blocks"  # labels replica, medium
GATEWAY_KV_EVENT_BATCHES = "inferplane_gateway_kv_event_batches"  # KV event batches applied

# -- autoscaler (inside the gateway; label deployment)
AUTOSCALER_DESIRED = "inferplane_autoscaler_desired_replicas"
AUTOSCALER_CURRENT = "inferplane_autoscaler_current_replicas"
AUTOSCALER_MAX = "inferplane_autoscaler_max_replicas"
AUTOSCALER_SATURATION = "inferplane_autoscaler_saturation"
AUTOSCALER_PANIC = "inferplane_autoscaler_panic"

# -- operator
OPERATOR_BUILD_INFO = "inferplane_operator_build_info"  # label version
OPERATOR_RECONCILES = "inferplane_operator_reconciles"  # label result ("ok"|"error")


def series(counter: str) -> str:
    """The stored name of a counter declared without `_total`."""
    return f"{counter}_total"
