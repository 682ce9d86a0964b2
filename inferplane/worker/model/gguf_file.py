"""Reading GGUF files: metadata → ModelConfig, tensors → float torch tensors in HF naming.

The dequantizers are our own (a few lines each, vectorised in torch) so that the set of supported
tensor types is explicit: anything else fails with an error that names the type.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import torch

from inferplane.worker.model.config import SUPPORTED_ARCHITECTURES, ModelConfig, ModelLoadError, gguf_value

# Block layouts (ggml): Q4_0 = f16 scale + 16 bytes of nibbles (32 weights);
# Q4_1 = f16 scale + f16 min + 16 bytes; Q8_0 = f16 scale + 32 int8; Q4_K: see _dequant_q4_k.
_BLOCK = 32


def _dequant_q8_0(raw: np.ndarray) -> torch.Tensor:
    blocks = torch.from_numpy(raw.reshape(-1, 34).copy())
    scale = blocks[:, :2].contiguous().view(torch.float16).float()
    q = blocks[:, 2:].contiguous().view(torch.int8).float()
    return q * scale


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    # ggml stores the low nibbles of all 16 bytes first, then the high nibbles.
    low = packed & 0x0F
    high = packed >> 4
    return torch.cat([low, high], dim=1).float()


def _dequant_q4_0(raw: np.ndarray) -> torch.Tensor:
    blocks = torch.from_numpy(raw.reshape(-1, 18).copy())
    scale = blocks[:, :2].contiguous().view(torch.float16).float()
    return (_nibbles(blocks[:, 2:]) - 8.0) * scale


def _dequant_q4_1(raw: np.ndarray) -> torch.Tensor:
    blocks = torch.from_numpy(raw.reshape(-1, 20).copy())
    scale = blocks[:, :2].contiguous().view(torch.float16).float()
    minimum = blocks[:, 2:4].contiguous().view(torch.float16).float()
    return _nibbles(blocks[:, 4:]) * scale + minimum


def q4_k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 12 bytes of 6-bit (scale, min) pairs -> [..., 8] scales and mins (ggml's get_scale_min_k4)."""
    s = packed.to(torch.int32)
    first, second, third = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    scales = torch.cat([first & 63, (third & 0xF) | ((first >> 6) << 4)], dim=-1)
    mins = torch.cat([second & 63, (third >> 4) | ((second >> 6) << 4)], dim=-1)
    return scales, mins


def q4_k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K's 128 bytes -> [..., 8, 32] values: blocks 2k and 2k + 1 are the low and high nibbles of
    the same 32 bytes."""
    chunks = qs.reshape(*qs.shape[:-1], 4, 32)
    return torch.stack([chunks & 0x0F, chunks >> 4], dim=-2).reshape(*qs.shape[:-1], 8, 32)


def _dequant_q4_k(raw: np.ndarray) -> torch.Tensor:
    # Super-blocks of 256: f16 d, f16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles;
    # w = d * scale_j * q - dmin * min_j for block j of 32.
    blocks = torch.from_numpy(raw.reshape(-1, 144).copy())
    d = blocks[:, :2].contiguous().view(torch.float16).float()
    dmin = blocks[:, 2:4].contiguous().view(torch.float16).float()
    scales, mins = q4_k_scales(blocks[:, 4:16])
    values = q4_k_nibbles(blocks[:, 16:]).float()
    return values * (d * scales.float())[..., None] - (dmin * mins.float())[..., None]


_QUANTIZED = {"Q8_0": _dequant_q8_0, "Q4_0": _dequant_q4_0, "Q4_1": _dequant_q4_1, "Q4_K": _dequant_q4_k}


def dequantize(type_name: str, raw: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
    """Returns a float32 tensor of `shape` (rows first, as PyTorch orders a weight)."""
    if type_name == "F32":
        return torch.from_numpy(np.array(raw, dtype=np.float32)).reshape(shape)
    if type_name == "F16":
        return torch.from_numpy(np.array(raw).view(np.float16)).float().reshape(shape)
    if type_name == "BF16":
        as_int = torch.from_numpy(np.array(raw).view(np.int16))
        return as_int.view(torch.bfloat16).float().reshape(shape)
    if type_name in _QUANTIZED:
        return _QUANTIZED[type_name](np.asarray(raw).view(np.uint8)).reshape(shape)
    raise ModelLoadError(
        f"GGUF tensor type {type_name} is not supported (supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K)"
    )


def open_gguf(path: str):
    """The file's reader, shared within the process while the file is unchanged: gguf.GGUFReader
    parses every metadata field up front (2.7 s for SmolLM2's 49k-token vocabulary on this
    project's machine), and loading the model, its tokenizer and its Q8_0 blocks all read it."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from exc
    return _open_gguf(os.path.realpath(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _open_gguf(path: str, _size: int, _mtime_ns: int):
    try:
        return _fast_reader_class()(path)
    except Exception as exc:  # the reader raises assorted errors on a corrupt file
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from exc


@functools.cache
def _fast_reader_class():
    """gguf.GGUFReader with metadata arrays read in one pass each.

    The stock reader makes a numpy view per array element (two per string) and joins them again
    on every `contents()`: 2.7 s for SmolLM2's vocabulary and merges, most of a CPU worker's
    start-up. Here an array of strings or numbers becomes one Python list as it is read; every
    other field, the tensor table and the tensor data are the stock reader's own.
    """
    import gguf
    from gguf.gguf_reader import ReaderField

    class ParsedArrayField:
        """Duck-types ReaderField (a NamedTuple, so not extended) for a parsed array."""

        def __init__(self, offset: int, name: str, types: list, value: list):
            self.offset, self.name, self.parts, self.types = offset, name, [], types
            self.data = range(len(value))
            self.value = value

        def contents(self, index_or_slice: int | slice = slice(None)):
            return self.value[index_or_slice]

    array, string = gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING

    class FastGGUFReader(gguf.GGUFReader):
        def _build_fields(self, offs: int, count: int) -> int:
            if self.byte_order != "I":  # a file of the other byte order: the stock parser handles it
                return super()._build_fields(offs, count)
            raw = memoryview(self.data)
            first, known = offs, list(self.fields)
            for _ in range(count):
                start = offs
                key_len = int.from_bytes(raw[offs:offs + 8], "little")
                key = bytes(raw[offs + 8:offs + 8 + key_len]).decode("utf-8")
                kind = int.from_bytes(raw[offs + 8 + key_len:offs + 12 + key_len], "little")
                after_type = offs + 12 + key_len
                if kind != array:
                    field_size, parts, idxs, types = self._get_field_parts(after_type, kind)
                    head = [self._get(offs, np.uint64), self._get(offs + 8, np.uint8, key_len),
                            self._get(after_type - 4, np.uint32)]
                    self._push_field(ReaderField(start, key, head + parts, [i + 3 for i in idxs], types),
                                     skip_sum=True)
                    offs = after_type + field_size
                    continue
                item = int.from_bytes(raw[after_type:after_type + 4], "little")
                n = int.from_bytes(raw[after_type + 4:after_type + 12], "little")
                offs = after_type + 12
                if item == string:
                    values = []
                    for _ in range(n):
                        size = int.from_bytes(raw[offs:offs + 8], "little")
                        values.append(bytes(raw[offs + 8:offs + 8 + size]).decode("utf-8"))
                        offs += 8 + size
                elif item in self.gguf_scalar_to_np:
                    dtype = np.dtype(self.gguf_scalar_to_np[gguf.GGUFValueType(item)])
                    values = np.frombuffer(self.data, dtype=dtype, count=n, offset=offs).tolist()
                    offs += n * dtype.itemsize
                else:  # arrays of arrays: none in the models served here; the stock parser reads them
                    for name in list(self.fields)[len(known):]:
                        del self.fields[name]
                    return super()._build_fields(first, count)
                self._push_field(ParsedArrayField(start, key, [array, gguf.GGUFValueType(item)], values),
                                 skip_sum=True)
            return offs

    return FastGGUFReader


def config_from_gguf(reader) -> ModelConfig:
    arch = gguf_value(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"unsupported GGUF architecture {arch!r}")
    p = f"{arch}."
    heads = int(gguf_value(reader, p + "attention.head_count"))
    hidden = int(gguf_value(reader, p + "embedding_length"))
    vocab = gguf_value(reader, p + "vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    names = {t.name for t in reader.tensors}
    scaling = None
    scaling_type = gguf_value(reader, p + "rope.scaling.type")
    if scaling_type and scaling_type != "none":
        scaling = {"rope_type": scaling_type, "factor": float(gguf_value(reader, p + "rope.scaling.factor", 1.0))}
    eos = gguf_value(reader, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(gguf_value(reader, p + "feed_forward_length")),
        num_layers=int(gguf_value(reader, p + "block_count")),
        num_heads=heads,
        num_kv_heads=int(gguf_value(reader, p + "attention.head_count_kv", heads)),
        head_dim=int(gguf_value(reader, p + "attention.key_length", hidden // heads)),
        rms_norm_eps=float(gguf_value(reader, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(gguf_value(reader, p + "rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(gguf_value(reader, p + "context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        bos_token_id=gguf_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
    )


_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    raise ModelLoadError(f"unexpected GGUF tensor {gguf_name!r}")


def _unpermute_rope(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's converter interleaves the rotary halves of q/k rows (its RoPE pairs adjacent
    elements); HF-style rotate_half pairs the two halves, so the rows are put back."""
    out = weight.shape[0]
    rest = weight.shape[1:]
    return weight.reshape(n_heads, out // n_heads // 2, 2, *rest).transpose(1, 2).reshape(out, *rest)


def load_gguf_tensors(reader, config: ModelConfig):
    """Yields (hf_name, float32 tensor) for every tensor in the file."""
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        tensor = dequantize(t.tensor_type.name, t.data, shape)
        name = hf_name(t.name)
        if config.architecture in ("llama", "mistral"):
            if name.endswith("q_proj.weight") or name.endswith("q_proj.bias"):
                tensor = _unpermute_rope(tensor, config.num_heads)
            elif name.endswith("k_proj.weight") or name.endswith("k_proj.bias"):
                tensor = _unpermute_rope(tensor, config.num_kv_heads)
        yield name, tensor
