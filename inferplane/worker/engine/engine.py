"""The engine: one scheduler, one model runner, one KV manager, stepped in a loop.

`Engine.step()` schedules a batch, runs it and returns what each request gained (tokens, text,
whether it finished). The offline `LLM` and the gRPC worker both drive this same loop. Its parts:
pool_sizing.py sizes the KV pools, scheduler.py picks each step's work (decode_bursts.py how many
decode steps it runs in one call), model_runner.py runs it, outputs.py appends the sampled tokens,
stats.py reports.
"""

from __future__ import annotations

import itertools
import time

import torch

from inferplane.api.kv_blocks import chain_keys, kv_namespace
from inferplane.api.priority import band_rank
from inferplane.api.tokenizer import IncrementalDetokenizer
from inferplane.worker.engine.decode_bursts import DecodeBursts
from inferplane.worker.engine.decode_graphs import DecodeGraphs
from inferplane.worker.engine.intake import RequestIntake
from inferplane.worker.engine.kv.window import WindowBlocks
from inferplane.worker.engine.kv_offload import open_tier_link
from inferplane.worker.engine.model_runner import ModelRunner
from inferplane.worker.engine.options import EngineOptions
from inferplane.worker.engine.outputs import StepOutput, TokenAppender, joined, step_output
from inferplane.worker.engine.pool_sizing import size_pools
from inferplane.worker.engine.runtimes import build_kv_manager, build_scheduler, kernel_isas
from inferplane.worker.engine.sampling import Sampled, SamplingParams
from inferplane.worker.engine.scheduler import ScheduledSequence
from inferplane.worker.engine.sequence import Sequence
from inferplane.worker.engine.speculation.speculator import Speculator, accepted_length
from inferplane.worker.engine.stats import EngineCounters, engine_stats
from inferplane.worker.model.loader import LoadedModel
from inferplane.worker.ops.kv_cache import PagedKVCache


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
        self.pools = pools = size_pools(loaded, options, device, self.kv_dtype, self.max_model_len)
        self.cache = PagedKVCache(num_blocks=pools.num_blocks, num_window_blocks=pools.num_window_blocks,
                                  scratch_block=pools.uses_graphs, **pools.cache_shape)
        windows = (WindowBlocks(pools.num_window_blocks, self.block_size, pools.window)
                   if pools.window is not None else None)
        tiers = open_tier_link(loaded, options, self.cache, dtype, self.kv_dtype)
        self.kv = build_kv_manager(options, pools.num_blocks, windows, tiers)
        self.scheduler = build_scheduler(options, self.kv)
        self.bursts = DecodeBursts(options, device, self.block_size, self.max_model_len)
        self.kernel_isas = kernel_isas(loaded.model) if device.type == "cpu" else {}
        self.eos_ids = set(config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
        self.intake = RequestIntake(loaded, self.eos_ids, self.max_model_len, self.block_size, device)
        # The same EOS set that ends a request is what min_tokens holds back.
        self.runner = ModelRunner(loaded.model, self.cache, device, eos_ids=frozenset(self.eos_ids),
                                  window=pools.window)
        self.adapters = self._adapter_slots()
        self.scheduler.adapters = self.runner.adapters = self.adapters
        if pools.uses_graphs:
            self.runner.graphs = DecodeGraphs(loaded.model, self.cache, options.max_num_seqs, self.max_model_len,
                                              pools.window)
        self.requests: dict[str, Sequence] = {}  # by each sequence's own id
        self._groups: dict[str, list[Sequence]] = {}  # request id -> its choices (n > 1), unfinished
        self._ids = itertools.count()
        self.counters = EngineCounters()
        self.outputs = TokenAppender(self.eos_ids, self.max_model_len, self.counters, self._finish)
        speculative = options.speculation()
        self.speculator = (Speculator(speculative.method, speculative.num_tokens, self.kv, self.max_model_len,
                                      device_bursts=device.type == "cpu" and (options.decode_steps or 1) > 1)
                           if speculative is not None else None)

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

    # -- requests ---------------------------------------------------------------------------------

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, cache_salt: str = "", *, tenant: str = "",
                    priority: str = "", adapter=None, resume: list[int] | None = None,
                    choice_index: int = 0) -> Sequence:
        """Queues a request (its `params.n` choices), once `RequestIntake.check` passed it. `tenant`
        and `priority` (a band name) place its sequences in flow control (fair_share.py); a bad band
        is a ValueError naming it.
        `adapter`: the lora.LoraAdapter its sequences run under (loaded and checked by the caller,
        off this thread); it takes a slot when the sequence is admitted.
        `resume`: output tokens an earlier replica already delivered (a request moved between
        workers, `RequestIntake.resume`); the request continues after them, with one choice.
        `choice_index`: with n = 1, the choice of an earlier request (n > 1) it continues: its seed
        and its outputs' index are that choice's."""
        params = params or SamplingParams()
        if resume and params.n != 1:
            raise ValueError(f"resumed_token_ids: a resumed request continues one choice (n = 1), got n = {params.n}")
        if choice_index and params.n != 1:
            raise ValueError(f"choice_index: names one choice of an earlier request (n = 1), got n = {params.n}")
        band = band_rank(priority)
        token_ids, max_tokens = self.intake.check(prompt, params, adapter, self.adapters, self.kv.num_blocks)
        request_id = request_id or self.new_request_id()
        if request_id in self._groups or request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already running")
        choices = [self.intake.sequence(request_id, choice_index + index, token_ids, params, max_tokens, cache_salt)
                   for index in range(params.n)]
        for seq in choices:
            seq.tenant, seq.band, seq.adapter = tenant, band, adapter
        detokenizers = [IncrementalDetokenizer(self.tokenizer, token_ids) if self.tokenizer is not None else None
                        for _ in choices]
        if resume:  # before anything is registered: a refusal leaves nothing behind
            self.intake.resume(choices[0], list(resume), detokenizers[0])
        if adapter is not None:
            requests = self.adapters.counters.requests
            requests[adapter.name] = requests.get(adapter.name, 0) + 1
        leader = choices[0]
        leader.forks = choices[1:]
        self._groups[request_id] = choices
        for seq, detokenizer in zip(choices, detokenizers, strict=True):
            self.requests[seq.request_id] = seq
            if detokenizer is not None:
                self.outputs.track(seq, detokenizer)
        self.scheduler.add(leader)
        self.counters.prompt_tokens += len(token_ids)
        return leader

    def kv_keys(self, tokens: list[int], cache_salt: str = "", adapter=None) -> list[bytes]:
        """The tier keys of the blocks a prefix match of `tokens` can use (every full block before
        the last token), under the request's namespace: what is read ahead from disk (`prefetch_kv`)
        and what a decode worker pulls (serve/kv_transfer.py)."""
        usable = (len(tokens) - 1) // self.block_size * self.block_size
        if usable <= 0:
            return []
        return chain_keys(kv_namespace(cache_salt, adapter.key if adapter is not None else ""), tokens[:usable],
                          self.block_size)

    def prefetch_kv(self, prompt: str | list[int], cache_salt: str = "", adapter=None) -> int:
        """Thread-safe, for the serving side to call before it hands a request over: reads the
        prompt's disk-held KV blocks into memory (kv/tiers/), so that the engine thread's prefix
        match does not wait on the disk. Returns the blocks read (0 without tiers or for a text prompt)."""
        tiers = self.kv.tiers
        if tiers is None or isinstance(prompt, str):
            return 0
        return tiers.store.prefetch(self.kv_keys(prompt, cache_salt, adapter))

    def group(self, request_id: str) -> list[Sequence]:
        """A request's unfinished choices."""
        return [seq for seq in self._groups.get(request_id, []) if not seq.is_finished]

    def abort(self, request_id: str) -> list[StepOutput]:
        """Frees the request's blocks (every choice's) at once. Returns the final output of each
        choice that was still running; empty if the request is unknown or already done."""
        outputs = []
        for seq in self.group(request_id):
            self._finish(seq, "abort")
            outputs.append(step_output(seq, [], [], ""))
        return outputs

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # -- the loop ---------------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        started = time.perf_counter()
        if self.speculator is not None:
            self.speculator.attach(plan.scheduled)
        bursts = self.bursts.steps_for(plan.scheduled, someone_waiting=bool(self.scheduler.waiting),
                                       row_room=self.speculator.burst_room if self.speculator is not None else None)
        result = self.runner.execute(plan.scheduled, bursts)
        total = sum(item.rows for item in plan.scheduled)
        prefill = sum(item.num_new_tokens for item in plan.scheduled if item.num_new_tokens > 1)
        seconds = time.perf_counter() - started
        self.scheduler.step_budget.observe(prefill, total, seconds)
        steps = len(result.bursts[0]) if result.bursts else 1
        self.counters.burst_steps += steps - 1
        self.bursts.observe(prefill, seconds, steps)
        if self.speculator is not None and not prefill:
            self.speculator.observe_step(len(plan.scheduled), total - len(plan.scheduled), seconds / steps)
        tokens, logprobs, top = result.tokens, result.logprobs, result.top
        outputs = []
        sampled = 0
        for item in plan.scheduled:
            seq = item.seq
            self._computed(seq, item.num_new_tokens)
            if seq.forks and seq.num_computed_tokens >= seq.num_prompt_tokens:
                self._fork(seq)
            if seq.num_computed_tokens < seq.num_tokens:
                continue  # a prefill chunk that is not the last one
            if result.bursts is not None:
                outputs.append(self._append_burst(seq, result.bursts[sampled]))
                sampled += 1
                continue
            if item.draft:
                outputs.append(self._append_verified(item, result, sampled))
                sampled += item.rows
                continue
            token = tokens[sampled]
            logprob = logprobs[sampled] if logprobs is not None else None
            alternatives = top[sampled] if top is not None else None
            sampled += 1
            outputs.append(self.outputs.append(seq, token, logprob, alternatives))
        return outputs

    def _computed(self, seq: Sequence, num_tokens: int) -> None:
        """`num_tokens` more positions of `seq` are in the KV cache: its tenant is charged for them
        (prompt and output apart), and its KV manager told."""
        prompt_part = max(0, min(num_tokens, seq.num_prompt_tokens - seq.num_computed_tokens))
        self.scheduler.fair.charge(seq.tenant, prompt_part, num_tokens - prompt_part)
        seq.num_computed_tokens += num_tokens
        self.kv.on_computed(seq)

    def _append_burst(self, seq: Sequence, tokens: list[int], logprobs: list[float] | None = None,
                      top: list | None = None) -> StepOutput:
        """A burst's (or a verified draft's) tokens appended one by one as single steps would append
        them (each computed position counted first), as one output; the tokens after one that ends
        the sequence are dropped (their KV lies past its end, in its own blocks)."""
        out = None
        for i, token in enumerate(tokens):
            if i:
                if seq.is_finished:
                    break
                self._computed(seq, 1)
            step = self.outputs.append(seq, token, logprobs[i] if logprobs is not None else None,
                                       top[i] if top is not None else None)
            out = step if out is None else joined(out, step)
        return out

    def _append_verified(self, item: ScheduledSequence, result: Sampled, first: int) -> StepOutput:
        """A draft's verified rows (from row `first` of the step's sampled rows): the tokens up to and
        including the first that differs from the draft, appended as single steps would append them."""
        rows = slice(first, first + item.rows)
        tokens = result.tokens[rows]
        accepted = accepted_length(item.draft, tokens)
        self.speculator.verified(item, accepted)
        kept = accepted + 1
        logprobs = result.logprobs[rows][:kept] if result.logprobs is not None else None
        top = result.top[rows][:kept] if result.top is not None else None
        return self._append_burst(item.seq, tokens[:kept], logprobs, top)

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

    def _finish(self, seq: Sequence, reason: str) -> None:
        if self.speculator is not None:
            self.speculator.finished(seq)
        seq.finish_reason = reason
        seq.finish_time = time.perf_counter()
        self.scheduler.finish(seq)
        self.requests.pop(seq.request_id, None)
        self.outputs.forget(seq)
        if not self.group(seq.group_id):
            self._groups.pop(seq.group_id, None)
        self.counters.finished[reason] = self.counters.finished.get(reason, 0) + 1

    # -- introspection ----------------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        return engine_stats(self)
