"""Turns a scheduled batch into tensors, runs the model, samples.

Rows are flattened: decode sequences first (one token each, batched attention), then prefill
chunks. Only the last row of a sequence whose tokens are now all computed is sampled.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from inferplane.worker.engine.kv.window import first_kept_block
from inferplane.worker.engine.sampling import (
    History,
    Sampled,
    SamplingParams,
    given_token_logprobs,
    sample,
    uniform_draw,
)
from inferplane.worker.engine.scheduler import ScheduledSequence
from inferplane.worker.engine.sequence import Sequence
from inferplane.worker.model.llama import LlamaForCausalLM
from inferplane.worker.ops.attention import AttentionBatch, PrefillSegment
from inferplane.worker.ops.fused_decode import BurstDraws
from inferplane.worker.ops.kv_cache import PagedKVCache


class _Pack:
    """A step's int64 lists made into tensors by one torch.tensor call (and one copy to the device)
    instead of one each: five to eight a step, and each call ran with caches the last step's
    weights had swept. The parts are views of the one tensor: contiguous, each shaped as added."""

    def __init__(self):
        self._values: list[int] = []
        self._parts: list[tuple[int, int, tuple[int, ...] | None]] = []

    def add(self, values: list[int], shape: tuple[int, ...] | None = None) -> int:
        """The index of this part in tensors()' list."""
        self._parts.append((len(self._values), len(values), shape))
        self._values.extend(values)
        return len(self._parts) - 1

    def tensors(self, to_device: Callable[[list[int]], torch.Tensor]) -> list[torch.Tensor]:
        packed = to_device(self._values)
        return [packed[at:at + n] if shape is None else packed[at:at + n].view(shape) for at, n, shape in self._parts]


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
        # on the CPU the tensor is where it goes: .to() would only add a call
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
                if item.draft:  # its proposed tokens follow, each a row: every one of them samples
                    input_ids.extend(item.draft)
                    positions.extend(range(start + 1, start + 1 + len(item.draft)))
                    sample_rows.extend(range(len(input_ids) - item.rows, len(input_ids)))
                    continue
            else:
                input_ids.extend(seq.token_slice(start, start + n))
                positions.extend(range(start, start + n))
            if start + n == seq.num_tokens:
                sample_rows.append(len(input_ids) - 1)
        pack = _Pack()
        ids_at, positions_at = pack.add(input_ids), pack.add(positions)
        main = self._attention_batch(batch, lambda seq: seq.block_table, None, pack)
        window = None
        if self.window is not None:
            window = self._attention_batch(batch, lambda seq: seq.window_table, self.window, pack)
        tensors = pack.tensors(self._to_device)
        attn = main(tensors)
        if window is not None:
            attn.window = window(tensors)
        return tensors[ids_at], tensors[positions_at], attn, sample_rows

    def _attention_batch(self, batch: list[ScheduledSequence], table_of, window: int | None,
                         pack: _Pack) -> Callable[[list[torch.Tensor]], AttentionBatch]:
        """Slots and block tables from each sequence's main table, or (with `window`) from its window
        table, each table cut to the blocks from the first one the window still reaches: the rest
        are freed (kv/window.py), and positions are counted from that block on. Their values go into
        `pack`; the returned function makes the AttentionBatch from the packed tensors."""
        bs = self.block_size
        slots: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[tuple[PrefillSegment, int | None]] = []  # each with its table's place in the pack
        row = 0
        for item in batch:
            seq, n = item.seq, item.num_new_tokens
            start = seq.num_computed_tokens
            table = table_of(seq)
            first = first_kept_block(start, window, bs) if window is not None else 0
            if n == 1:  # with a draft, a decode row per proposed token: one more position of context each
                kept = table[first:] if first else table  # read below, not kept
                for pos in range(start, start + item.rows):
                    slots.append(table[pos // bs] * bs + pos % bs)
                    decode_tables.append(kept)
                    decode_lens.append(pos + 1 - first * bs)
            else:
                slots.extend(table[pos // bs] * bs + pos % bs for pos in range(start, start + n))
                ctx = start + n
                segment = PrefillSegment(start=row, length=n, context_len=ctx, key_offset=first * bs, block_table=None)
                prefills.append((segment, None if ctx == n else pack.add(table[first:])))
            row += item.rows
        slots_at = pack.add(slots)
        width = max((len(t) for t in decode_tables), default=0)
        padded: list[int] = []
        for table in decode_tables:
            padded += table
            padded += [0] * (width - len(table))
        tables_at = pack.add(padded, (len(decode_tables), width))
        lens_at = pack.add(decode_lens)

        def finish(tensors: list[torch.Tensor]) -> AttentionBatch:
            for segment, table_at in prefills:
                if table_at is not None:
                    segment.block_table = tensors[table_at]
            attn = AttentionBatch(slot_mapping=tensors[slots_at], num_decodes=len(decode_tables),
                                  prefills=[segment for segment, _ in prefills])
            if decode_tables:
                attn.decode_block_tables = tensors[tables_at]
                attn.decode_context_lens = tensors[lens_at]
                attn.decode_max_len = max(decode_lens)
            return attn

        return finish

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
            row += item.rows
        return wanted

    def _score_prompts(self, batch: list[ScheduledSequence], hidden: torch.Tensor) -> None:
        for item, row, count in self._prompt_logprob_rows(batch):
            seq = item.seq
            first = len(seq.prompt_logprobs)
            logits = self.model.compute_logits(hidden[row:row + count])
            given = seq.prompt_token_ids[first + 1:first + 1 + count]
            seq.prompt_logprobs.extend(given_token_logprobs(logits, given, seq.params.prompt_logprobs or 0))

    def _forward(self, batch: list[ScheduledSequence], input_ids: torch.Tensor, positions: torch.Tensor,
                 attn: AttentionBatch, steps: int = 1) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The eager forward: final hidden states of every row, and the logits of every row and their
        argmax where the model's fused decode computed them (else None, None); the argmax is
        [steps run, rows] where a burst ran (forward_and_logits)."""
        if self.adapters is not None:
            self.adapters.begin([item.seq.adapter_slot for item in batch for _ in range(item.rows)])
        try:
            if steps == 1:
                return self.model.forward_and_logits(input_ids, positions, self.cache, attn)
            # a burst ends after any row's stop token: single steps would go on without that row
            stop_ids = frozenset().union(*(self._stop_ids(item.seq.params) for item in batch))
            return self.model.forward_and_logits(input_ids, positions, self.cache, attn, steps, stop_ids,
                                                 burst_draws(batch, steps))
        finally:
            if self.adapters is not None:
                self.adapters.end()

    def execute(self, batch: list[ScheduledSequence], steps: int = 1) -> Sampled:
        """The sampled token (and logprobs) for each sequence that completed its tokens, in batch order;
        a row with a draft gives one token per verified row (its `rows`), in order.
        `steps` > 1: the engine found every row a greedy decode with room for that many tokens in its
        last block (decode_bursts.py); where the fused decode runs them in one call, `bursts`
        holds each row's tokens of the steps run (fewer after a step in which a row's token is a
        stop token or EOS), else one step ran.
        Runs in inference mode, entered here only where the caller's loop does not hold it already
        (LLM.generate and AsyncEngine's loop enter it once): an entry and exit cost 45 us of a
        step that follows a batch-1 decode's sweep of the caches (SmolLM2, 2.69 -> 2.65 ms a token)."""
        if torch.is_inference_mode_enabled():
            return self._execute(batch, steps)
        with torch.inference_mode():
            return self._execute(batch, steps)

    def _execute(self, batch: list[ScheduledSequence], steps: int = 1) -> Sampled:
        input_ids, positions, attn, sample_rows = self.prepare(batch)
        if self.graphs is not None and attn.num_decodes == len(batch) and self.graphs.fits(len(batch)):
            # a decode-shaped step: replayed from the CUDA graph of its bucket
            hidden, logits = self.graphs.run(input_ids, positions, attn)
            argmax = None
        else:  # logits of every row (and their argmax) where the fused CPU decode's C call ran the head
            hidden, logits, argmax = self._forward(batch, input_ids, positions, attn, steps)
            if argmax is not None and argmax.dim() == 2:  # a burst: its tokens were chosen in its C call
                return Sampled(argmax[0].tolist(), bursts=argmax.t().tolist())
        self._score_prompts(batch, hidden)
        if not sample_rows:
            return Sampled([])
        if logits is None:
            logits = self.model.compute_logits(hidden[self._to_device(sample_rows)])
        elif len(sample_rows) < logits.shape[0]:  # a one-token prefill chunk that is not its prompt's last
            logits, argmax = logits[self._to_device(sample_rows)], None
        # Each sampled row with the output it follows: a draft's row i follows its first i tokens, and
        # is chosen as a plain step at that position would choose (speculation/speculator.py).
        rows: list[tuple[Sequence, list[int]]] = []
        for item in batch:
            seq = item.seq
            if item.draft:
                rows.extend((seq, item.draft[:i]) for i in range(item.rows))
            elif seq.num_computed_tokens + item.num_new_tokens == seq.num_tokens:
                rows.append((seq, []))
        params = [seq.params for seq, _ in rows]
        want_logprobs = any(p.logprobs for p in params)
        histories = None
        if any(p.adjusts_logits for p in params):
            histories = [History(seq.prompt_token_ids, seq.output_token_ids + ahead if ahead else seq.output_token_ids,
                                 self._stop_ids(seq.params)) for seq, ahead in rows]
        grammars = [seq.grammar for seq, _ in rows] if any(seq.grammar is not None for seq, _ in rows) else None
        uniforms = [0.0 if seq.params.greedy else uniform_draw(seq.rng_key, len(seq.output_token_ids) + len(ahead))
                    for seq, ahead in rows]
        return sample(logits, params, uniforms, want_logprobs, histories, grammars, argmax)


def burst_draws(batch: list[ScheduledSequence], steps: int) -> BurstDraws | None:
    """How a burst's sampled rows draw (None where every row is greedy): each row's filters and its
    uniform at each step's position, as single steps would draw them (sampling.uniform_draw)."""
    params = [item.seq.params for item in batch]
    if all(p.greedy for p in params):
        return None
    return BurstDraws(
        temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32),
        top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64),
        top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32),
        min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32),
        uniform=torch.tensor([[0.0 if item.seq.params.greedy else
                               uniform_draw(item.seq.rng_key, len(item.seq.output_token_ids) + s) for item in batch]
                              for s in range(steps)], dtype=torch.float64))
