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
from typing import Any

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
        # encode_batch, not encode: the same ids, but it releases the interpreter lock while it
        # works, so a megabyte prompt tokenized on a thread does not stop the caller's event loop
        # for the second it takes (`Tokenizer.encode` holds the lock throughout).
        ids = self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids
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
                            tools: list[dict] | None = None, template_kwargs: dict[str, Any] | None = None) -> str:
        """The prompt text; `tools` (OpenAI's tool objects) go to templates that render them.
        `template_kwargs` become template variables, as transformers' `apply_chat_template(**kwargs)`
        makes them (Qwen3's `enable_thinking`), except the names this renderer sets itself."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        check_template_kwargs(template_kwargs)
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or "role" not in message or "content" not in message:
                raise ValueError(f"messages[{i}] must have 'role' and 'content'")
        return _render_chat(self.chat_template, messages, add_generation_prompt, self.bos_token, self.eos_token,
                            tools, template_kwargs)


# The variables `_render_chat` sets, and the globals of its environment (`raise_exception` and
# Jinja's own: range, namespace, ...): a caller's template variables may not replace them, since a
# template relies on them (a `bos_token` or `messages` sent in a request would rewrite the prompt
# around the messages' own checks, a string named `namespace` would break the template).
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token", "tools"})


def reserved_template_variable(name: str) -> bool:
    """Whether a caller may not set `name` (the gateway's request model refuses it with a 400)."""
    return name in RESERVED_TEMPLATE_VARIABLES or name in _chat_environment().globals


def check_template_kwargs(template_kwargs: dict[str, Any] | None) -> None:
    """ValueError naming `chat_template_kwargs.<name>` for a variable that is not a string or is
    one the renderer sets itself; values are the template's business (transformers passes them as they are)."""
    if template_kwargs is None:
        return
    if not isinstance(template_kwargs, dict):
        raise ValueError("chat_template_kwargs: must be an object of template variables, "
                         f"got {type(template_kwargs).__name__}")
    for name in template_kwargs:
        if not isinstance(name, str):
            raise ValueError(f"chat_template_kwargs: variable names must be strings, got {name!r}")
        if reserved_template_variable(name):
            raise ValueError(f"chat_template_kwargs.{name}: set by the server's chat template renderer; "
                             "it cannot be overridden")


def _raise_exception(message: str):
    raise ValueError(f"chat template: {message}")


@functools.lru_cache(maxsize=1)
def _chat_environment():
    """The one sandbox every chat template compiles in (its globals are the reserved names' other half).

    It offers what transformers' renderer offers, so that a model's template renders as it does
    there: `{% break %}`/`{% continue %}`, `strftime_now` (Llama 3.x's date line) and a `tojson` that
    keeps key order and non-ASCII text (Jinja's own sorts keys and escapes `<`, which changes the
    tool lists Qwen and Hermes templates print)."""
    import datetime
    import json

    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


@functools.lru_cache(maxsize=64)
def _compiled_chat(template: str):
    """The template compiled once: compiling took milliseconds of the gateway's event loop per chat
    request, rendering takes microseconds. (A compiled jinja2 template renders safely from any thread.)"""
    return _chat_environment().from_string(template)


def _render_chat(template: str, messages, add_generation_prompt: bool, bos: str | None, eos: str | None,
                 tools: list[dict] | None = None, template_kwargs: dict[str, Any] | None = None) -> str:
    """A template that fails on what a request gave it (a variable of a type it cannot use, a message
    it cannot read) is the request's ValueError, a 400, not the server's crash."""
    from jinja2 import TemplateError

    # The renderer's own variables last, so that they win over a caller's (check_template_kwargs
    # refuses those names first, naming them).
    context = {**(template_kwargs or {}), "messages": messages, "add_generation_prompt": add_generation_prompt,
               "bos_token": bos or "", "eos_token": eos or "", "tools": tools or None}
    try:
        return _compiled_chat(template).render(context)
    except (TemplateError, TypeError) as exc:
        raise ValueError(f"chat template: could not render the request: {exc}") from exc


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
