"""What a step's sampled tokens do to their requests, and what each request is told.

`TokenAppender.append` adds one sampled token to its sequence and decides whether it ends the
request: a stop token (EOS or one of stop_token_ids), a stop string in the text, a grammar that is
complete or that the token broke, max_tokens or the model's length. It detokenizes incrementally
and returns the `StepOutput` the caller (LLM, AsyncEngine, the gRPC worker) streams.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from inferplane.api.tokenizer import IncrementalDetokenizer
from inferplane.worker.engine.sequence import Sequence
from inferplane.worker.engine.stats import EngineCounters
from inferplane.worker.engine.stop_strings import cut_at_stop


@dataclass
class StepOutput:
    """What one request gained in one step."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float]
    text_delta: str
    finished: bool
    finish_reason: str | None = None
    stop_string: str | None = None  # on the finished output, when a stop string ended it
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    ttft: float | None = None  # seconds, on the finished output
    latency: float | None = None  # seconds from arrival to finish, on the finished output
    new_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # per new token
    index: int = 0  # the choice (n > 1); request_id is the request's, shared by its choices
    prompt_logprobs: list | None = None  # params.prompt_logprobs: on the first output (sampling.TokenLogprob)
    # finish_reason "error": why, one line naming the request field (a structured output the grammar
    # engine gave up on); the worker answers it as an error, not as a finished answer.
    error: str | None = None


class TokenAppender:
    """Appends sampled tokens to sequences; `finish(seq, reason)` is the engine's, which takes a
    sequence that ended out of the scheduler and its books (and calls `forget` here)."""

    def __init__(self, eos_ids: set[int], max_model_len: int, counters: EngineCounters,
                 finish: Callable[[Sequence, str], None]):
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len
        self.counters = counters
        self._finish = finish
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}  # by sequence id; none without a tokenizer

    def track(self, seq: Sequence, detokenizer: IncrementalDetokenizer) -> None:
        """Detokenizes `seq`'s output from now on."""
        self._detokenizers[seq.request_id] = detokenizer

    def forget(self, seq: Sequence) -> None:
        self._detokenizers.pop(seq.request_id, None)

    def append(self, seq: Sequence, token: int, logprob: float | None,
               alternatives: list[tuple[int, float]] | None = None) -> StepOutput:
        now = time.perf_counter()
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.output_token_ids.append(token)
        self.counters.generation_tokens += 1
        new_logprobs = []
        if seq.params.logprobs and logprob is not None:
            seq.output_logprobs.append(logprob)
            new_logprobs = [logprob]
            if seq.params.top_logprobs:
                seq.output_top_logprobs.append(alternatives or [])
        delta = ""
        detok = self._detokenizers.get(seq.request_id)
        if detok is not None:
            delta = detok.add(token)
        reason = None
        # A stop token (EOS, or one of stop_token_ids) ends the request and, as with OpenAI and
        # vLLM, is not part of the answer: no text, no logprob, not a completion token.
        stop_token = token in seq.params.stop_token_ids or (not seq.params.ignore_eos and token in self.eos_ids)
        if seq.grammar is not None:
            # A grammar that gave up (a fuel bound, an empty mask) or refused the token means the
            # output breaks the constraint: an error, never a "stop" with text that does not match.
            error = seq.grammar.failure
            if error is None and not stop_token and not seq.grammar.accept(token):
                error = seq.grammar.refusal(token)
            if error is not None:
                self._finish(seq, "error")
                out = step_output(seq, [], [], "")
                out.num_output_tokens -= 1
                out.error = error
                return out
            if not stop_token and seq.grammar.is_terminated():
                reason = "stop"  # the document is complete: no need to spend a step on EOS
        hit = False
        if stop_token:
            reason, delta = "stop", ""
        elif seq.params.stop:
            delta, hit = cut_at_stop(seq, delta)
            if hit:
                reason = "stop"
        else:
            seq.output_text += delta
        if reason is None and (len(seq.output_token_ids) >= seq.max_tokens or seq.num_tokens >= self.max_model_len):
            reason = "length"
        if reason is not None:
            if seq.params.stop and not hit:  # ended otherwise: the text held back for a stop string goes out
                delta += seq.output_text[seq.text_sent:]
                seq.text_sent = len(seq.output_text)
            self._finish(seq, reason)
        if stop_token:
            out = step_output(seq, [], [], "")
            out.num_output_tokens -= 1
            return out
        out = step_output(seq, [token], new_logprobs, delta)
        if new_logprobs and seq.params.top_logprobs:
            out.new_top_logprobs = [alternatives or []]
        return out


def step_output(seq: Sequence, tokens: list[int], logprobs: list[float], delta: str) -> StepOutput:
    """What `seq` gained: `tokens` and their text; its timings once it finished, and its prompt's
    logprobs with its first output."""
    ttft = latency = None
    if seq.is_finished:
        latency = seq.finish_time - seq.arrival_time
        if seq.first_token_time is not None:
            ttft = seq.first_token_time - seq.arrival_time
    prompt_logprobs = None
    if seq.params.prompt_logprobs is not None and not seq.prompt_logprobs_sent and seq.output_token_ids:
        prompt_logprobs, seq.prompt_logprobs_sent = seq.prompt_logprobs, True
    return StepOutput(
        request_id=seq.group_id,
        index=seq.index,
        prompt_logprobs=prompt_logprobs,
        new_token_ids=tokens,
        new_logprobs=logprobs,
        text_delta=delta,
        finished=seq.is_finished,
        finish_reason=seq.finish_reason,
        stop_string=seq.stop_string if seq.is_finished else None,
        num_prompt_tokens=seq.num_prompt_tokens,
        num_output_tokens=len(seq.output_token_ids),
        num_cached_tokens=seq.num_cached_tokens,
        ttft=ttft,
        latency=latency,
    )


def joined(first: StepOutput, then: StepOutput) -> StepOutput:
    """Two outputs of one sequence as one (a burst's steps, a verified draft's tokens): the later
    one's state, both's tokens and their logprobs."""
    return replace(then, new_token_ids=first.new_token_ids + then.new_token_ids,
                   text_delta=first.text_delta + then.text_delta,
                   new_logprobs=first.new_logprobs + then.new_logprobs,
                   new_top_logprobs=first.new_top_logprobs + then.new_top_logprobs,
                   prompt_logprobs=first.prompt_logprobs or then.prompt_logprobs)
