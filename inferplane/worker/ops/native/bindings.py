"""ctypes bindings of the C kernels (csrc/; the ops' entry points are declared in csrc/kernels.h, the
decoder layer's with its structures in csrc/decode_layers.c): the structures the C side reads and
`NativeKernels`, the loaded library with tensor-level wrappers that check what the C side assumes
(contiguous float32 rows, the packed layouts of packing.py) before handing it pointers.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from inferplane.worker.ops.native.packing import BLOCK, BLOCK_KINDS

# What each kernel is called in stats, metrics and bench output.
KERNEL_NAMES = ("int8_linear", *(f"{kind}_linear" for kind in BLOCK_KINDS.values()), "f32_linear",
                "decode_attention", "rms_norm", "silu_mul",
                "gelu_mul", "rope_store_kv", "argmax", "moe_route")
# The bits ip_features reports (csrc/kernels.h IP_FEATURE_*).
_FEATURE_INT8_LINEAR = 1
_FEATURE_F32_LINEAR = 2
_FEATURE_BLOCK_LINEAR = 4  # ip_block_linear: GGUF blocks of 4, 5, 6 or 8 bits
_FEATURE_HALF_KV = 8  # float16 KV caches (F16C)

_P, _I = ctypes.c_void_p, ctypes.c_int64
# A layer linear's `bits` where its weight is plain float32 [n, k] (decode_layers.c's IP_FLOAT32_BITS).
FLOAT32_BITS = 32


class LinearOperands(ctypes.Structure):
    """decode_layers.c's ip_linear: one linear as the layer kernels read it, packed int8 with its scale,
    or GGUF blocks (NULL scale) of `bits`, or float32 (bits FLOAT32_BITS); n outputs; bias or NULL."""

    _fields_ = [("w", _P), ("s", _P), ("bias", _P), ("bits", _I), ("n", _I)]


class MoeWeights(ctypes.Structure):
    """decode_layers.c's ip_moe: a Mixture-of-Experts MLP, its router and each expert's gate_up and down
    (arrays of LinearOperands, n_experts long)."""

    _fields_ = [("router", LinearOperands), ("gate_up", _P), ("down", _P), ("n_experts", _I), ("top_k", _I),
                ("inter", _I), ("normalize", _I)]


class LayerWeights(ctypes.Structure):
    """One decoder layer as ip_decode_layers reads it (decode_layers.c's ip_layer_weights): the norms, the
    four linears (qkv, o, gate_up, down) as packed int8 weight + scale, or GGUF blocks with a NULL
    scale and their `bits`, biases or NULL, the layer's K and V caches; Gemma's query/key and sandwich
    norms (NULL where none), a sliding layer's window, attention view and rope tables, and Gemma 2's
    score soft-cap (0: none; decode_layers.c says how); a MoE layer's experts (a MoeWeights, or NULL: the
    dense MLP in linears 2 and 3)."""

    _fields_ = [("norm1", _P), ("norm2", _P), ("w", _P * 4), ("s", _P * 4), ("bias", _P * 4),
                ("k_cache", _P), ("v_cache", _P), ("q_norm", _P), ("k_norm", _P), ("norm3", _P), ("norm4", _P),
                ("window", _I), ("view", _I), ("rope", _I), ("bits", _I * 4), ("softcap", ctypes.c_float),
                ("moe", _P)]


class DecodeTail(ctypes.Structure):
    """decode_layers.c's ip_decode_tail: the final norm's weight (NULL: none) and eps, and the head (its w
    NULL: none) with the logits buffer it writes and the buffer of each row's argmax (NULL: none);
    where `temperature` is set, the rows above 0 are drawn instead (top_k, top_p, min_p, a uniform
    per step and row, and scratch weights as large as the logits: csrc/sample.c)."""

    _fields_ = [("norm", _P), ("eps", ctypes.c_float), ("head", LinearOperands), ("logits", _P), ("argmax", _P),
                ("temperature", _P), ("top_k", _P), ("top_p", _P), ("min_p", _P), ("uniform", _P), ("weights", _P)]


class DecodeInputs(ctypes.Structure):
    """decode_layers.c's ip_decode_inputs: each row's token id and position, the embedding table and its
    multiplier (0.0: none), the whole cos and signed-sin tables of the model's rope and of the sliding
    layers' own, and the tables' row counts, from which the call looks up x and the rope rows itself."""

    _fields_ = [("token_ids", _P), ("positions", _P), ("embedding", _P), ("scale", ctypes.c_float),
                ("cos", _P * 2), ("signed_sin", _P * 2), ("vocab", _I), ("max_positions", _I)]


class AttnView(ctypes.Structure):
    """decode_layers.c's ip_attn_view: one pool's slots, block tables and context lengths for a step."""

    _fields_ = [("slots", _P), ("block_tables", _P), ("context_lens", _P), ("max_blocks", _I)]


class RopeTables(ctypes.Structure):
    """decode_layers.c's ip_rope: cos and signed sin for each row's position."""

    _fields_ = [("cos", _P), ("signed_sin", _P)]


class NativeKernels:
    """The loaded library, with tensor-level wrappers that check what the C side assumes."""

    def __init__(self, lib: ctypes.CDLL, path: Path):
        self.path = path
        self._lib = lib
        lib.ip_features.restype = ctypes.c_int
        lib.ip_isa.restype = ctypes.c_char_p
        self.isa: str = lib.ip_isa().decode()
        lib.ip_int8_linear.argtypes = [_P, _I, _I, _I, _P, _P, _P, _I, _P, _I]
        lib.ip_int8_linear.restype = ctypes.c_int
        lib.ip_int8_dequantize.argtypes = [_P, _I, _I, _P, _P]
        lib.ip_int8_dequantize.restype = None
        lib.ip_block_linear.argtypes = [_P, _I, _I, _I, _P, ctypes.c_int, _P, _I, _P, _I]
        lib.ip_block_linear.restype = ctypes.c_int
        lib.ip_block_dequantize.argtypes = [_P, ctypes.c_int, _I, _I, _P]
        lib.ip_block_dequantize.restype = None
        lib.ip_paged_decode_attention.argtypes = [_P, _I, _I, _I, _I, _I, _P, _P, _I, _P, _I, _P,
                                                  ctypes.c_float, _P, _I, ctypes.c_int, _I, ctypes.c_float]
        lib.ip_paged_decode_attention.restype = ctypes.c_int
        lib.ip_f32_linear.argtypes = [_P, _I, _I, _I, _P, _P, _I, _P, _I]
        lib.ip_f32_linear.restype = ctypes.c_int
        lib.ip_rms_norm.argtypes = [_P, _P, _I, _I, _P, ctypes.c_float, _P]
        lib.ip_rms_norm.restype = None
        lib.ip_silu_mul.argtypes = [_P, _I, _I, _P]
        lib.ip_silu_mul.restype = None
        lib.ip_gelu_mul.argtypes = [_P, _I, _I, _P]
        lib.ip_gelu_mul.restype = None
        lib.ip_moe_route.argtypes = [_P, _I, _I, _I, ctypes.c_int, _P, _P]
        lib.ip_moe_route.restype = ctypes.c_int
        lib.ip_argmax_rows.argtypes = [_P, _I, _I, _I, _P]
        lib.ip_argmax_rows.restype = None
        lib.ip_sample_rows.argtypes = [_P, _I, _I, _I, _P, _P, _P, _P, _P, _P, _P]
        lib.ip_sample_rows.restype = None
        lib.ip_rope_store_kv.argtypes = [_P, _I, _I, _I, _I, _P, _P, _P, _P, _P, ctypes.c_int]
        lib.ip_rope_store_kv.restype = ctypes.c_int
        lib.ip_decode_layers.argtypes = [_P, _I, _I, _P, _I, ctypes.c_float, _I, _I, _I, _I, _P, _P, _I,
                                         ctypes.c_float, ctypes.c_int, ctypes.c_int, _P, _P]
        lib.ip_decode_layers.restype = ctypes.c_int
        lib.ip_decode_steps.argtypes = [_P, _I, _I, _P, _I, ctypes.c_float, _I, _I, _I, _I, _P, _I, ctypes.c_float,
                                        ctypes.c_int, ctypes.c_int, _P, _P, _I, _P, _I, _P]
        lib.ip_decode_steps.restype = ctypes.c_int
        features = lib.ip_features()
        self.has_int8_linear = bool(features & _FEATURE_INT8_LINEAR)
        self.has_f32_linear = bool(features & _FEATURE_F32_LINEAR)
        self.has_block_linear = bool(features & _FEATURE_BLOCK_LINEAR)
        self.has_half_kv = bool(features & _FEATURE_HALF_KV)

    def kernel_isas(self) -> dict[str, str]:
        """Kernel name -> the ISA it runs on here, or "torch" where this build lacks it."""
        present = {"int8_linear": self.has_int8_linear, "f32_linear": self.has_f32_linear,
                   **{f"{kind}_linear": self.has_block_linear for kind in BLOCK_KINDS.values()}}
        return {name: self.isa if present.get(name, True) else "torch" for name in KERNEL_NAMES}

    def int8_linear(self, x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, K] float32 (rows may be strided) -> [M, N] float32, with `packed` from
        pack_int8_weight and per-channel `scale` [N]."""
        m, k = x.shape
        n = scale.shape[0]
        if x.stride(1) != 1:
            x = x.contiguous()
        out = torch.empty(m, n, dtype=torch.float32)
        rc = self._lib.ip_int8_linear(x.data_ptr(), m, k, x.stride(0), packed.data_ptr(), scale.data_ptr(),
                                      None if bias is None else bias.data_ptr(), n, out.data_ptr(), n)
        _check(rc, "ip_int8_linear")
        return out

    def int8_dequantize(self, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """The packed weight as float32 [N, K], each row times its scale (for a float GEMM)."""
        nb, k4, _, _ = packed.shape
        out = torch.empty(nb * 16, k4 * 4, dtype=torch.float32)
        self._lib.ip_int8_dequantize(packed.data_ptr(), nb * 16, k4 * 4, scale.data_ptr(), out.data_ptr())
        return out

    def block_linear(self, x: torch.Tensor, blocks: torch.Tensor, bits: int,
                     bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, K] float32 (rows may be strided) -> [M, N] float32, the weight as GGUF blocks of
        `bits` in pack_blocks' layout: uint8 [N / 16, K / 32, block_group_bytes(bits)]."""
        m, k = x.shape
        n = blocks.shape[0] * 16
        if x.stride(1) != 1:
            x = x.contiguous()
        out = torch.empty(m, n, dtype=torch.float32)
        rc = self._lib.ip_block_linear(x.data_ptr(), m, k, x.stride(0), blocks.data_ptr(), bits,
                                       None if bias is None else bias.data_ptr(), n, out.data_ptr(), n)
        _check(rc, "ip_block_linear")
        return out

    def block_dequantize(self, blocks: torch.Tensor, bits: int) -> torch.Tensor:
        """Packed blocks [N / 16, K / 32, block_group_bytes(bits)] -> float32 [N, K] (w = d * q + m)."""
        groups, nb, _ = blocks.shape
        n, k = groups * 16, nb * BLOCK
        out = torch.empty(n, k, dtype=torch.float32)
        self._lib.ip_block_dequantize(blocks.data_ptr(), bits, n, k, out.data_ptr())
        return out

    def f32_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, K] @ weight[N, K].T (+ bias), float32, weight in its own layout; for few rows."""
        m, k = x.shape
        n = weight.shape[0]
        if x.stride(1) != 1:
            x = x.contiguous()
        out = torch.empty(m, n, dtype=torch.float32)
        rc = self._lib.ip_f32_linear(x.data_ptr(), m, k, x.stride(0), weight.data_ptr(),
                                     None if bias is None else bias.data_ptr(), n, out.data_ptr(), n)
        _check(rc, "ip_f32_linear")
        return out

    def f32_linear_applies(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.dtype == torch.float32 and self.f32_weight_applies(weight)

    def f32_weight_applies(self, weight: torch.Tensor) -> bool:
        """Whether ip_f32_linear reads this weight (what the fused decode checks for a float32 router)."""
        return (self.has_f32_linear and weight.device.type == "cpu" and weight.dtype == torch.float32
                and weight.is_contiguous() and weight.shape[0] % 8 == 0)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 delta: torch.Tensor | None = None) -> torch.Tensor:
        """RMSNorm of x [M, K] (contiguous float32); with `delta`, x += delta first, in place (the
        residual add before a norm, one pass over the row instead of two)."""
        m, k = x.shape
        out = torch.empty_like(x)
        self._lib.ip_rms_norm(x.data_ptr(), None if delta is None else delta.data_ptr(), m, k, weight.data_ptr(),
                              eps, out.data_ptr())
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[M, 2I] (gate | up) -> silu(gate) * up [M, I]."""
        m, width = gate_up.shape
        out = torch.empty(m, width // 2, dtype=torch.float32)
        self._lib.ip_silu_mul(gate_up.data_ptr(), m, width // 2, out.data_ptr())
        return out

    def gelu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[M, 2I] (gate | up) -> gelu(gate) * up [M, I], GELU's tanh approximation (Gemma's GeGLU)."""
        m, width = gate_up.shape
        out = torch.empty(m, width // 2, dtype=torch.float32)
        self._lib.ip_gelu_mul(gate_up.data_ptr(), m, width // 2, out.data_ptr())
        return out

    def moe_route(self, logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Router logits [M, E] (contiguous float32) -> (weights [M, k] float32, expert ids [M, k]
        int64): softmax, the k most probable (most probable first), renormalised where `normalize`
        says. The fused decode routes with this same kernel."""
        m, e = logits.shape
        weights = torch.empty(m, top_k, dtype=torch.float32)
        ids = torch.empty(m, top_k, dtype=torch.int64)
        rc = self._lib.ip_moe_route(logits.data_ptr(), m, e, top_k, int(normalize), weights.data_ptr(), ids.data_ptr())
        _check(rc, "ip_moe_route")
        return weights, ids

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, N] float32 on the CPU (rows may be strided) -> int64 [M]: torch.argmax(x, dim=-1)'s
        answer (the first maximum; the first NaN where a row has one)."""
        m, n = x.shape
        if x.stride(1) != 1:
            x = x.contiguous()
        out = torch.empty(m, dtype=torch.int64)
        self._lib.ip_argmax_rows(x.data_ptr(), m, n, x.stride(0), out.data_ptr())
        return out

    def sample_rows(self, logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                    min_p: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
        """logits [M, N] float32 on the CPU -> int64 [M]: each row's token drawn by inverse CDF at its
        `uniform` (float64 in (0, 1]) from softmax(logits / temperature) filtered by top_k (<= 0: off),
        top_p (1: off) and min_p (0: off), as engine/sampling.py's torch path filters (csrc/sample.c)."""
        m, n = logits.shape
        if logits.stride(1) != 1:
            logits = logits.contiguous()
        weights = torch.empty(m, n, dtype=torch.float32)
        out = torch.empty(m, dtype=torch.int64)
        self._lib.ip_sample_rows(logits.data_ptr(), m, n, logits.stride(0), temperature.data_ptr(), top_k.data_ptr(),
                                 top_p.data_ptr(), min_p.data_ptr(), uniform.data_ptr(), weights.data_ptr(),
                                 out.data_ptr())
        if bool((out < 0).any()):
            raise MemoryError("ip_sample_rows: no memory for a row's nucleus")
        return out

    def rope_store_kv(self, qkv: torch.Tensor, heads: int, kv_heads: int, cos: torch.Tensor,
                      signed_sin: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor) -> None:
        """qkv [T, heads + 2 kv_heads, d]: q and k rotated in place, k and v copied to their slots
        (converted to float16 where the caches hold it)."""
        t, _, d = qkv.shape
        rc = self._lib.ip_rope_store_kv(qkv.data_ptr(), t, heads, kv_heads, d, cos.data_ptr(), signed_sin.data_ptr(),
                                        slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), _is_half(k_cache))
        _check(rc, "ip_rope_store_kv")

    def paged_decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor,
                               scale: float, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        """q [B, heads, d] (one query token per sequence); caches [blocks, block_size, kv_heads, d];
        block_tables [B, max_blocks] and context_lens [B], int64. Returns [B, heads, d]. With
        `window` (a sliding layer), each query reads only the last `window` tokens of its context;
        with `softcap` (Gemma 2), scores are soft-capped: softcap * tanh(score / softcap)."""
        b, heads, d = q.shape
        blocks, block_size, kv_heads, _ = k_cache.shape
        out = torch.empty(b, heads, d, dtype=torch.float32)
        rc = self._lib.ip_paged_decode_attention(
            q.data_ptr(), q.stride(0), b, heads, kv_heads, d, k_cache.data_ptr(), v_cache.data_ptr(), block_size,
            block_tables.data_ptr(), block_tables.shape[1], context_lens.data_ptr(), scale, out.data_ptr(),
            out.stride(0), _is_half(k_cache), window or 0, softcap or 0.0)
        _check(rc, "ip_paged_decode_attention")
        return out

    def decode_layers(self, x: torch.Tensor, layers: ctypes.Array, eps: float, shape: tuple[int, int, int, int],
                      ropes: list[tuple[torch.Tensor, torch.Tensor]] | None,
                      views: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], block_size: int, scale: float,
                      kv_half: bool = False, gelu: bool = False, tail: DecodeTail | None = None,
                      inputs: DecodeInputs | None = None) -> None:
        """Consecutive decoder layers for decode rows in one call (ip_decode_layers), x [B, hidden]
        updated in place. `layers`: a ctypes array of LayerWeights (the caller keeps the tensors
        they point to alive); `shape`: (heads, kv_heads, head_dim, intermediate); `ropes`: the
        model's (cos, signed sin) and the sliding layers' own; `views`: (slots, block tables,
        context lengths) of the main pool and of the window pool (the layers' `rope` and `view`
        pick one of each); `kv_half`: the caches hold float16; `gelu`: the MLP is GeGLU; `tail`: the
        final norm (x normed in place) and the head after the last layer (the caller keeps its
        weights and logits buffer alive); `inputs`: x (written here) and the rope rows are looked
        up in the call (`ropes` None; the caller keeps what it points to alive)."""
        b, hidden = x.shape
        heads, kv_heads, d, inter = shape
        rope_array = (RopeTables * 2)(*(RopeTables(c.data_ptr(), s.data_ptr()) for c, s in ropes or ()))
        view_array = _views(views)
        rc = self._lib.ip_decode_layers(
            x.data_ptr(), b, hidden, ctypes.addressof(layers), len(layers), eps, heads, kv_heads, d, inter,
            ctypes.addressof(rope_array), ctypes.addressof(view_array), block_size, scale, int(kv_half), int(gelu),
            None if tail is None else ctypes.addressof(tail), None if inputs is None else ctypes.addressof(inputs))
        _check(rc, "ip_decode_layers")

    def decode_steps(self, x: torch.Tensor, layers: ctypes.Array, eps: float, shape: tuple[int, int, int, int],
                     views: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], block_size: int, scale: float,
                     kv_half: bool, gelu: bool, tail: DecodeTail, inputs: DecodeInputs, steps: int,
                     stop_ids: frozenset[int] = frozenset()) -> torch.Tensor:
        """Up to `steps` greedy decode steps in one call (ip_decode_steps): decode_layers with the
        tail's argmax fed back as each row's next token, at the next position and slot, ending
        after the first step in which any row's token is in `stop_ids`. The tail must hold the head
        and an argmax buffer, `inputs` the lookups; every step's slot must lie in the block each
        row's first token went to (else a RuntimeError). The tensors in `views` are read, not
        changed. Returns the tokens of the steps run [run, B]."""
        b, hidden = x.shape
        heads, kv_heads, d, inter = shape
        tokens = torch.empty(steps, b, dtype=torch.int64)
        stops = (ctypes.c_int64 * max(1, len(stop_ids)))(*sorted(stop_ids))
        view_array = _views(views)
        run = self._lib.ip_decode_steps(
            x.data_ptr(), b, hidden, ctypes.addressof(layers), len(layers), eps, heads, kv_heads, d, inter,
            ctypes.addressof(view_array), block_size, scale, int(kv_half), int(gelu), ctypes.addressof(tail),
            ctypes.addressof(inputs), steps, ctypes.addressof(stops), len(stop_ids), tokens.data_ptr())
        _check(min(run, 0), "ip_decode_steps")
        return tokens[:run]

    def reads_kv_cache(self, cache: torch.Tensor) -> bool:
        """Whether the attention and KV-store kernels read and write this cache: float32, or float16
        on builds with F16C; contiguous, on the CPU."""
        return (cache.device.type == "cpu" and cache.is_contiguous()
                and (cache.dtype == torch.float32 or (cache.dtype == torch.float16 and self.has_half_kv)))

    def decode_attention_applies(self, q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor,
                                 context_lens: torch.Tensor) -> bool:
        """Whether the tensors have the dtypes and layout the C kernel reads."""
        return (q.device.type == "cpu" and q.dtype == torch.float32 and self.reads_kv_cache(k_cache)
                and q.stride(2) == 1 and q.stride(1) == q.shape[2] and decode_views_read(block_tables, context_lens))


def kernel_isas(loaded: NativeKernels | None) -> dict[str, str]:
    """Kernel name -> the ISA it runs on with `loaded` (build.kernels()); "torch" everywhere without."""
    return loaded.kernel_isas() if loaded is not None else dict.fromkeys(KERNEL_NAMES, "torch")


def decode_views_read(block_tables: torch.Tensor, context_lens: torch.Tensor) -> bool:
    """Whether the decode attention kernel reads these block tables and context lengths (int64,
    contiguous): the part of decode_attention_applies that changes from step to step."""
    return (block_tables.dtype is torch.int64 and context_lens.dtype is torch.int64
            and block_tables.is_contiguous() and context_lens.is_contiguous())


def float32_rows(*tensors: torch.Tensor) -> bool:
    """Whether every tensor is contiguous float32 on the CPU: what the element-wise kernels read."""
    return all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in tensors)


def _is_half(cache: torch.Tensor) -> int:
    return int(cache.dtype == torch.float16)


def _views(views: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> ctypes.Array:
    """The main pool's and the window pool's (slots, block tables, context lengths) as ip_attn_view."""
    return (AttnView * 2)(*(AttnView(slots.data_ptr(), tables.data_ptr(), lens.data_ptr(), tables.shape[1])
                            for slots, tables, lens in views))


def _check(rc: int, name: str) -> None:
    if rc == -2:
        raise MemoryError(f"{name}: out of memory for its scratch buffers")
    if rc == -3:  # as PyTorch's embedding and indexing refuse it
        raise IndexError(f"{name}: a token id or position is outside the embedding or rope table")
    if rc == -4:
        raise RuntimeError(f"{name}: a step's slot is outside the block its row's first token went to, or no "
                           "head or lookups to feed the next step")
    if rc != 0:
        raise RuntimeError(f"{name} returned {rc}")
