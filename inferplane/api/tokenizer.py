"""The text side of a model that the gateway and the worker share: a tokenizer (built from the
HF `tokenizers` JSON, so it crosses the wire in worker.proto's InfoResponse), its chat template,
and incremental detokenization (text deltas that never split a multi-byte character).

Loading one from a model's files is the worker's job (`inferplane.worker.model.tokenizer`); the
gateway rebuilds it from what the worker sends (`TextTokenizer.from_wire`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenizers import Tokenizer


@dataclass
class TextTokenizer:
    tokenizer: Tokenizer
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    add_bos: bool = False
    special_ids: set[int] = field(default_factory=set)
    # token_text's answers: at most one per id of the vocabulary.
    _token_texts: dict[int, str] = field(default_factory=dict, init=False, repr=False, compare=False)

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

    def encode_inputs(self, texts: Sequence[str]) -> list[list[int]]:
        """Whole inputs as an encoder model reads them: each text with the special tokens the
        tokenizer's post-processor adds ([CLS] ... [SEP] for BERT), as sentence-transformers
        encodes; unlike `encode`, whose prompt a generator continues. One batched call: the
        tokenizer's Rust side spreads a long list over threads."""
        return [e.ids for e in self.tokenizer.encode_batch(list(texts), add_special_tokens=True)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One id decoded on its own, special tokens included: how logprobs name a token. Cached,
        since an answer with top logprobs names millions of tokens from a few thousand ids."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if token_id < self.tokenizer.get_vocab_size(with_added_tokens=True):  # not an id it does not know
                self._token_texts[token_id] = text
        return text

    def to_wire(self) -> dict:
        """The fields of worker.proto's InfoResponse that rebuild this tokenizer elsewhere."""
        return dict(tokenizer_json=self.tokenizer.to_str(), chat_template=self.chat_template or "",
                    bos_token=self.bos_token or "", eos_token=self.eos_token or "", add_bos=self.add_bos)

    @classmethod
    def from_wire(cls, info) -> TextTokenizer:
        tok = Tokenizer.from_str(info.tokenizer_json)
        # A tokenizer.json exported for training may pad to a fixed length or truncate silently
        # (sentence-transformers' often do); a request's tokens are its own, never padded or cut.
        tok.no_padding()
        tok.no_truncation()
        specials = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
        return cls(tokenizer=tok, chat_template=info.chat_template or None, bos_token=info.bos_token or None,
                   eos_token=info.eos_token or None, add_bos=info.add_bos, special_ids=specials)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        """The prompt text; `tools` (OpenAI's tool objects) go to templates that render them."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or "role" not in message or "content" not in message:
                raise ValueError(f"messages[{i}] must have 'role' and 'content'")
        return _render_chat(self.chat_template, messages, add_generation_prompt, self.bos_token, self.eos_token,
                            tools)


def _raise_exception(message: str):
    raise ValueError(f"chat template: {message}")


@functools.lru_cache(maxsize=64)
def _compiled_chat(template: str):
    """The template compiled once: compiling took milliseconds of the gateway's event loop per chat
    request, rendering takes microseconds. (A compiled jinja2 template renders safely from any thread.)"""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(template)


def _render_chat(template: str, messages, add_generation_prompt: bool, bos: str | None, eos: str | None,
                 tools: list[dict] | None = None) -> str:
    return _compiled_chat(template).render(
        messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos or "", eos_token=eos or "",
        tools=tools or None,
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
