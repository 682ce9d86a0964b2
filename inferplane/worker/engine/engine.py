"""The engine: one scheduler, one model runner, one KV manager, stepped in a loop.

`Engine.step()` schedules a batch, runs it and returns what each request gained (tokens, text,
whether it finished). The offline `LLM` and the gRPC worker both drive this same loop.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from dataclasses import dataclass, field, replace

import torch

from inferplane.api.priority import BANDS, band_rank
from inferplane.api.tokenizer import IncrementalDetokenizer
from inferplane.worker.engine.decode_graphs import DecodeGraphs, activation_bytes
from inferplane.worker.engine.kv.block_pool import blocks_for
from inferplane.worker.engine.kv.window import WindowBlocks, window_pool_blocks
from inferplane.worker.engine.model_runner import ModelRunner
from inferplane.worker.engine.options import EngineOptions, parse_memory
from inferplane.worker.engine.runtimes import build_kv_manager, build_scheduler, kernel_isas
from inferplane.worker.engine.sampling import SamplingParams
from inferplane.worker.engine.sequence import Sequence
from inferplane.worker.model.loader import LoadedModel
from inferplane.worker.ops.kv_cache import PagedKVCache

QUEUE_STAT_PREFIX = "queue:"  # stats key queue:<running|waiting>:<band>:<tenant> -> sequences
_DECODE_SMOOTHING = 0.3  # weight of the newest decode step time in Engine.decode_step_s


@dataclass
class StepOutput:
    """What one request gained in one step."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float]
    text_delta: str
    finished: bool
    finish_reason: str | None = None
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


@dataclass
class EngineCounters:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    forked_sequences: int = 0  # n > 1 choices that got the prompt's KV by fork
    forked_shared_blocks: int = 0  # prompt blocks those forks shared instead of computing
    fork_fallbacks: int = 0  # choices that found no slot or block at fork time and were queued instead
    burst_steps: int = 0  # decode steps run inside bursts after their first (Engine._burst_steps)


class Engine:
    def __init__(self, loaded: LoadedModel, options: EngineOptions, device: torch.device, dtype: torch.dtype):
        options.validate()
        options = options.settled(device)  # what the options leave open, the runtime's preset decides
        self.loaded = loaded
        self.options = options
        self.device = device
        self.dtype = dtype
        self.kv_dtype = options.resolve_kv_cache_dtype(dtype)
        config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.max_model_len = min(options.max_model_len or config.max_position_embeddings,
                                 config.max_position_embeddings)
        self.block_size = options.block_size
        self.window_layers, self.window = self._window_layers()
        self.uses_graphs = self._uses_graphs()
        # what the graphs' pool will hold, taken from the KV budget before the pool is sized
        self.graph_reserve = (activation_bytes(loaded.model, self._cache_shape(), options.max_num_seqs)
                              if self.uses_graphs else 0)
        num_blocks, num_window_blocks = self._num_blocks()
        self.cache = PagedKVCache(num_blocks=num_blocks, num_window_blocks=num_window_blocks,
                                  scratch_block=self.uses_graphs, **self._cache_shape())
        windows = WindowBlocks(num_window_blocks, self.block_size, self.window) if self.window_layers else None
        self.kv = build_kv_manager(options, num_blocks, windows)
        self.scheduler = build_scheduler(options, self.kv)
        self.kernel_isas = kernel_isas(loaded.model) if device.type == "cpu" else {}
        self._grammars = None  # structured.GrammarCompiler, made when a request first needs it
        self._grammars_lock = threading.Lock()  # AsyncEngine's compile pool may be the first to need it
        self.eos_ids = set(config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
        # The same EOS set that ends a request is what min_tokens holds back.
        pool_window = self.window if self.window_layers else None  # the window pool's window, if there is one
        self.runner = ModelRunner(loaded.model, self.cache, device, eos_ids=frozenset(self.eos_ids), window=pool_window)
        self.adapters = self._adapter_slots()
        self.scheduler.adapters = self.runner.adapters = self.adapters
        if self.uses_graphs:
            self.runner.graphs = DecodeGraphs(loaded.model, self.cache, options.max_num_seqs, self.max_model_len,
                                              pool_window)
        self.requests: dict[str, Sequence] = {}  # by each sequence's own id
        self._groups: dict[str, list[Sequence]] = {}  # request id -> its choices (n > 1), unfinished
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._ids = itertools.count()
        self.counters = EngineCounters()
        self.decode_step_s: float | None = None  # a decode-only step's seconds, a running average

    def _uses_graphs(self) -> bool:
        """Decode steps replay CUDA graphs (decode_graphs.py) on a GPU unless enforce_eager asks
        not to, or the model has parts whose work depends on the data: LoRA adapters (rows tagged
        per step) and Mixture-of-Experts layers (rows grouped by the experts chosen) run eagerly."""
        config = self.loaded.config
        return (self.device.type == "cuda" and not self.options.enforce_eager and not self.options.max_loras
                and not any(config.is_moe_layer(i) for i in range(config.num_layers)))

    def _cache_shape(self) -> dict:
        """PagedKVCache's arguments but the block counts."""
        config = self.loaded.config
        return dict(num_layers=config.num_layers, block_size=self.block_size, num_kv_heads=config.num_kv_heads,
                    head_dim=config.head_dim, dtype=self.kv_dtype, device=self.device,
                    window_layers=self.window_layers)

    def _adapter_slots(self):
        """The LoRA adapter slots (options.max_loras of them) with every served projection wrapped,
        or None where the engine serves no adapters."""
        if not self.options.max_loras:
            return None
        from inferplane.worker import lora

        slots = lora.AdapterSlots(self.loaded.config, self.options.max_loras, self.options.max_lora_rank,
                                  self.device, self.dtype, getattr(self.loaded.model, "smoothing", None))
        lora.install(self.loaded.model, slots)
        return slots

    def _window_layers(self) -> tuple[frozenset[int], int | None]:
        """The sliding-window layers whose window is shorter than the context, and that window: their
        KV goes to the window pool, where each sequence holds one window (kv/window.py)."""
        config = self.loaded.config
        window = config.sliding_window
        if window is None or window >= self.max_model_len:
            return frozenset(), None
        return frozenset(i for i in range(config.num_layers) if config.layer_window(i) is not None), window

    def kv_block_bytes(self) -> tuple[int, int]:
        """Bytes of one block of the main pool (every layer but the window ones) and of the window pool."""
        config = self.loaded.config
        num_window = len(self.window_layers)
        return tuple(PagedKVCache.bytes_per_block(layers, self.block_size, config.num_kv_heads, config.head_dim,
                                                  self.kv_dtype)
                     for layers in (config.num_layers - num_window, num_window))

    def _num_blocks(self) -> tuple[int, int]:
        """Blocks of the main pool and of the window pool (0 without window layers).

        The window pool gets what `window_pool_blocks` proves enough for max_num_seqs sequences (it
        can never bind before the main pool then), or as many blocks as the main pool where that is
        fewer; the main pool gets the rest of the memory budget."""
        num_window = len(self.window_layers)
        per_full, per_window = self.kv_block_bytes()
        window_need = (window_pool_blocks(self.window, self.block_size, self.options.max_num_seqs,
                                          self.options.max_num_batched_tokens) if num_window else 0)
        # No point in more blocks than every sequence slot could fill at full context.
        cap = blocks_for(self.max_model_len, self.block_size) * self.options.max_num_seqs
        if self.options.num_kv_blocks is not None:
            num_blocks = int(self.options.num_kv_blocks)
            return num_blocks, min(num_blocks + 1, window_need)
        amount = parse_memory(self.options.kv_cache_memory)
        if isinstance(amount, float):
            if self.device.type != "cuda":
                raise ValueError("kv_cache_memory: a fraction of free memory needs a GPU; give bytes (e.g. 1GiB)")
            free, _ = torch.cuda.mem_get_info(self.device)
            amount = int(free * amount) - self.graph_reserve
        if not num_window:
            return max(1, min(amount // per_full, cap)), 0
        if not per_full:  # every layer slides: the main pool only counts blocks, it holds nothing
            return cap, max(2, min(amount // per_window, window_need))
        num_blocks = min((amount - window_need * per_window) // per_full, cap)
        if num_blocks + 1 < window_need:  # a small budget: as many window blocks as main ones
            num_blocks = min(amount // (per_full + per_window), cap)
            return max(1, num_blocks), max(1, num_blocks) + 1
        return num_blocks, window_need

    # -- requests ---------------------------------------------------------------------------------

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

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
            if self._grammars is None:
                from inferplane.worker.structured import GrammarCompiler

                self._grammars = GrammarCompiler(self.tokenizer, self.loaded.config.vocab_size, sorted(self.eos_ids))
            return self._grammars

    def _grammar_state(self, constraint):
        """A grammar state for a structured-output request: from the grammar AsyncEngine compiled
        (GrammarCompiler.prepare) before handing the request here, else compiled now (LLM)."""
        return self.grammar_compiler().new_state(constraint)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, cache_salt: str = "", *, tenant: str = "",
                    priority: str = "", adapter=None) -> Sequence:
        """Queues a request (its `params.n` choices). `tenant` and `priority` (a band name) place
        its sequences in flow control (fair_share.py); a bad band is a ValueError naming it.
        `adapter`: the lora.LoraAdapter its sequences run under (loaded and checked by the caller,
        off this thread); it takes a slot when the sequence is admitted."""
        params = params or SamplingParams()
        band = band_rank(priority)
        if adapter is not None:
            if self.adapters is None:
                raise ValueError("model: this replica serves no LoRA adapters (max_loras is 0)")
            if adapter.rank > self.adapters.max_rank:
                raise ValueError(f"model: adapter {adapter.name!r} has rank {adapter.rank}, above this replica's "
                                 f"max_lora_rank {self.adapters.max_rank}")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            token_ids = self.tokenize(prompt)
        else:
            token_ids = [int(t) for t in prompt]
            vocab = self.loaded.config.vocab_size
            bad = [t for t in token_ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt: token id {bad[0]} is outside the vocabulary (size {vocab})")
        max_tokens = params.validate(len(token_ids), self.max_model_len)
        params.check_vocab(self.loaded.config.vocab_size)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer; use stop_token_ids")
        needed = blocks_for(len(token_ids) + max_tokens, self.block_size)
        if needed > self.kv.num_blocks:
            raise ValueError(
                f"max_tokens: prompt ({len(token_ids)} tokens) + max_tokens ({max_tokens}) needs {needed} KV "
                f"blocks but the pool has {self.kv.num_blocks}; lower max_tokens or raise kv_cache_memory"
            )
        request_id = request_id or self.new_request_id()
        if request_id in self._groups or request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already running")
        choices = [self._new_sequence(request_id, index, token_ids, params, max_tokens, cache_salt)
                   for index in range(params.n)]
        for seq in choices:
            seq.tenant, seq.band, seq.adapter = tenant, band, adapter
        if adapter is not None:
            requests = self.adapters.counters.requests
            requests[adapter.name] = requests.get(adapter.name, 0) + 1
        leader = choices[0]
        leader.forks = choices[1:]
        self._groups[request_id] = choices
        for seq in choices:
            self.requests[seq.request_id] = seq
            if self.tokenizer is not None:
                self._detok[seq.request_id] = IncrementalDetokenizer(self.tokenizer, token_ids)
        self.scheduler.add(leader)
        self.counters.prompt_tokens += len(token_ids)
        return leader

    def _new_sequence(self, request_id: str, index: int, token_ids: list[int], params: SamplingParams,
                      max_tokens: int, cache_salt: str) -> Sequence:
        """Choice `index` of a request. With a seed, choice i samples with seed + i (vLLM's rule),
        so that the choices differ and each is reproducible."""
        generator = torch.Generator(device=self.device)
        seed = params.seed + index if params.seed is not None else random.getrandbits(63)
        generator.manual_seed(seed % (1 << 64))
        grammar = self._grammar_state(params.constraint) if params.constraint is not None else None
        return Sequence(request_id=request_id if index == 0 else f"{request_id}#{index}", group_id=request_id,
                        index=index, prompt_token_ids=token_ids, params=params, max_tokens=max_tokens,
                        generator=generator, cache_salt=cache_salt, grammar=grammar)

    def group(self, request_id: str) -> list[Sequence]:
        """A request's unfinished choices."""
        return [seq for seq in self._groups.get(request_id, []) if not seq.is_finished]

    def abort(self, request_id: str) -> list[StepOutput]:
        """Frees the request's blocks (every choice's) at once. Returns the final output of each
        choice that was still running; empty if the request is unknown or already done."""
        outputs = []
        for seq in self.group(request_id):
            self._finish(seq, "abort")
            outputs.append(self._output(seq, [], [], ""))
        return outputs

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # -- the loop ---------------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        started = time.perf_counter()
        result = self.runner.execute(plan.scheduled, self._burst_steps(plan.scheduled))
        total = sum(item.num_new_tokens for item in plan.scheduled)
        prefill = sum(item.num_new_tokens for item in plan.scheduled if item.num_new_tokens > 1)
        seconds = time.perf_counter() - started
        self.scheduler.step_budget.observe(prefill, total, seconds)
        steps = len(result.bursts[0]) if result.bursts else 1
        self.counters.burst_steps += steps - 1
        if prefill == 0:  # what one decode step costs: how long a burst may hold the engine
            per_step = seconds / steps
            self.decode_step_s = per_step if self.decode_step_s is None else (
                _DECODE_SMOOTHING * per_step + (1 - _DECODE_SMOOTHING) * self.decode_step_s)
        tokens, logprobs, top = result.tokens, result.logprobs, result.top
        outputs = []
        sampled = 0
        for item in plan.scheduled:
            seq = item.seq
            prompt_part = max(0, min(item.num_new_tokens, seq.num_prompt_tokens - seq.num_computed_tokens))
            self.scheduler.fair.charge(seq.tenant, prompt_part, item.num_new_tokens - prompt_part)
            seq.num_computed_tokens += item.num_new_tokens
            self.kv.on_computed(seq)
            if seq.forks and seq.num_computed_tokens >= seq.num_prompt_tokens:
                self._fork(seq)
            if seq.num_computed_tokens < seq.num_tokens:
                continue  # a prefill chunk that is not the last one
            if result.bursts is not None:
                outputs.append(self._append_burst(seq, result.bursts[sampled]))
                sampled += 1
                continue
            token = tokens[sampled]
            logprob = logprobs[sampled] if logprobs is not None else None
            alternatives = top[sampled] if top is not None else None
            sampled += 1
            outputs.append(self._append_token(seq, token, logprob, alternatives))
        return outputs

    def _burst_steps(self, batch: list) -> int:
        """How many greedy decode steps this batch may run in one call (ModelRunner.execute), 1 for
        one step. Why: on the CPU a batch-1 step's Python (scheduling, the step's inputs, appending
        the token) cost 0.27-0.33 ms of SmolLM2's 2.5 ms step; a burst pays it once, as vLLM's
        multi-step scheduling does. A burst runs only where its tokens are what single steps would
        give and nothing waits on it:
        - every row a decode past its first output token (that one goes out at once) whose next
          token is the argmax of the logits (greedy, no penalties, bias, grammar or logprobs) and
          whose request serves no adapter;
        - with more than one row, no row with stop strings: the C call ends a burst after a step in
          which a row's token is a stop token or EOS (the next steps would run without that row, and
          the attention splits a context by the number of rows), but a stop string shows only here;
        - no request waiting to be admitted (one arriving during a burst waits for its end, at
          most decode_steps steps);
        - each row's burst inside the block its next token goes to (no block is allocated or freed
          in the call), within its max_tokens and the model's length;
        - with step_target_ms, a burst takes no longer than a step is meant to (by the measured
          decode step time; none before the first is measured), so a bigger model bursts less.
        Tokens after one that ends a request (a stop string at batch 1) are dropped by
        _append_burst, as the steps after it would not have run."""
        most = self.options.decode_steps or 1
        if most <= 1 or self.device.type != "cpu" or self.scheduler.waiting:
            return 1
        if self.options.step_target_ms:
            if self.decode_step_s is None:
                return 1
            most = min(most, int(self.options.step_target_ms / 1000 / self.decode_step_s))
        for item in batch:
            seq, params = item.seq, item.seq.params
            if (item.num_new_tokens != 1 or seq.num_computed_tokens + 1 != seq.num_tokens
                    or seq.num_computed_tokens < seq.num_prompt_tokens  # its first token: not held back
                    or not params.greedy or params.logprobs or params.adjusts_logits or seq.grammar is not None
                    or seq.adapter is not None or seq.forks or (params.stop and len(batch) > 1)):
                return 1
            position = seq.num_computed_tokens
            most = min(most, self.block_size - position % self.block_size, seq.max_tokens - len(seq.output_token_ids),
                       self.max_model_len - seq.num_tokens)
        return max(1, most)

    def _append_burst(self, seq: Sequence, tokens: list[int]) -> StepOutput:
        """A burst's tokens appended one by one as single steps would append them (each computed
        position counted, the KV manager told, the tenant charged), as one output; the tokens after
        one that ends the sequence are dropped (their KV lies past its end, in its own last block)."""
        out = self._append_token(seq, tokens[0], None)
        for token in tokens[1:]:
            if seq.is_finished:
                break
            seq.num_computed_tokens += 1
            self.kv.on_computed(seq)
            self.scheduler.fair.charge(seq.tenant, 0, 1)
            more = self._append_token(seq, token, None)
            out = replace(more, new_token_ids=out.new_token_ids + more.new_token_ids,
                          text_delta=out.text_delta + more.text_delta,
                          prompt_logprobs=out.prompt_logprobs or more.prompt_logprobs)
        return out

    def _fork(self, leader: Sequence) -> None:
        """Gives the leader's other choices its prompt KV (n > 1): whole blocks shared, the partly
        filled one copied; each then computes only the last prompt token and samples on its own.
        A choice that finds no free slot or block is queued instead, and computes its prompt like
        any request (the radix runtime still finds it in the prefix cache)."""
        for child in leader.forks:
            if child.is_finished:
                continue
            child.prompt_logprobs = list(leader.prompt_logprobs)  # the same prompt: scored once
            copies = None
            if self.scheduler.may_fork(child):  # a free slot, and not one another tenant is owed
                copies = self.kv.fork(leader, child)
            if copies is None:
                self.scheduler.add(child)
                self.counters.fork_fallbacks += 1
                continue
            for copy in copies:
                self.cache.copy_block(copy.source, copy.destination, copy.window)
            self.scheduler.admit_forked(child)
            self.counters.forked_sequences += 1
            self.counters.forked_shared_blocks += len(child.block_table) - sum(not c.window for c in copies)
        leader.forks = []

    def _append_token(self, seq: Sequence, token: int, logprob: float | None,
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
        detok = self._detok.get(seq.request_id)
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
                out = self._output(seq, [], [], "")
                out.num_output_tokens -= 1
                out.error = error
                return out
            if not stop_token and seq.grammar.is_terminated():
                reason = "stop"  # the document is complete: no need to spend a step on EOS
        if stop_token:
            reason, delta = "stop", ""
        elif delta and seq.params.stop:
            delta, hit = self._cut_at_stop(seq, delta)
            if hit:
                reason = "stop"
        else:
            seq.output_text += delta
        if reason is None and (len(seq.output_token_ids) >= seq.max_tokens or seq.num_tokens >= self.max_model_len):
            reason = "length"
        if reason is not None:
            self._finish(seq, reason)
        if stop_token:
            out = self._output(seq, [], [], "")
            out.num_output_tokens -= 1
            return out
        out = self._output(seq, [token], new_logprobs, delta)
        if new_logprobs and seq.params.top_logprobs:
            out.new_top_logprobs = [alternatives or []]
        return out

    def _cut_at_stop(self, seq: Sequence, delta: str) -> tuple[str, bool]:
        """Appends delta to the output text unless a stop string completes in it; the stop string
        and what follows are not returned (vLLM's default)."""
        before = len(seq.output_text)
        text = seq.output_text + delta
        window = max(len(s) for s in seq.params.stop) + len(delta)
        search_from = max(0, len(text) - window)
        cut = None
        for stop in seq.params.stop:
            idx = text.find(stop, search_from)
            if idx != -1 and (cut is None or idx < cut):
                cut = idx
        if cut is None:
            seq.output_text = text
            return delta, False
        seq.output_text = text[:cut]
        return seq.output_text[before:], True

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        seq.finish_time = time.perf_counter()
        self.scheduler.finish(seq)
        self.requests.pop(seq.request_id, None)
        self._detok.pop(seq.request_id, None)
        if not self.group(seq.group_id):
            self._groups.pop(seq.group_id, None)
        self.counters.finished[reason] = self.counters.finished.get(reason, 0) + 1

    def _output(self, seq: Sequence, tokens: list[int], logprobs: list[float], delta: str) -> StepOutput:
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
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=len(seq.output_token_ids),
            num_cached_tokens=seq.num_cached_tokens,
            ttft=ttft,
            latency=latency,
        )

    # -- introspection ----------------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        stats: dict[str, float] = dict(self.kv.stats())
        stats.update(
            preemptions=self.scheduler.num_preemptions,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            prompt_tokens_total=self.counters.prompt_tokens,
            generation_tokens_total=self.counters.generation_tokens,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            max_num_seqs=self.options.max_num_seqs,  # the slots an autoscaler measures concurrency against
            forked_sequences=self.counters.forked_sequences,
            forked_shared_blocks=self.counters.forked_shared_blocks,
            fork_fallbacks=self.counters.fork_fallbacks,
            decode_burst_steps_total=self.counters.burst_steps,
            blocks_allocated_total=self.kv.pool.allocations,
            kv_cache_bytes=self.cache.nbytes(),
            cuda_graph_steps=self.runner.graphs.replays if self.runner.graphs is not None else 0,
            cuda_graph_reserve_bytes=self.graph_reserve,  # taken from the KV budget for the graphs' pool
            fair_share_preemptions=self.scheduler.fair.preemptions,
        )
        # Per tenant and band: what flow control is doing (worker/serve/metrics.py labels these).
        for (state, tenant, band), count in self.scheduler.tenant_queues().items():
            stats[f"{QUEUE_STAT_PREFIX}{state}:{BANDS[band]}:{tenant}"] = float(count)
        if self.adapters is not None:
            stats.update(self.adapters.stats())
            # waiting for a slot: counted in num_waiting too, so the autoscaler's saturation sees them
            stats["lora_waiting"] = float(sum(1 for s in self.scheduler.waiting if s.adapter is not None
                                              and self.adapters.slot_of(s.adapter.key) is None))
        if self.device.type == "cpu":  # which jobs run on the C kernels (and which ISA), which on PyTorch ops
            stats["native_kernels"] = float(sum(isa != "torch" for isa in self.kernel_isas.values()))
            stats.update({f"native_kernel:{name}:{isa}": 1.0 for name, isa in self.kernel_isas.items()})
        return stats
