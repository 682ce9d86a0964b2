"""Tokenizer from a HF tokenizer.json or from GGUF metadata, plus the chat template and
incremental detokenization (text deltas that never split a multi-byte character)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from inferplane.worker.model.config import ModelLoadError, gguf_value

# ggml token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
_GGML_CONTROL = 3
_GGML_USER_DEFINED = 4


@dataclass
class TextTokenizer:
    tokenizer: Tokenizer
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    add_bos: bool = False
    special_ids: set[int] = field(default_factory=set)

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self.tokenizer.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return None if self.eos_token is None else self.tokenizer.token_to_id(self.eos_token)

    def encode(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def to_wire(self) -> dict:
        """The fields of worker.proto's InfoResponse that rebuild this tokenizer elsewhere."""
        return dict(tokenizer_json=self.tokenizer.to_str(), chat_template=self.chat_template or "",
                    bos_token=self.bos_token or "", eos_token=self.eos_token or "", add_bos=self.add_bos)

    @classmethod
    def from_wire(cls, info) -> TextTokenizer:
        tok = Tokenizer.from_str(info.tokenizer_json)
        specials = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
        return cls(tokenizer=tok, chat_template=info.chat_template or None, bos_token=info.bos_token or None,
                   eos_token=info.eos_token or None, add_bos=info.add_bos, special_ids=specials)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or "role" not in message or "content" not in message:
                raise ValueError(f"messages[{i}] must have 'role' and 'content'")
        return _render_chat(self.chat_template, messages, add_generation_prompt, self.bos_token, self.eos_token)


def _render_chat(template: str, messages, add_generation_prompt: bool, bos: str | None, eos: str | None) -> str:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise ValueError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(
        messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos or "", eos_token=eos or ""
    )


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


class IncrementalDetokenizer:
    """Emits text deltas as tokens arrive. Decoding a short window (not the whole output) keeps
    each step cheap; a delta ending in U+FFFD waits for the rest of its UTF-8 bytes."""

    def __init__(self, tokenizer: TextTokenizer, prompt_ids: Sequence[int]):
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_ids[-6:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.text += delta
            return delta
        return ""
