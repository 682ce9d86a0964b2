"""Loading a model's tokenizer: from a HF folder (tokenizer.json, tokenizer_config.json) or from
GGUF metadata. The tokenizer itself is `inferplane.api.tokenizer.TextTokenizer`, shared with the
gateway."""

from __future__ import annotations

import json
import os

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from inferplane.api.tokenizer import TextTokenizer
from inferplane.worker.model.config import ModelLoadError, gguf_value

# ggml token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
_GGML_CONTROL = 3
_GGML_USER_DEFINED = 4


def _token_content(entry) -> str | None:
    if entry is None:
        return None
    return entry["content"] if isinstance(entry, dict) else str(entry)


def load_hf_tokenizer(folder: str) -> TextTokenizer:
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.exists(path):
        raise ModelLoadError(f"{folder} has no tokenizer.json")
    tok = Tokenizer.from_file(path)
    cfg = {}
    cfg_path = os.path.join(folder, "tokenizer_config.json")
    if os.path.exists(cfg_path):
        with open(cfg_path) as f:
            cfg = json.load(f)
    template = cfg.get("chat_template")
    template_file = os.path.join(folder, "chat_template.jinja")
    if template is None and os.path.exists(template_file):
        with open(template_file) as f:
            template = f.read()
    specials: set[int] = set()
    for token_id, added in tok.get_added_tokens_decoder().items():
        if added.special:
            specials.add(token_id)
    return TextTokenizer(
        tokenizer=tok,
        chat_template=template,
        bos_token=_token_content(cfg.get("bos_token")),
        eos_token=_token_content(cfg.get("eos_token")),
        add_bos=bool(cfg.get("add_bos_token", False)),
        special_ids=specials,
    )


def load_gguf_tokenizer(reader) -> TextTokenizer:
    kind = gguf_value(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(f"GGUF tokenizer model {kind!r} is not supported (supported: gpt2 byte-level BPE)")
    tokens: list[str] = gguf_value(reader, "tokenizer.ggml.tokens")
    types: list[int] = gguf_value(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in gguf_value(reader, "tokenizer.ggml.merges")]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    # llama.cpp's pre-tokenizers of the starcoder family (smollm among them) split every digit.
    if gguf_value(reader, "tokenizer.ggml.pre") in ("smollm", "starcoder", "refact", "codeshell"):
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    special = [i for i, t in enumerate(types) if t in (_GGML_CONTROL, _GGML_USER_DEFINED)]
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in special])
    bos = gguf_value(reader, "tokenizer.ggml.bos_token_id")
    eos = gguf_value(reader, "tokenizer.ggml.eos_token_id")
    return TextTokenizer(
        tokenizer=tok,
        chat_template=gguf_value(reader, "tokenizer.chat_template"),
        bos_token=None if bos is None else tokens[bos],
        eos_token=None if eos is None else tokens[eos],
        add_bos=bool(gguf_value(reader, "tokenizer.ggml.add_bos_token", False)),
        special_ids=set(special),
    )
