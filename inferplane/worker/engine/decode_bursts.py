"""When to run several greedy decode steps in one call: a scheduling decision the engine asks for
each batch the scheduler planned.

Why: on the CPU a batch-1 step's Python (scheduling, the step's inputs, appending the token) cost
0.27-0.33 ms of SmolLM2's 2.5 ms step; a burst pays it once, as vLLM's multi-step scheduling does.
ModelRunner.execute runs the burst (native ip_decode_steps); the engine appends its tokens as
single steps would have.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from inferplane.worker.engine.options import EngineOptions
from inferplane.worker.engine.scheduler import ScheduledSequence
from inferplane.worker.engine.sequence import Sequence

_DECODE_SMOOTHING = 0.3  # weight of the newest decode step time in DecodeBursts.decode_step_s


class DecodeBursts:
    """How many decode steps a batch may run in one call, from the options (read at each call:
    `decode_steps`, `step_target_ms`) and the measured time of a decode step."""

    def __init__(self, options: EngineOptions, device: torch.device, block_size: int, max_model_len: int):
        self.options = options
        self.device = device
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.decode_step_s: float | None = None  # a decode-only step's seconds, a running average

    def observe(self, prefill_tokens: int, seconds: float, steps: int) -> None:
        """A step ran `steps` decode steps (a burst, or 1) in `seconds`; only a step without
        prefill says what one decode step costs, which is how long a burst may hold the engine."""
        if prefill_tokens:
            return
        per_step = seconds / steps
        self.decode_step_s = per_step if self.decode_step_s is None else (
            _DECODE_SMOOTHING * per_step + (1 - _DECODE_SMOOTHING) * self.decode_step_s)

    def steps_for(self, batch: list[ScheduledSequence], someone_waiting: bool,
                  row_room: Callable[[Sequence], int] | None = None) -> int:
        """How many greedy decode steps this batch may run in one call, 1 for one step. A burst runs
        only where its tokens are what single steps would give and nothing waits on it:
        - every row a decode past its first output token (that one goes out at once), with no
          speculative draft to verify this step (speculation/speculator.py), whose next
          token is chosen from the logits alone: their argmax, or a draw by temperature, top-k and
          top-p (the C call samples as sampling.sample does, at the same positions' draws); no
          penalties, bias, grammar or logprobs, and no adapter;
        - with more than one row, no row with stop strings: the C call ends a burst after a step in
          which a row's token is a stop token or EOS (the next steps would run without that row, and
          the attention splits a context by the number of rows), but a stop string shows only in
          the engine, as it appends the tokens;
        - no request waiting to be admitted (one arriving during a burst waits for its end, at
          most decode_steps steps);
        - each row's burst inside the block its next token goes to (no block is allocated or freed
          in the call), within its max_tokens and the model's length;
        - with speculative decoding (`row_room`), a batch of one row bursts no further than the
          token at which it proposes a draft again (Speculator.burst_room); a batch of several
          bursts its full length (one row's wait would cut every row's burst, which cost a batch
          of 8 SmolLM2 rows more than their drafts gained), and its rows look again after it;
        - with step_target_ms, a burst takes no longer than a step is meant to (by the measured
          decode step time; none before the first is measured), so a bigger model bursts less.
        Tokens after one that ends a request (a stop string at batch 1) are dropped by the engine,
        as the steps after it would not have run."""
        most = self.options.decode_steps or 1
        if most <= 1 or self.device.type != "cpu" or someone_waiting:
            return 1
        if self.options.step_target_ms:
            if self.decode_step_s is None:
                return 1
            most = min(most, int(self.options.step_target_ms / 1000 / self.decode_step_s))
        for item in batch:
            seq, params = item.seq, item.seq.params
            if (item.num_new_tokens != 1 or item.draft or seq.num_computed_tokens + 1 != seq.num_tokens
                    or seq.num_computed_tokens < seq.num_prompt_tokens  # its first token: not held back
                    or params.logprobs or params.adjusts_logits or seq.grammar is not None
                    or seq.adapter is not None or seq.forks or (params.stop and len(batch) > 1)):
                return 1
            position = seq.num_computed_tokens
            most = min(most, self.block_size - position % self.block_size, seq.max_tokens - len(seq.output_token_ids),
                       self.max_model_len - seq.num_tokens)
            if row_room is not None and len(batch) == 1:
                most = min(most, row_room(seq))
        return max(1, most)
