"""The worker's C kernels (kernels.c): compiled for this CPU on first use, loaded with ctypes.

Why C and why at run time: at decode sizes (a few to a few dozen rows) PyTorch's eager CPU ops spend
more time on per-call work than on arithmetic. `torch._int_mm` reorders the int8 weight on every
call and quantizing the input rows took five eager ops (on CPUs without VNNI it ran 10x slower
than float32 altogether); decode attention first copied each sequence's KV blocks into one tensor
and then ran SDPA. The C versions read a weight laid out once at load time and KV blocks where they
lie in the cache. Measured on this project's 2-core AVX-512 VNNI machine, 16 rows: 2-3x less time
per int8 linear than `_int_mm` for SmolLM2's shapes, and a third of the time for decode attention
at ~140 tokens of context.

One source, one build per instruction set (ISA_BUILDS, best first): AVX-512 VNNI, AVX2 with
AVX-VNNI, plain AVX2 + FMA. `kernels()` loads the best build this CPU can run, or the one
`INFERPLANE_NATIVE_ISA` names (how the tests run the AVX2 code on an AVX-512 machine);
`kernels_for(isa)` loads a given one. A C compiler is the only requirement (no PyTorch headers, so
a build takes about a second); libraries are cached under `INFERPLANE_NATIVE_DIR` (default
`~/.cache/inferplane/native`), keyed by the ISA, the source, the compiler and the CPU's flags.
Without a compiler, on another architecture, on an x86 CPU older than AVX2, or with
`INFERPLANE_NATIVE=0`, `kernels()` returns None and callers keep their PyTorch paths: the kernels
change speed, never results beyond float rounding.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels.c")
FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-Wall")
_X86_64_V3 = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"})
_X86_64_V4 = _X86_64_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
# ISA name -> (compiler flags, the /proc/cpuinfo flags it needs); best first.
ISA_BUILDS: dict[str, tuple[tuple[str, ...], frozenset[str]]] = {
    "avx512-vnni": (("-march=x86-64-v4", "-mavx512vnni"), _X86_64_V4 | {"avx512_vnni"}),
    "avx2-vnni": (("-march=x86-64-v3", "-mavxvnni"), _X86_64_V3 | {"avx_vnni"}),
    "avx2": (("-march=x86-64-v3",), _X86_64_V3),
}
# A GGUF block layout's name by its value bits (ip_block_linear reads each; see pack_blocks).
BLOCK_KINDS = {4: "q4_1", 5: "q5_1", 6: "q6_k", 8: "q8_0"}
# What each kernel is called in stats, metrics and bench output.
KERNEL_NAMES = ("int8_linear", *(f"{kind}_linear" for kind in BLOCK_KINDS.values()), "f32_linear",
                "decode_attention", "rms_norm", "silu_mul",
                "gelu_mul", "rope_store_kv", "argmax")
_FEATURE_INT8_LINEAR = 1
_FEATURE_F32_LINEAR = 2
_FEATURE_BLOCK_LINEAR = 4  # ip_block_linear: GGUF blocks of 4, 5, 6 or 8 bits
_FEATURE_HALF_KV = 8  # float16 KV caches (F16C)
BLOCK = 32  # inputs per GGUF block (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0; a K-quant's sub-block)
Q8_MIN = -128  # 8-bit blocks hold Q8_0's int8 values + 128, so m = Q8_MIN * d (kernels.c's QB_Q8_MIN)

_P, _I = ctypes.c_void_p, ctypes.c_int64


class LayerWeights(ctypes.Structure):
    """One decoder layer as ip_decode_layers reads it (kernels.c's ip_layer_weights): the norms, the
    four linears (qkv, o, gate_up, down) as packed int8 weight + scale, or GGUF blocks with a NULL
    scale and their `bits`, biases or NULL, the layer's K and V caches; Gemma's query/key and sandwich
    norms (NULL where none), a sliding layer's window, attention view and rope tables, and Gemma 2's
    score soft-cap (0: none; kernels.c says how)."""

    _fields_ = [("norm1", _P), ("norm2", _P), ("w", _P * 4), ("s", _P * 4), ("bias", _P * 4),
                ("k_cache", _P), ("v_cache", _P), ("q_norm", _P), ("k_norm", _P), ("norm3", _P), ("norm4", _P),
                ("window", _I), ("view", _I), ("rope", _I), ("bits", _I * 4), ("softcap", ctypes.c_float)]


class AttnView(ctypes.Structure):
    """kernels.c's ip_attn_view: one pool's slots, block tables and context lengths for a step."""

    _fields_ = [("slots", _P), ("block_tables", _P), ("context_lens", _P), ("max_blocks", _I)]


class RopeTables(ctypes.Structure):
    """kernels.c's ip_rope: cos and signed sin for each row's position."""

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
        lib.ip_argmax_rows.argtypes = [_P, _I, _I, _I, _P]
        lib.ip_argmax_rows.restype = None
        lib.ip_rope_store_kv.argtypes = [_P, _I, _I, _I, _I, _P, _P, _P, _P, _P, ctypes.c_int]
        lib.ip_rope_store_kv.restype = ctypes.c_int
        lib.ip_decode_layers.argtypes = [_P, _I, _I, _P, _I, ctypes.c_float, _I, _I, _I, _I, _P, _P, _I,
                                         ctypes.c_float, ctypes.c_int, ctypes.c_int]
        lib.ip_decode_layers.restype = ctypes.c_int
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
        return (self.has_f32_linear and x.device.type == "cpu" and x.dtype == torch.float32
                and weight.dtype == torch.float32 and weight.is_contiguous() and weight.shape[0] % 8 == 0)

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

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, N] float32 on the CPU (rows may be strided) -> int64 [M]: torch.argmax(x, dim=-1)'s
        answer (the first maximum; the first NaN where a row has one)."""
        m, n = x.shape
        if x.stride(1) != 1:
            x = x.contiguous()
        out = torch.empty(m, dtype=torch.int64)
        self._lib.ip_argmax_rows(x.data_ptr(), m, n, x.stride(0), out.data_ptr())
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
                      ropes: list[tuple[torch.Tensor, torch.Tensor]],
                      views: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], block_size: int, scale: float,
                      kv_half: bool = False, gelu: bool = False) -> None:
        """Consecutive decoder layers for decode rows in one call (ip_decode_layers), x [B, hidden]
        updated in place. `layers`: a ctypes array of LayerWeights (the caller keeps the tensors
        they point to alive); `shape`: (heads, kv_heads, head_dim, intermediate); `ropes`: the
        model's (cos, signed sin) and the sliding layers' own; `views`: (slots, block tables,
        context lengths) of the main pool and of the window pool (the layers' `rope` and `view`
        pick one of each); `kv_half`: the caches hold float16; `gelu`: the MLP is GeGLU."""
        b, hidden = x.shape
        heads, kv_heads, d, inter = shape
        rope_array = (RopeTables * 2)(*(RopeTables(c.data_ptr(), s.data_ptr()) for c, s in ropes))
        view_array = (AttnView * 2)(*(AttnView(slots.data_ptr(), tables.data_ptr(), lens.data_ptr(), tables.shape[1])
                                      for slots, tables, lens in views))
        rc = self._lib.ip_decode_layers(
            x.data_ptr(), b, hidden, ctypes.addressof(layers), len(layers), eps, heads, kv_heads, d, inter,
            ctypes.addressof(rope_array), ctypes.addressof(view_array), block_size, scale, int(kv_half), int(gelu))
        _check(rc, "ip_decode_layers")

    def reads_kv_cache(self, cache: torch.Tensor) -> bool:
        """Whether the attention and KV-store kernels read and write this cache: float32, or float16
        on builds with F16C; contiguous, on the CPU."""
        return (cache.device.type == "cpu" and cache.is_contiguous()
                and (cache.dtype == torch.float32 or (cache.dtype == torch.float16 and self.has_half_kv)))

    def decode_attention_applies(self, q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor,
                                 context_lens: torch.Tensor) -> bool:
        """Whether the tensors have the dtypes and layout the C kernel reads."""
        return (q.device.type == "cpu" and q.dtype == torch.float32 and self.reads_kv_cache(k_cache)
                and q.stride(2) == 1 and q.stride(1) == q.shape[2]
                and block_tables.dtype == torch.int64 and block_tables.is_contiguous()
                and context_lens.dtype == torch.int64 and context_lens.is_contiguous())


def float32_rows(*tensors: torch.Tensor) -> bool:
    """Whether every tensor is contiguous float32 on the CPU: what the element-wise kernels read."""
    return all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in tensors)


def _is_half(cache: torch.Tensor) -> int:
    return int(cache.dtype == torch.float16)


def _check(rc: int, name: str) -> None:
    if rc == -2:
        raise MemoryError(f"{name}: out of memory for its scratch buffers")
    if rc != 0:
        raise RuntimeError(f"{name} returned {rc}")


def int8_shape_supported(out_features: int, in_features: int) -> bool:
    """The packed layout holds 16 output channels x 4 inputs per 64-byte vector."""
    return out_features % 16 == 0 and in_features % 4 == 0


def pack_int8_weight(qweight: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> uint8 [N/16, K/4, 16, 4], value + 128: the order ip_int8_linear reads."""
    n, k = qweight.shape
    shifted = (qweight.to(torch.int16) + 128).to(torch.uint8)
    return shifted.view(n // 16, 16, k // 4, 4).permute(0, 2, 1, 3).contiguous()


def unpack_int8_weight(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_int8_weight."""
    nb, k4, _, _ = packed.shape
    return (packed.permute(0, 2, 1, 3).reshape(nb * 16, k4 * 4).to(torch.int16) - 128).to(torch.int8)


def block_shape_supported(out_features: int, in_features: int) -> bool:
    """The packed block layout holds groups of 16 output channels and blocks of 32 inputs."""
    return out_features % 16 == 0 and in_features % BLOCK == 0


def block_group_bytes(bits: int) -> int:
    """Bytes of one 16-channel group's block of 32 inputs in pack_blocks' layout: 4 chunks of 64
    bytes of low nibbles, 64 bytes of fifth bits (5 bits) or 128 of the top two (6 bits), or for 8
    bits 8 chunks of 64 whole bytes; then 16 float16 d and 16 float16 m (6 bits: 2 x 16 int8
    sub-block scales and 16 float16 d; 8 bits: the 16 d alone, m being -128 d)."""
    return {4: 256 + 64, 5: 256 + 64 + 64, 6: 256 + 128 + 64, 8: 512 + 32}[bits]


def pack_blocks(values: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bits: int) -> torch.Tensor:
    """A weight as blocks of 32: values uint8 [N, K] (< 2 ** bits) with d and m float16 [N, K / 32],
    w = d * q + m; or, for 6 bits (Q6_K's form), d float16 [N, K / 32] and m the int8 scales of the
    half-blocks [N, K / 16], w = d * m * (q - 32). -> uint8 [N / 16, K / 32, block_group_bytes(bits)],
    the order ip_block_linear reads: per group of 16 rows and block, 4 chunks of 64 bytes (byte
    ch * 4 + j holds the low 4 bits of input 8p + j in its low nibble and of 8p + 4 + j in its high
    one); for 5 bits 64 bytes whose byte ch * 4 + j holds bit 4 of input 4s + j in its bit s; for 6
    bits 2 planes of 64 bytes whose byte ch * 4 + j of plane h holds bits 4-5 of input 4(4h + t) + j
    in its bits 2t, 2t + 1; for 8 bits instead of all those 8 chunks of 64 bytes, byte ch * 4 + j of
    chunk s holding input 4s + j; then the 16 d and the 16 m (6 bits: the 16 first and the 16
    second half-block scales, then the 16 d; 8 bits, Q8_0's form with m = -128 d: the 16 d alone)."""
    if bits not in BLOCK_KINDS:
        raise ValueError(f"blocks of {bits} bits: the kernel reads {tuple(BLOCK_KINDS)}")
    if bits == 8 and not torch.equal(m, (d.float() * Q8_MIN).half()):
        raise ValueError("8-bit blocks are Q8_0's form: m must be -128 d")
    n, k = values.shape
    g, nb = n // 16, k // BLOCK
    steps = values.reshape(g, 16, nb, 8, 4).permute(0, 2, 3, 1, 4)  # [g, nb, step, ch, in]
    low = steps & 0x0F
    parts = [steps.reshape(g, nb, 512) if bits == 8 else (low[:, :, 0::2] | (low[:, :, 1::2] << 4)).reshape(g, nb, 256)]
    high = steps >> 4
    if bits == 5:
        plane = torch.zeros(g, nb, 16, 4, dtype=torch.uint8)
        for step in range(8):
            plane |= high[:, :, step] << step
        parts.append(plane.reshape(g, nb, 64))
    if bits == 6:
        planes = torch.zeros(g, nb, 2, 16, 4, dtype=torch.uint8)
        for step in range(8):
            planes[:, :, step // 4] |= high[:, :, step] << (2 * (step % 4))
        parts.append(planes.reshape(g, nb, 128))

    def by_group(t: torch.Tensor, per_block: int) -> torch.Tensor:  # [n, nb * per_block] -> [g, nb, ...]
        t = t.contiguous().view(torch.uint8).reshape(g, 16, nb, -1).permute(0, 2, 1, 3)
        return t.reshape(g, nb, 16, per_block, -1).transpose(2, 3).reshape(g, nb, -1)

    parts += {6: [by_group(m, 2), by_group(d, 1)], 8: [by_group(d, 1)]}.get(bits, [by_group(d, 1), by_group(m, 1)])
    return torch.cat(parts, dim=-1).contiguous()


def unpack_blocks(packed: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of pack_blocks: (values uint8 [N, K], d, m) as pack_blocks takes them."""
    groups, nb, _ = packed.shape
    if bits == 8:
        steps = packed[..., :512].reshape(groups, nb, 8, 16, 4)  # [g, nb, step, ch, in]
    else:
        nibbles = packed[..., :256].reshape(groups, nb, 4, 16, 4)  # [g, nb, chunk, ch, in]
        steps = torch.stack([nibbles & 0x0F, nibbles >> 4], dim=3).reshape(groups, nb, 8, 16, 4)
    shifts = torch.arange(8, dtype=torch.uint8).reshape(1, 1, 8, 1, 1)
    if bits == 5:
        plane = packed[..., 256:320].reshape(groups, nb, 1, 16, 4)
        steps = steps | (((plane >> shifts) & 1) << 4)
    if bits == 6:
        planes = packed[..., 256:384].reshape(groups, nb, 2, 1, 16, 4).expand(groups, nb, 2, 4, 16, 4)
        steps = steps | (((planes.reshape(groups, nb, 8, 16, 4) >> (2 * (shifts % 4))) & 3) << 4)
    values = steps.permute(0, 3, 1, 2, 4).reshape(groups * 16, nb * BLOCK)
    at = block_group_bytes(bits) - (32 if bits == 8 else 64)

    def by_row(raw: torch.Tensor, per_block: int, dtype: torch.dtype) -> torch.Tensor:
        t = raw.reshape(groups, nb, per_block, 16, -1).transpose(2, 3).permute(0, 2, 1, 3, 4)
        return t.contiguous().view(dtype).reshape(groups * 16, nb * per_block)

    if bits == 6:
        m, d = by_row(packed[..., at:at + 32], 2, torch.int8), by_row(packed[..., at + 32:], 1, torch.float16)
    elif bits == 8:
        d = by_row(packed[..., at:], 1, torch.float16)
        m = (d.float() * Q8_MIN).half()
    else:
        d, m = (by_row(packed[..., start:start + 32], 1, torch.float16) for start in (at, at + 32))
    return values.contiguous(), d, m


def _cache_dir() -> Path:
    return Path(os.environ.get("INFERPLANE_NATIVE_DIR") or Path.home() / ".cache" / "inferplane" / "native")


def _cpu_flags_line() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def cpu_flags() -> frozenset[str]:
    line = _cpu_flags_line()
    return frozenset(line.split(":", 1)[1].split()) if ":" in line else frozenset()


def supported_isas(flags: frozenset[str] | None = None) -> list[str]:
    """The builds this CPU can run, best first (none off x86-64)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    flags = cpu_flags() if flags is None else flags
    return [isa for isa, (_, needs) in ISA_BUILDS.items() if needs <= flags]


def _build(compiler: str, isa: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        partial = Path(tmp) / target.name
        cmd = [compiler, *FLAGS, *ISA_BUILDS[isa][0], str(SOURCE), "-o", str(partial), "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr.strip()[-2000:]}")
        os.replace(partial, target)  # atomic: workers starting together never load a half-written file


def library_path(compiler: str, isa: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(FLAGS + ISA_BUILDS[isa][0]), version,
                                    _cpu_flags_line(), platform.machine()]).encode()).hexdigest()[:16]
    return _cache_dir() / f"kernels-{isa}-{key}.so"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _load(isa: str) -> NativeKernels | None:
    compiler = _compiler()
    if compiler is None:
        log.warning("native kernels: no C compiler found (set CC); decode runs on PyTorch ops, slower")
        return None
    try:
        path = library_path(compiler, isa)
        if not path.exists():
            _build(compiler, isa, path)
        loaded = NativeKernels(ctypes.CDLL(str(path)), path)
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("native kernels unavailable, decode runs on PyTorch ops: %s", exc)
        return None
    if loaded.isa != isa:  # the compiler did not honour the flags: say so rather than mislabel
        log.warning("native kernels: asked for %s, the build reports %s", isa, loaded.isa)
    return loaded


@functools.cache
def kernels_for(isa: str) -> NativeKernels | None:
    """The build for one ISA (which this CPU must have); None where it cannot be built or run."""
    if isa not in ISA_BUILDS:
        raise ValueError(f"unknown ISA {isa!r}; known: {', '.join(ISA_BUILDS)}")
    if isa not in supported_isas():
        return None
    return _load(isa)


def chosen_isa() -> str | None:
    """The ISA `kernels()` loads: INFERPLANE_NATIVE_ISA where the CPU has it, else the best one."""
    available = supported_isas()
    wanted = os.environ.get("INFERPLANE_NATIVE_ISA", "").strip()
    if wanted:
        if wanted in available:
            return wanted
        log.warning("INFERPLANE_NATIVE_ISA=%s: %s; using %s", wanted,
                    "not an ISA this CPU has" if wanted in ISA_BUILDS else f"unknown (known: {', '.join(ISA_BUILDS)})",
                    available[0] if available else "PyTorch ops")
    return available[0] if available else None


@functools.cache
def kernels() -> NativeKernels | None:
    """The kernels for this machine, built on first use; None where they cannot be (logged once)."""
    if os.environ.get("INFERPLANE_NATIVE", "1") == "0":
        return None
    if platform.machine() not in ("x86_64", "AMD64"):
        log.info("native kernels: not built for %s; using PyTorch ops", platform.machine())
        return None
    isa = chosen_isa()
    if isa is None:
        log.warning("native kernels: this CPU lacks AVX2 + FMA; decode runs on PyTorch ops, slower")
        return None
    return _load(isa)


def kernel_isas() -> dict[str, str]:
    """Kernel name -> the ISA it runs on in this process ("torch": the PyTorch path)."""
    loaded = kernels()
    return loaded.kernel_isas() if loaded is not None else dict.fromkeys(KERNEL_NAMES, "torch")
