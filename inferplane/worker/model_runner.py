"""Turns a scheduled batch into tensors, runs the model, samples.

Rows are flattened: decode sequences first (one token each, batched attention), then prefill
chunks. Only the last row of a sequence whose tokens are now all computed is sampled.
"""

from __future__ import annotations

import torch

from inferplane.worker.attention import AttentionBatch, PagedKVCache, PrefillSegment
from inferplane.worker.kv.window import first_kept_block
from inferplane.worker.model.llama import LlamaForCausalLM
from inferplane.worker.sampling import History, Sampled, SamplingParams, given_token_logprobs, sample
from inferplane.worker.scheduler import ScheduledSequence


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, cache: PagedKVCache, device: torch.device,
                 eos_ids: frozenset[int] = frozenset(), window: int | None = None):
        self.model = model
        self.eos_ids = eos_ids  # masked with each request's stop_token_ids until its min_tokens
        self.cache = cache
        self.block_size = cache.block_size
        self.window = window  # the sliding layers' window where their KV has its own pool (kv/window.py)
        self.device = device
        self.adapters = None  # lora.AdapterSlots where the engine serves adapters: rows are tagged per step
        self.graphs = None  # decode_graphs.DecodeGraphs where decode steps replay CUDA graphs

    def _to_device(self, values: list[int]) -> torch.Tensor:
        found = torch.tensor(values, dtype=torch.long)
        # on the CPU the tensor is where it goes: .to() would only add a call (a step makes five)
        return found if self.device.type == "cpu" else found.to(self.device, non_blocking=True)

    def prepare(self, batch: list[ScheduledSequence]):
        input_ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        for item in batch:
            seq, n = item.seq, item.num_new_tokens
            start = seq.num_computed_tokens
            if n == 1:  # a decode (the common row): no slices or ranges to build
                input_ids.append(seq.token_at(start))
                positions.append(start)
            else:
                input_ids.extend(seq.token_slice(start, start + n))
                positions.extend(range(start, start + n))
            if start + n == seq.num_tokens:
                sample_rows.append(len(input_ids) - 1)
        attn = self._attention_batch(batch, lambda seq: seq.block_table, None)
        if self.window is not None:
            attn.window = self._attention_batch(batch, lambda seq: seq.window_table, self.window)
        return self._to_device(input_ids), self._to_device(positions), attn, sample_rows

    def _attention_batch(self, batch: list[ScheduledSequence], table_of, window: int | None) -> AttentionBatch:
        """Slots and block tables from each sequence's main table, or (with `window`) from its window
        table, each table cut to the blocks from the first one the window still reaches: the rest
        are freed (kv/window.py), and positions are counted from that block on."""
        bs = self.block_size
        slots: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillSegment] = []
        row = 0
        for item in batch:
            seq, n = item.seq, item.num_new_tokens
            start = seq.num_computed_tokens
            table = table_of(seq)
            first = first_kept_block(start, window, bs) if window is not None else 0
            if n == 1:
                slots.append(table[start // bs] * bs + start % bs)
                decode_tables.append(table[first:] if first else table)  # read below, not kept
                decode_lens.append(start + 1 - first * bs)
            else:
                slots.extend(table[pos // bs] * bs + pos % bs for pos in range(start, start + n))
                ctx = start + n
                prefills.append(PrefillSegment(
                    start=row, length=n, context_len=ctx, key_offset=first * bs,
                    block_table=None if ctx == n else self._to_device(table[first:])))
            row += n
        attn = AttentionBatch(slot_mapping=self._to_device(slots), num_decodes=len(decode_tables), prefills=prefills)
        if decode_tables:
            width = max(len(t) for t in decode_tables)
            padded = [t + [0] * (width - len(t)) for t in decode_tables]
            attn.decode_block_tables = torch.tensor(padded, dtype=torch.long).to(self.device)
            attn.decode_context_lens = self._to_device(decode_lens)
            attn.decode_max_len = max(decode_lens)
        return attn

    def _stop_ids(self, params: SamplingParams) -> frozenset[int]:
        return frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids)

    @staticmethod
    def _prompt_logprob_rows(batch: list[ScheduledSequence]) -> list[tuple[ScheduledSequence, int, int]]:
        """(item, first row, count) of the rows whose logits score the next prompt token, for the
        sequences that asked for prompt logprobs and do not have them yet. Position p's logits
        score prompt token p + 1; positions scored before (a recompute after preemption) are not
        scored again. Such sequences never skip positions: the prefix cache does not serve them
        and a fork copies its leader's."""
        wanted, row = [], 0
        for item in batch:
            seq, start = item.seq, item.seq.num_computed_tokens
            if seq.wants_prompt_logprobs:
                first = len(seq.prompt_logprobs)
                end = min(start + item.num_new_tokens, seq.num_prompt_tokens - 1)
                if start > first:
                    raise AssertionError(f"{seq.request_id}: prompt positions {first}..{start} were never scored")
                if end > first:
                    wanted.append((item, row + first - start, end - first))
            row += item.num_new_tokens
        return wanted

    def _score_prompts(self, batch: list[ScheduledSequence], hidden: torch.Tensor) -> None:
        for item, row, count in self._prompt_logprob_rows(batch):
            seq = item.seq
            first = len(seq.prompt_logprobs)
            logits = self.model.compute_logits(hidden[row:row + count])
            given = seq.prompt_token_ids[first + 1:first + 1 + count]
            seq.prompt_logprobs.extend(given_token_logprobs(logits, given, seq.params.prompt_logprobs or 0))

    def _forward(self, batch: list[ScheduledSequence], input_ids: torch.Tensor, positions: torch.Tensor,
                 attn: AttentionBatch) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The eager forward: final hidden states of every row, and the logits of every row and their
        argmax where the model's fused decode computed them (else None, None)."""
        if self.adapters is not None:
            self.adapters.begin([item.seq.adapter_slot for item in batch for _ in range(item.num_new_tokens)])
        try:
            return self.model.forward_and_logits(input_ids, positions, self.cache, attn)
        finally:
            if self.adapters is not None:
                self.adapters.end()

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledSequence]) -> Sampled:
        """The sampled token (and logprobs) for each sequence that completed its tokens, in batch order."""
        input_ids, positions, attn, sample_rows = self.prepare(batch)
        if self.graphs is not None and attn.num_decodes == len(batch) and self.graphs.fits(len(batch)):
            # a decode-shaped step: replayed from the CUDA graph of its bucket
            hidden, logits = self.graphs.run(input_ids, positions, attn)
            argmax = None
        else:  # logits of every row (and their argmax) where the fused CPU decode's C call ran the head
            hidden, logits, argmax = self._forward(batch, input_ids, positions, attn)
        self._score_prompts(batch, hidden)
        if not sample_rows:
            return Sampled([])
        if logits is None:
            logits = self.model.compute_logits(hidden[self._to_device(sample_rows)])
        elif len(sample_rows) < len(batch):  # a one-token prefill chunk that is not its prompt's last
            logits, argmax = logits[self._to_device(sample_rows)], None
        sampling = [i.seq for i in batch if i.seq.num_computed_tokens + i.num_new_tokens == i.seq.num_tokens]
        want_logprobs = any(s.params.logprobs for s in sampling)
        histories = None
        if any(s.params.adjusts_logits for s in sampling):
            histories = [History(s.prompt_token_ids, s.output_token_ids, self._stop_ids(s.params)) for s in sampling]
        grammars = [s.grammar for s in sampling] if any(s.grammar is not None for s in sampling) else None
        return sample(logits, [s.params for s in sampling], [s.generator for s in sampling], want_logprobs, histories,
                      grammars, argmax)
