"""A request on its way in: what the caller sent (a prompt, SamplingParams, an adapter) checked and
turned into the request's sequences, one per choice (n > 1), before anything is queued.

Every refusal is a ValueError that names the request field at fault, so the worker answers it as
the caller's mistake; a request that passes here runs to the end unless aborted.
"""

from __future__ import annotations

import random
import threading

import torch

from inferplane.api.tokenizer import IncrementalDetokenizer
from inferplane.worker.engine.kv.block_pool import blocks_for
from inferplane.worker.engine.sampling import SamplingParams
from inferplane.worker.engine.sequence import Sequence
from inferplane.worker.engine.stop_strings import held_back
from inferplane.worker.model.loader import LoadedModel


class RequestIntake:
    def __init__(self, loaded: LoadedModel, eos_ids: set[int], max_model_len: int, block_size: int,
                 device: torch.device):
        self.tokenizer = loaded.tokenizer
        self.vocab_size = loaded.config.vocab_size
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.device = device
        self.grammars = None  # structured.GrammarCompiler, made when a request first needs it
        self._grammars_lock = threading.Lock()  # AsyncEngine's compile pool may be the first to need it

    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("prompt: this model has no tokenizer; send token ids")
        return self.tokenizer.encode(prompt)

    def grammar_compiler(self):
        """The structured-output compiler (built on first use: a worker that never serves one never
        loads the grammar engine). Thread-safe: AsyncEngine compiles on its own pool, off this thread."""
        if self.tokenizer is None:
            raise ValueError("response_format: structured outputs need the model's tokenizer")
        with self._grammars_lock:
            if self.grammars is None:
                from inferplane.worker.structured import GrammarCompiler

                self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, sorted(self.eos_ids))
            return self.grammars

    def check(self, prompt: str | list[int], params: SamplingParams, adapter, adapters,
              kv_blocks: int) -> tuple[list[int], int]:
        """The prompt's token ids and the request's effective max_tokens, once the request is one
        this engine can serve: its adapter fits a slot (`adapters`: the engine's lora.AdapterSlots,
        or None), its prompt is in the vocabulary, its parameters are valid, and prompt plus
        max_tokens fit the KV pool (`kv_blocks`) even alone."""
        if adapter is not None:
            if adapters is None:
                raise ValueError("model: this replica serves no LoRA adapters (max_loras is 0)")
            if adapter.rank > adapters.max_rank:
                raise ValueError(f"model: adapter {adapter.name!r} has rank {adapter.rank}, above this replica's "
                                 f"max_lora_rank {adapters.max_rank}")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            token_ids = self.tokenize(prompt)
        else:
            token_ids = [int(t) for t in prompt]
            bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt: token id {bad[0]} is outside the vocabulary (size {self.vocab_size})")
        max_tokens = params.validate(len(token_ids), self.max_model_len)
        params.check_vocab(self.vocab_size)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer; use stop_token_ids")
        needed = blocks_for(len(token_ids) + max_tokens, self.block_size)
        if needed > kv_blocks:
            raise ValueError(
                f"max_tokens: prompt ({len(token_ids)} tokens) + max_tokens ({max_tokens}) needs {needed} KV "
                f"blocks but the pool has {kv_blocks}; lower max_tokens or raise kv_cache_memory"
            )
        return token_ids, max_tokens

    def sequence(self, request_id: str, index: int, token_ids: list[int], params: SamplingParams,
                 max_tokens: int, cache_salt: str) -> Sequence:
        """Choice `index` of a request. With a seed, choice i samples with seed + i (vLLM's rule),
        so that the choices differ and each is reproducible. A structured-output request's grammar
        state comes from the grammar AsyncEngine compiled (GrammarCompiler.prepare) before handing
        the request to the engine, else it is compiled now (LLM)."""
        seed = params.seed + index if params.seed is not None else random.getrandbits(64)
        grammar = self.grammar_compiler().new_state(params.constraint) if params.constraint is not None else None
        return Sequence(request_id=request_id if index == 0 else f"{request_id}#{index}", group_id=request_id,
                        index=index, prompt_token_ids=token_ids, params=params, max_tokens=max_tokens,
                        rng_key=seed % (1 << 64), cache_salt=cache_salt, grammar=grammar)

    def resume(self, seq: Sequence, resumed: list[int], detokenizer: IncrementalDetokenizer | None) -> None:
        """Continues `seq` after output tokens an earlier replica already delivered (a request moved
        between workers): they become its output as if it had produced them, so max_tokens,
        penalties, stop strings and the grammar see them, and its first new token is the one the
        earlier replica would have produced next. The KV of prompt and resumed tokens is computed
        (or found cached) as a preempted sequence's is. A sampled request's next draw is the one at
        its next position (sampling.uniform_draw), so a seeded request continues its sequence of
        draws as if uninterrupted. Resumed tokens' logprobs were delivered already: placeholders
        keep the lists aligned."""
        bad = [t for t in resumed if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"resumed_token_ids: token id {bad[0]} is outside the vocabulary (size {self.vocab_size})")
        if len(resumed) >= seq.max_tokens:
            raise ValueError(f"resumed_token_ids: {len(resumed)} tokens leave nothing of max_tokens ({seq.max_tokens})")
        if seq.grammar is not None:
            for token in resumed:
                if not seq.grammar.accept(token):
                    raise ValueError("resumed_token_ids: the structured output's grammar refuses them")
        seq.output_token_ids = list(resumed)
        if seq.params.logprobs:
            seq.output_logprobs = [0.0] * len(resumed)
            if seq.params.top_logprobs:
                seq.output_top_logprobs = [[] for _ in resumed]
        if detokenizer is not None:
            for token in resumed:
                detokenizer.add(token)  # the same state the earlier replica's detokenizer reached
            seq.output_text = detokenizer.text
            if seq.params.stop:  # what the earlier replica held back, as it did: it goes out from here
                seq.text_sent = len(seq.output_text) - held_back(seq.output_text, seq.params.stop)
