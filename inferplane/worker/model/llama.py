"""The causal LM over the Llama block (decoder.py, its parts in layers.py; plain PyTorch, gpt-fast
style), with every decoder family served as its difference from it (config.ModelConfig's family
fields): Llama, SmolLM2, Mistral, Qwen2 are the block itself; Qwen3 adds query/key norms; Gemma 2/3
(gemma.py) sandwich the block in more norms, scale the embeddings and soft-cap; Mixtral and
Qwen3-MoE (moe.py) swap the MLP for experts; Phi-3 is the block with fused weights (split at load)
and LongRoPE. Sliding-window layers differ only in the window their attention is given.

Tokens of all sequences in a step are flattened into one [T] axis, so every linear layer runs
as one matmul over the whole batch; only attention looks at sequence boundaries (attention.py).
Module and parameter names follow HF's so a safetensors state dict loads as it is.
"""

from __future__ import annotations

import torch
from torch import nn

from inferplane.api.model_config import FULL, SLIDING, ModelConfig
from inferplane.worker.model import structure
from inferplane.worker.model.decoder import DecoderLayer
from inferplane.worker.model.fused_decode import FusedDecode, linear_operands
from inferplane.worker.model.gemma import SandwichDecoderLayer
from inferplane.worker.model.layers import RMSNorm, Rotary
from inferplane.worker.model.step_inputs import StepInputs
from inferplane.worker.model.structure import WatchedModule
from inferplane.worker.ops import native
from inferplane.worker.ops.attention import AttentionBatch
from inferplane.worker.ops.kv_cache import PagedKVCache
from inferplane.worker.ops.native.choice import NEVER, crossover


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
        self.head_torch_from_rows = NEVER  # set by measure_head_kernel: PyTorch's head from here on
        self.fused_decode = FusedDecode(config, self.model)  # decode steps in one C call, where they can
        self.adapters = None  # lora.AdapterSlots once lora.install wrapped the projections
        self._fused_head: tuple = (None, None, None)  # (what fused_head's answer depends on, it, what is held)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: PagedKVCache,
                batch: AttentionBatch) -> torch.Tensor:
        """Returns final hidden states [T, hidden]; logits are computed only for sampled rows."""
        return self.forward_and_logits(input_ids, positions, cache, batch)[0]

    def forward_and_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: PagedKVCache,
                           batch: AttentionBatch, steps: int = 1, stop_ids: frozenset[int] = frozenset()
                           ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Final hidden states [T, hidden] and, where a decode step's C call ran the head too (the
        fused decode), the logits of every row, as compute_logits gives them, and each row's argmax
        of them (what greedy sampling takes); else None, None (the caller computes the sampled rows'
        logits). `steps` > 1: a burst of greedy decode steps where the fused decode can run one
        (FusedDecode.forward, which ends it after a step where a row's token is in `stop_ids`): the
        argmax is then [steps run, rows]."""
        rotaries = {FULL: self.rotary}
        if self.rotary_local is not None:
            rotaries[SLIDING] = self.rotary_local
        step = StepInputs(input_ids, positions, self.model.embed_tokens, self.config.embedding_multiplier, rotaries)
        # The fused decode runs the base weights only: a step with adapter rows runs layer by layer.
        adapter_rows = self.adapters is not None and self.adapters.batch is not None
        if step.device.type == "cpu" and self.config.fused_decode_block and not adapter_rows:
            fused = self.fused_decode.forward(step, cache, batch, self.fused_head, steps, stop_ids)
            if fused is not None:
                return fused
        x, tables = step.x(), step.tables()
        for layer in self.model.layers:
            x = layer(x, tables[layer.rope_kind], cache, batch)
        return self.model.norm(x), None, None

    def fused_head(self, rows: int) -> tuple | None:
        """The head's operands (fused_decode.linear_operands' shape) for the fused decode's C call,
        where compute_logits would run that same C kernel on `rows` rows and nothing follows it (no
        soft-cap); None otherwise: the head then runs here, after the call. The same tuple while
        nothing it depends on changes (the fused decode then reuses what it made of it): worked out
        each step, it was 20 us of a batch-1 decode step run with caches the weights had swept."""
        head = self.lm_head
        dispatch = getattr(head, "dispatch", None)
        held = (head, getattr(head, "weight", None), getattr(head, "bias", None), native.kernels())
        # by identity (the objects are held with the answer, so no id is reused while it is kept)
        key = (rows, *map(id, held), self.head_torch_from_rows, None if dispatch is None else dispatch.version,
               structure.version())
        if self._fused_head[0] != key:
            self._fused_head = (key, self._head_operands(rows), held)
        return self._fused_head[1]

    def _head_operands(self, rows: int) -> tuple | None:
        head = self.lm_head
        if self.config.final_logit_softcap is not None:
            return None
        if type(head) is nn.Linear:  # float32: _head_logits' C kernel below its measured crossover
            if self._float_head_kernel(rows) is None:
                return None
            return head.weight, None, native.FLOAT32_BITS, head.bias, head.out_features
        if not hasattr(head, "float_rows") or rows >= head.float_rows():  # below it: head() runs its C kernel
            return None
        return linear_operands(head)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self._head_logits(hidden)
        cap = self.config.final_logit_softcap
        if cap is not None:  # Gemma 2
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.lm_head
        if type(head) is nn.Linear and hidden.device.type == "cpu":
            # The head is the biggest weight and sampled rows are few: the C kernel reads the tall
            # weight in place (2.2x PyTorch's speed for one row of SmolLM2's head on AVX-512), up to
            # the row count where PyTorch measured faster at start-up (measure_head_kernel).
            kernels = self._float_head_kernel(hidden.shape[0]) if hidden.dtype == torch.float32 else None
            if kernels is not None:
                return kernels.f32_linear(hidden, head.weight, head.bias)
            return self._torch_logits(hidden)
        return head(hidden).float()

    def _float_head_kernel(self, rows: int) -> native.NativeKernels | None:
        """The C kernel that runs the float32 head (an nn.Linear) for `rows` float32 CPU rows: below
        the crossover measured at start-up and where it reads the weight; None: PyTorch's product.
        The one rule for _head_logits and for the fused decode's call (fused_head)."""
        kernels = native.kernels()
        if kernels is None or rows >= self.head_torch_from_rows or not kernels.f32_weight_applies(self.lm_head.weight):
            return None
        return kernels

    def _torch_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.lm_head
        if head.bias is None and hidden.shape[0] > 1:
            # [V, H] @ [H, M] rather than [M, H] @ [H, V]: the same product, but the CPU's GEMM
            # blocks the tall weight better (16 rows of SmolLM2's head: 14.7 against 20.3 ms).
            return torch.mm(head.weight, hidden.t()).t().float()
        return head(hidden).float()

    def measure_head_kernel(self, max_rows: int = 16) -> int:
        """Times the C head kernel against PyTorch's product on this CPU and keeps the kernel below
        the measured crossover; returns it (choice.NEVER: the kernel won throughout)."""
        head = self.lm_head
        kernels = native.kernels()
        self.head_torch_from_rows = NEVER
        if type(head) is not nn.Linear or head.weight.device.type != "cpu" or kernels is None:
            return NEVER
        probe = torch.zeros(1, head.in_features, dtype=head.weight.dtype)
        if not kernels.f32_linear_applies(probe, head.weight):
            return NEVER
        rows = [r for r in (1, 2, 4, 8, 16, 32) if r <= max_rows]
        self.head_torch_from_rows = crossover(lambda x: kernels.f32_linear(x, head.weight, head.bias),
                                              self._torch_logits,
                                              lambda n: torch.randn(n, head.in_features), rows)
        return self.head_torch_from_rows
