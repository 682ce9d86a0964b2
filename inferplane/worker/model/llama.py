"""The causal LM over the Llama block (decoder.py, its parts in layers.py; plain PyTorch, gpt-fast
style), with every decoder family served as its difference from it (config.ModelConfig's family
fields): Llama, SmolLM2, Mistral, Qwen2 are the block itself; Qwen3 adds query/key norms; Gemma 2/3
(gemma.py) sandwich the block in more norms, scale the embeddings and soft-cap; Mixtral and
Qwen3-MoE (moe.py) swap the MLP for experts; Phi-3 is the block with fused weights (split at load)
and LongRoPE. Sliding-window layers differ only in the window their attention is given.

Tokens of all sequences in a step are flattened into one [T] axis, so every linear layer runs
as one matmul over the whole batch; only attention looks at sequence boundaries (ops/attention.py).
Module and parameter names follow HF's so a safetensors state dict loads as it is.

Two ops of the ops wing run at this level: the output head's kernel (ops/head.py: chosen by rows,
against a crossover measured at start-up) and, on the CPU under cpu-int8, the fused decode
(ops/fused_decode.py), which runs a decode step's layers, final norm and head in one C call where
it can; the model runs its layers one by one wherever it does not.
"""

from __future__ import annotations

import torch
from torch import nn

from inferplane.api.model_config import FULL, SLIDING, ModelConfig
from inferplane.worker.model.decoder import DecoderLayer
from inferplane.worker.model.gemma import SandwichDecoderLayer
from inferplane.worker.model.layers import Rotary
from inferplane.worker.model.step_inputs import StepInputs
from inferplane.worker.ops.attention import AttentionBatch
from inferplane.worker.ops.fused_decode import BurstDraws, FusedDecode
from inferplane.worker.ops.head import HeadKernel
from inferplane.worker.ops.kv_cache import PagedKVCache
from inferplane.worker.ops.norm import RMSNorm
from inferplane.worker.ops.structure import WatchedModule


def decoder_layer(config: ModelConfig, index: int) -> DecoderLayer:
    """The family's decoder layer: Gemma's sandwich of norms, or the Llama block."""
    if config.sandwich_norms:
        return SandwichDecoderLayer(config, index)
    return DecoderLayer(config, index)


class LlamaBody(WatchedModule):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(decoder_layer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


def local_rotary(config: ModelConfig, max_positions: int | None) -> Rotary | None:
    """The sliding layers' own rope (Gemma 3: another base, unscaled), or None where all layers share one."""
    if not config.rope_local_theta or SLIDING not in config.layer_types:
        return None
    return Rotary(config, max_positions or config.max_position_embeddings, theta=config.rope_local_theta, scaled=False)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int | None = None):
        super().__init__()
        self.config = config
        self.model = LlamaBody(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = Rotary(config, max_positions or config.max_position_embeddings)
        self.rotary_local = local_rotary(config, max_positions)
        self.head_kernel = HeadKernel()  # which kernel runs lm_head for a call's rows (measure_head_kernel)
        self.fused_decode = FusedDecode(config, self.model)  # decode steps in one C call, where they can
        self.adapters = None  # lora.AdapterSlots once lora.install wrapped the projections

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: PagedKVCache,
                batch: AttentionBatch) -> torch.Tensor:
        """Returns final hidden states [T, hidden]; logits are computed only for sampled rows."""
        return self.forward_and_logits(input_ids, positions, cache, batch)[0]

    def forward_and_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: PagedKVCache,
                           batch: AttentionBatch, steps: int = 1, stop_ids: frozenset[int] = frozenset(),
                           draws: BurstDraws | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Final hidden states [T, hidden] and, where a decode step's C call ran the head too (the
        fused decode), the logits of every row, as compute_logits gives them, and each row's argmax
        of them (what greedy sampling takes); else None, None (the caller computes the sampled rows'
        logits). `steps` > 1: a burst of greedy decode steps where the fused decode can run one
        (FusedDecode.forward, which ends it after a step where a row's token is in `stop_ids`): the
        argmax is then [steps run, rows], each sampled row's draws where `draws` says how to draw."""
        rotaries = {FULL: self.rotary}
        if self.rotary_local is not None:
            rotaries[SLIDING] = self.rotary_local
        step = StepInputs(input_ids, positions, self.model.embed_tokens, self.config.embedding_multiplier, rotaries)
        # The fused decode runs the base weights only: a step with adapter rows runs layer by layer.
        adapter_rows = self.adapters is not None and self.adapters.batch is not None
        if step.device.type == "cpu" and self.config.fused_decode_block and not adapter_rows:
            fused = self.fused_decode.forward(step, cache, batch, self.fused_head, steps, stop_ids, draws)
            if fused is not None:
                return fused
        x, tables = step.x(), step.tables()
        for layer in self.model.layers:
            x = layer(x, tables[layer.rope_kind], cache, batch)
        return self.model.norm(x), None, None

    def fused_head(self, rows: int) -> tuple | None:
        """The head's operands for the fused decode's C call, where compute_logits would run that
        same C kernel on `rows` rows and nothing follows it; None otherwise (a soft-cap follows
        Gemma 2's head): the head then runs here, after the call (HeadKernel.fused_operands)."""
        if self.config.final_logit_softcap is not None:
            return None
        return self.head_kernel.fused_operands(self.lm_head, rows)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.head_kernel.logits(self.lm_head, hidden)
        cap = self.config.final_logit_softcap
        if cap is not None:  # Gemma 2
            logits = torch.tanh(logits / cap) * cap
        return logits

    def measure_head_kernel(self, max_rows: int = 16) -> int:
        """Times the head's C kernel against PyTorch's product on this CPU, at start-up
        (HeadKernel.measure); returns the crossover (choice.NEVER: the kernel won throughout)."""
        return self.head_kernel.measure(self.lm_head, max_rows)
