"""The quality gate: how much int8 weights change a model's predictions on a fixed text.

Figures, over the same token windows for both models: perplexity of each, its relative rise, how
often their top-1 next tokens agree, and the mean KL(float32 || int8) of the next-token
distributions. Windows are scored independently (fresh KV cache each), so memory stays bounded
however long the text is; and logits are made and scored `GATE_ROWS` positions at a time, so the
vocabulary does not multiply it either: the start-up gate keeps the float model's final hidden
states (a window's [T, hidden]) and its head, not its logits. Whole windows' logits took Gemma 3
270M's start (262,144-token vocabulary) from 4.0 to 7.0 GiB: 512 positions' logits are 512 MiB,
and scoring them made six such tensors at once.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from importlib import resources

import torch
import torch.nn.functional as F

from inferplane.worker.ops.attention import AttentionBatch, PrefillSegment
from inferplane.worker.ops.kv_cache import PagedKVCache

DEFAULT_THRESHOLD_PCT = 2.0
# The slice a worker scores at start-up (two windows; ~2 s for SmolLM2 on AVX-512, once per model file
# thanks to the start-up cache). 256 tokens were too few: float rounding alone (one CPU's kernels
# against another's) moved the rise between -0.5% and +2.0% there, against 0.9-1.2% at 1024.
STARTUP_TOKENS = 1024
DEFAULT_WINDOW = 512
# Positions whose logits exist at once while scoring: [64, vocab] float32 is 64 MiB for a 262k vocabulary.
GATE_ROWS = 64


def load_eval_text() -> str:
    """The evaluation text without its header (the '#' lines before the first blank line)."""
    raw = resources.files("inferplane.worker.quant").joinpath("data/eval_text.txt").read_text("utf-8")
    lines = raw.splitlines(keepends=True)
    i = 0
    while i < len(lines) and lines[i].startswith("#"):
        i += 1
    while i < len(lines) and not lines[i].strip():
        i += 1
    return "".join(lines[i:])


def windows(token_ids: list[int], window: int) -> list[list[int]]:
    """Non-overlapping windows of at least two tokens (one predicts the other)."""
    out = [token_ids[i : i + window] for i in range(0, len(token_ids), window)]
    return [w for w in out if len(w) >= 2]


@torch.inference_mode()
def sequence_logits(model, token_ids: list[int], block_size: int = 16) -> torch.Tensor:
    """Float32 logits [T, vocab] for every position of one sequence, through the model's own paged
    forward: one prefill segment over a KV cache just big enough for it."""
    return model.compute_logits(sequence_hidden(model, token_ids, block_size)).float()


@torch.inference_mode()
def sequence_hidden(model, token_ids: list[int], block_size: int = 16) -> torch.Tensor:
    """The final hidden states [T, hidden] of one sequence (what the head turns into logits)."""
    device = next(model.parameters()).device
    config = model.config
    t = len(token_ids)
    num_blocks = -(-t // block_size)
    cache = PagedKVCache(config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim,
                         next(model.parameters()).dtype, device)
    positions = torch.arange(t, device=device)
    batch = AttentionBatch(
        slot_mapping=positions.clone(),
        prefills=[PrefillSegment(start=0, length=t, context_len=t,
                                 block_table=torch.arange(num_blocks, device=device))],
    )
    return model(torch.tensor(token_ids, device=device), positions, cache, batch)


class Reference:
    """The float model's side of the start-up gate, kept while the model is converted in place:
    each window's final hidden states and the float head (the module object, which conversion
    replaces in the model but not here; a tied head's weight is the embedding, which stays)."""

    @torch.inference_mode()
    def __init__(self, model, token_ids: list[int], window: int = DEFAULT_WINDOW) -> None:
        self.windows = [(ids, sequence_hidden(model, ids)) for ids in windows(token_ids, window)]
        self.head = model.lm_head
        self.softcap = model.config.final_logit_softcap

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.head.weight, self.head.bias).float()
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    @torch.inference_mode()
    def score(self, candidate, threshold_pct: float = DEFAULT_THRESHOLD_PCT) -> GateResult:
        """The gate's figures for `candidate` (the converted model) on the same windows."""
        acc = GateAccumulator()
        for ids, hidden in self.windows:
            cand_hidden = sequence_hidden(candidate, ids)
            targets = ids[1:]
            for start in range(0, len(targets), GATE_ROWS):
                rows = slice(start, min(start + GATE_ROWS, len(targets)))
                acc.add_rows(self.logits(hidden[rows]), candidate.compute_logits(cand_hidden[rows]).float(),
                             targets[rows])
        return acc.result(threshold_pct)


@dataclass
class GateResult:
    tokens: int
    ppl_float32: float
    ppl_int8: float
    ppl_rise_pct: float
    top1_agreement: float
    kl_mean: float
    threshold_pct: float

    @property
    def passed(self) -> bool:
        return self.ppl_rise_pct <= self.threshold_pct

    def figures(self, prefix: str = "gate_") -> dict[str, float]:
        return {prefix + k: float(v) for k, v in asdict(self).items()}

    def summary(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        return (f"{verdict}: perplexity float32 {self.ppl_float32:.3f} -> int8 {self.ppl_int8:.3f} "
                f"({self.ppl_rise_pct:+.2f}%, threshold {self.threshold_pct:.2f}%), top-1 agreement "
                f"{self.top1_agreement:.2%}, mean KL {self.kl_mean:.5f} over {self.tokens} tokens")


class GateAccumulator:
    """Sums over windows; `add` takes both models' logits for one window."""

    def __init__(self) -> None:
        self.nll_ref = 0.0
        self.nll_cand = 0.0
        self.agree = 0
        self.kl = 0.0
        self.count = 0

    def add(self, ref_logits: torch.Tensor, cand_logits: torch.Tensor, token_ids: list[int]) -> None:
        """One window: its logits [T, vocab] from both models (position t predicts token t + 1)."""
        targets = token_ids[1:]
        for start in range(0, len(targets), GATE_ROWS):
            rows = slice(start, min(start + GATE_ROWS, len(targets)))
            self.add_rows(ref_logits[rows], cand_logits[rows], targets[rows])

    def add_rows(self, ref_logits: torch.Tensor, cand_logits: torch.Tensor, targets: list[int]) -> None:
        """Positions whose next tokens are `targets`: row i of each model's logits predicts targets[i]."""
        targets = torch.tensor(targets, device=ref_logits.device)
        ref = F.log_softmax(ref_logits.float(), dim=-1)
        cand = F.log_softmax(cand_logits.float(), dim=-1)
        rows = torch.arange(len(targets), device=ref.device)
        self.nll_ref -= float(ref[rows, targets].sum(dtype=torch.float64))
        self.nll_cand -= float(cand[rows, targets].sum(dtype=torch.float64))
        self.agree += int((ref.argmax(-1) == cand.argmax(-1)).sum())
        self.kl += float((ref.exp() * (ref - cand)).sum(dtype=torch.float64))
        self.count += len(targets)

    def result(self, threshold_pct: float = DEFAULT_THRESHOLD_PCT) -> GateResult:
        if not self.count:
            raise ValueError("quality gate: no tokens were scored")
        ppl_ref = math.exp(self.nll_ref / self.count)
        ppl_cand = math.exp(self.nll_cand / self.count)
        return GateResult(tokens=self.count, ppl_float32=ppl_ref, ppl_int8=ppl_cand,
                          ppl_rise_pct=100.0 * (ppl_cand / ppl_ref - 1.0),
                          top1_agreement=self.agree / self.count, kl_mean=self.kl / self.count,
                          threshold_pct=threshold_pct)


def eval_tokens(tokenizer, max_tokens: int | None = None) -> list[int]:
    if tokenizer is None:
        raise ValueError("quality gate: the model has no tokenizer to encode the evaluation text")
    ids = tokenizer.encode(load_eval_text())
    return ids[:max_tokens] if max_tokens else ids


def compare_models(reference, candidate, token_ids: list[int], window: int = DEFAULT_WINDOW,
                   threshold_pct: float = DEFAULT_THRESHOLD_PCT) -> GateResult:
    """Both models in memory: each window is run through one, then the other."""
    acc = GateAccumulator()
    for ids in windows(token_ids, window):
        acc.add(sequence_logits(reference, ids), sequence_logits(candidate, ids), ids)
    return acc.result(threshold_pct)
