"""The most input bytes one token of a tokenizer can stand for, when there is such a most.

Why: a prompt with more (counted) UTF-8 bytes than the model's context length times this many
cannot fit, so it is a 400 without tokenizing it (issue 53: megabyte prompts took seconds each to
tokenize only to be refused). The bound must never refuse a prompt that fits, so it is given only
for tokenizers that cannot make input vanish, as their own pipeline says:

- model BPE in which every byte of UTF-8 text has a token: a ByteLevel pre-tokenizer (GPT-2,
  Llama 3, Qwen, SmolLM2), or `byte_fallback` with the `<0xXX>` tokens (SentencePiece conversions:
  Llama 2, Gemma, Mistral). Otherwise an unknown run of characters may become one unknown token
  (`fuse_unk`) or nothing. A ByteLevel vocabulary may lack a few bytes' symbols (SmolLM2 has none
  for 0x04 or 0xF1): those bytes become nothing, so they are not counted (`vanishing`), which
  holds only where no normalizer changes the bytes first;
- a pre-tokenizer that only splits (ByteLevel, Metaspace, Split, Digits, Punctuation,
  UnicodeScripts, not with behavior "removed"): Whitespace, WhitespaceSplit and BERT's drop
  whitespace (a million spaces are no tokens);
- normalizers that never delete: Replace of a fixed string by one no shorter, Prepend, ByteLevel;
  Unicode normalization (NFC, NFD, NFKC, NFKD) and Lowercase shrink a text by at most 4x (a 4-byte
  mathematical letter to its 1-byte ASCII form is the worst case), and are counted so. Strip,
  StripAccents, BertNormalizer, Precompiled (SentencePiece's charsmap) and regex replacements can
  delete any amount: no bound;
- no added token with `lstrip` or `rstrip` (it swallows any run of whitespace); no truncation.

Then a token stands for at most its longest vocabulary entry's bytes: a ByteLevel entry's
characters (one per byte), another entry's UTF-8 (`▁`, 3 bytes, stands for a 1-byte space;
`<0xE2>`, 6, for one byte), an added token's content; times the normalizers' shrink. Anything else
(WordPiece, Unigram, WordLevel, a step not listed): None, and the prompt is tokenized to be counted.
"""

from __future__ import annotations

import json
import threading
import weakref
from dataclasses import dataclass
from typing import Any

from inferplane.api.tokenizer import TextTokenizer

_UNICODE_SHRINK = 4
_SPLITTING = {"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation", "UnicodeScripts"}
NOT_IN_UTF8 = frozenset([0xC0, 0xC1, *range(0xF5, 0x100)])  # bytes UTF-8 text never holds


@dataclass(frozen=True)
class ByteBound:
    per_token: int  # the most input bytes one token stands for
    vanishing: bytes = b""  # byte values no token stands for: not counted

    def min_tokens(self, text: str) -> int:
        """Fewer tokens than this the text cannot become."""
        data = text.encode("utf-8", "surrogatepass")
        counted = len(data) - sum(data.count(b) for b in self.vanishing)
        return -(-counted // self.per_token)

    def cannot_fit(self, text: str, tokens: int) -> bool:
        """Whether the text is sure to be more than `tokens` tokens (cheap: no tokenizing)."""
        if len(text) * 4 <= tokens * self.per_token:  # UTF-8 is at most 4 bytes a character
            return False
        return self.min_tokens(text) > tokens


_cache: dict[int, tuple[weakref.ref, ByteBound | None]] = {}
_lock = threading.Lock()


def byte_bound(tokenizer: TextTokenizer) -> ByteBound | None:
    """The bound for this tokenizer (None: none holds), worked out once per tokenizer object (a
    pass over its vocabulary: tens of milliseconds for 260,000 entries)."""
    key = id(tokenizer)
    with _lock:
        cached = _cache.get(key)
        if cached is not None and cached[0]() is tokenizer:
            return cached[1]
    tok = tokenizer.tokenizer
    spec = {"model": type(tok.model).__name__, "byte_fallback": getattr(tok.model, "byte_fallback", False),
            "normalizer": _state(tok.normalizer), "pre_tokenizer": _state(tok.pre_tokenizer),
            "truncation": tok.truncation,
            "added": [(t.content, t.lstrip or t.rstrip) for t in tok.get_added_tokens_decoder().values()]}
    bound = bound_of(spec, tok.get_vocab(with_added_tokens=False))
    with _lock:
        _cache[key] = (weakref.ref(tokenizer, lambda _, key=key: _cache.pop(key, None)), bound)
    return bound


def _state(part: Any) -> dict | None:
    """A pipeline step as its tokenizer.json entry (what `tokenizers` pickles it as)."""
    return None if part is None else json.loads(part.__getstate__())


def bound_of(spec: dict[str, Any], vocab: dict[str, int]) -> ByteBound | None:
    """The bound from a tokenizer's parts: `model` (its type's name), `byte_fallback`, `normalizer`
    and `pre_tokenizer` (tokenizer.json entries), `truncation`, `added` ((content, strips) pairs)."""
    if spec["model"] != "BPE" or spec.get("truncation") or any(strips for _, strips in spec["added"]):
        return None
    pre = spec.get("pre_tokenizer")
    if not all(p.get("type") in _SPLITTING and str(p.get("behavior", "")).lower() != "removed" for p in _parts(pre)):
        return None
    shrink = _shrink(spec.get("normalizer"))
    if shrink is None:
        return None
    added = max((len(content.encode()) for content, _ in spec["added"]), default=1)
    if any(p.get("type") == "ByteLevel" for p in _parts(pre)):
        from tokenizers import pre_tokenizers

        symbols = _byte_symbols(pre_tokenizers.ByteLevel.alphabet())
        vanishing = bytes(b for b, s in symbols.items() if s not in vocab and b not in NOT_IN_UTF8)
        if vanishing and spec.get("normalizer") is not None:
            return None
        longest = max((len(s) for s in vocab), default=1)  # one character per byte
        return ByteBound(max(longest, added) * shrink, vanishing)
    if spec.get("byte_fallback") and all(f"<0x{b:02X}>" in vocab for b in range(256) if b not in NOT_IN_UTF8):
        longest = max((len(s.encode()) for s in vocab), default=1)
        return ByteBound(max(longest, added) * shrink)
    return None


def _byte_symbols(alphabet: list[str]) -> dict[int, str]:
    """GPT-2's byte → character map (as ByteLevel encodes): printable Latin-1 bytes are themselves,
    the other 68 bytes are U+0100 on in byte order."""
    printable = sorted(ord(c) for c in alphabet if ord(c) < 256)
    others = [b for b in range(256) if b not in set(printable)]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def _parts(node: dict | None) -> list[dict]:
    """A pipeline step, or the steps of a Sequence, flattened."""
    if node is None:
        return []
    if node.get("type") == "Sequence":
        steps = node.get("pretokenizers") or node.get("normalizers") or []
        return [part for step in steps for part in _parts(step)]
    return [node]


def _shrink(normalizer: dict | None) -> int | None:
    """How many times shorter in bytes the normalizers can make a text (None: to nothing)."""
    factor = 1
    for part in _parts(normalizer):
        kind = part.get("type")
        if kind in ("Prepend", "ByteLevel"):
            continue
        if kind in ("NFC", "NFD", "NFKC", "NFKD", "Lowercase"):
            factor *= _UNICODE_SHRINK
        elif kind == "Replace":
            pattern = (part.get("pattern") or {}).get("String")
            if not pattern or len((part.get("content") or "").encode()) < len(pattern.encode()):
                return None  # a regex, or a string replaced by a shorter one (an empty one: deleted)
        else:
            return None
    return factor
