"""The weight layouts the C kernels read, packed once at load time: int8 weights as 16 output channels
x 4 inputs per 64-byte vector, and GGUF-style blocks of 32 inputs (4, 5, 6 or 8 value bits) per
group of 16 output channels. Pure PyTorch: packing needs no compiler, and unpacking is the
reference the kernels are tested against.
"""

from __future__ import annotations

import torch

# A GGUF block layout's name by its value bits (ip_block_linear reads each; see pack_blocks).
BLOCK_KINDS = {4: "q4_1", 5: "q5_1", 6: "q6_k", 8: "q8_0"}
BLOCK = 32  # inputs per GGUF block (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0; a K-quant's sub-block)
Q8_MIN = -128  # 8-bit blocks hold Q8_0's int8 values + 128, so m = Q8_MIN * d (block_linear.c's QB_Q8_MIN)


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
