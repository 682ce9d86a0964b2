"""The offline API, shaped like vLLM's: `LLM(model).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from typing import Any

import torch

from inferplane.worker.engine.engine import Engine
from inferplane.worker.engine.options import EngineOptions
from inferplane.worker.engine.runtimes import check_runtime, prepare_weights
from inferplane.worker.engine.sampling import SamplingParams
from inferplane.worker.engine.sequence import Sequence
from inferplane.worker.model.loader import load_model


@dataclass
class RequestMetrics:
    ttft: float | None  # seconds from submission to the first generated token
    latency: float  # seconds from submission to the last token


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    metrics: RequestMetrics
    logprobs: list[float] | None = None
    # With params.top_logprobs: per token, its (token id, logprob) alternatives, best first.
    top_logprobs: list[list[tuple[int, float]]] | None = None
    num_cached_tokens: int = 0
    outputs: list = field(default_factory=list, repr=False)
    # With params.prompt_logprobs: entry i scores prompt token i + 1 (sampling.TokenLogprob).
    prompt_logprobs: list | None = None
    stop_reason: str | None = None  # the stop string that ended it (vLLM's name), else None

    def __post_init__(self) -> None:
        # vLLM users write out.outputs[0].text; one completion per prompt here.
        self.outputs = [self]


Prompt = str | list[int]


class LLM:
    def __init__(self, model: str, runtime: str = "paged", device: str = "auto", dtype: str | None = None,
                 **engine_options):
        check_runtime(runtime)
        options = EngineOptions.from_kwargs(runtime=runtime, device=device, dtype=dtype, **engine_options)
        options.validate()
        torch_device = options.resolve_device()
        torch_dtype = options.resolve_dtype(torch_device)
        max_len = options.max_model_len
        loaded = load_model(model, torch_device, torch_dtype, max_positions=max_len)
        self.weight_report = prepare_weights(options, loaded)
        self.engine = Engine(loaded, options, torch_device, torch_dtype)
        self.tokenizer = loaded.tokenizer
        self._adapters = None  # lora.AdapterCatalog, made on the first request for an adapter

    def generate(self, prompts: Prompt | SequenceABC[Prompt],
                 params: SamplingParams | SequenceABC[SamplingParams] | None = None,
                 cache_salt: str = "", lora_request=None) -> list[RequestOutput]:
        """One output per prompt, or n per prompt (in order) where its params ask for n > 1.
        `lora_request`: a lora.LoraRequest for every prompt, or one per prompt (None: the base),
        as vLLM takes it; the engine needs max_loras > 0."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params_list = [params or SamplingParams()] * len(prompts)
        else:
            params_list = list(params)
            if len(params_list) != len(prompts):
                raise ValueError(f"params: {len(params_list)} given for {len(prompts)} prompts")
        adapters = self._adapters_for(lora_request, len(prompts))
        # Validate everything before submitting anything: a bad prompt must not leave others queued.
        seqs: list[Sequence] = []
        try:
            for prompt, p, adapter in zip(prompts, params_list, adapters, strict=True):
                seqs.append(self.engine.add_request(prompt, p, cache_salt=cache_salt, adapter=adapter))
        except Exception:
            for seq in seqs:
                self.engine.abort(seq.request_id)
            raise
        choices = [self.engine.group(seq.request_id) for seq in seqs]  # n > 1: n outputs per prompt, in order
        with torch.inference_mode():  # once for every step (ModelRunner.execute)
            while self.engine.has_unfinished():
                self.engine.step()
        return [self._result(s) for group in choices for s in group]

    def _adapters_for(self, lora_request, count: int) -> list:
        """The loaded adapter of each prompt (None: the base), read through the catalog."""
        requests = lora_request if isinstance(lora_request, list | tuple) else [lora_request] * count
        if len(requests) != count:
            raise ValueError(f"lora_request: {len(requests)} given for {count} prompts")
        if all(r is None for r in requests):
            return [None] * count
        if self.engine.adapters is None:
            raise ValueError("lora_request: this engine serves no LoRA adapters; start it with max_loras > 0")
        if self._adapters is None:
            from inferplane.worker.lora.catalog import AdapterCatalog

            self._adapters = AdapterCatalog.for_engine(self.engine)
        return [None if r is None else self._adapters.get(r) for r in requests]

    def chat(self, conversations: list[dict] | list[list[dict]],
             params: SamplingParams | SequenceABC[SamplingParams] | None = None,
             cache_salt: str = "", chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Each conversation through the model's chat template, then `generate`.
        `chat_template_kwargs`: extra template variables, as vLLM's `LLM.chat` takes them (Qwen3's
        `enable_thinking=False`); the renderer's own names (messages, bos_token, ...) are refused."""
        if self.tokenizer is None:
            raise ValueError("chat: this model has no tokenizer")
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True,
                                                      template_kwargs=chat_template_kwargs)
                   for c in conversations]
        return self.generate(prompts, params, cache_salt=cache_salt)

    def stats(self) -> dict[str, float]:
        return {**self.engine.stats(), **self.weight_report}

    @staticmethod
    def _result(seq: Sequence) -> RequestOutput:
        ttft = None if seq.first_token_time is None else seq.first_token_time - seq.arrival_time
        latency = (seq.finish_time or seq.arrival_time) - seq.arrival_time
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=list(seq.output_token_ids),
            text=seq.output_text,
            finish_reason=seq.finish_reason,
            metrics=RequestMetrics(ttft=ttft, latency=latency),
            logprobs=list(seq.output_logprobs) if seq.params.logprobs else None,
            top_logprobs=list(seq.output_top_logprobs) if seq.params.logprobs and seq.params.top_logprobs else None,
            num_cached_tokens=seq.num_cached_tokens,
            prompt_logprobs=list(seq.prompt_logprobs) if seq.params.prompt_logprobs is not None else None,
            stop_reason=seq.stop_string,
        )
