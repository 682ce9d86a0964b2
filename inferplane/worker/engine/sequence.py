"""A request as the engine sees it: token ids, how many of them the KV cache holds, its blocks."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from inferplane.api.priority import DEFAULT_RANK
from inferplane.worker.engine.sampling import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # the effective cap, never None (SamplingParams.validate: params' or the context's room)
    rng_key: int  # what its draws are made from (sampling.uniform_draw): its seed, or fresh entropy
    cache_salt: str = ""
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    # With params.top_logprobs: per output token, the (token id, logprob) alternatives, best first.
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (radix)
    block_table: list[int] = field(default_factory=list)
    # The sliding-window layers' blocks (kv/window.py): entry i as in block_table, NULL_BLOCK where
    # the window has moved past it. Empty for models without such layers.
    window_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_string: str | None = None  # the stop string that ended it (vLLM's stop_reason; Anthropic's stop_sequence)
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    output_text: str = ""
    # With stop strings: how much of output_text has gone out (the rest could begin a stop string
    # and is held back until the next token shows: outputs.cut_at_stop).
    text_sent: int = 0
    # Radix bookkeeping: tree nodes this sequence holds locked (kv/radix.py).
    locked_nodes: list = field(default_factory=list)
    # Structured output: the grammar state (worker/structured/state.py) that has accepted every output token.
    grammar: Any = None
    # n > 1: the request id callers know (request_id is unique per sequence) and this choice's index.
    group_id: str = ""
    index: int = 0
    # The group's other choices, waiting for this sequence's prompt KV to be forked to them.
    forks: list[Sequence] = field(default_factory=list)
    # params.prompt_logprobs: entry i is prompt token i + 1's (sampling.TokenLogprob), filled as
    # prefill chunks compute them; a recompute after preemption does not add them twice.
    prompt_logprobs: list = field(default_factory=list)
    prompt_logprobs_sent: bool = False  # they go out once, with the choice's first output
    # Flow control (fair_share.py): the tenant whose share this sequence counts against, and its
    # priority band's rank (api/priority.py: 0 is the most urgent).
    tenant: str = ""
    band: int = DEFAULT_RANK
    # The LoRA adapter the sequence runs under (lora.LoraAdapter; None: the base) and, while it is
    # admitted, the adapter slot it pins (lora.AdapterSlots; -1: none).
    adapter: Any = None
    adapter_slot: int = -1
    # Speculative decoding's per-request state (speculation/speculator.SpeculationState), or None.
    speculation: Any = None

    @property
    def adapter_key(self) -> str:
        return self.adapter.key if self.adapter is not None else ""

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    def __post_init__(self) -> None:
        self.group_id = self.group_id or self.request_id

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) without concatenating prompt and output (a decode needs one token)."""
        prompt_len = len(self.prompt_token_ids)
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len : end - prompt_len]
        return self.all_token_ids[start:end]

    def token_at(self, position: int) -> int:
        """The token at `position` (what a decode feeds the model), without building a slice."""
        prompt_len = len(self.prompt_token_ids)
        if position < prompt_len:
            return self.prompt_token_ids[position]
        return self.output_token_ids[position - prompt_len]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
