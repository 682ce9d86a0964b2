"""Loading a model's tokenizer: from a HF folder (tokenizer.json, tokenizer_config.json) or from
GGUF metadata. The tokenizer itself is `inferplane.api.tokenizer.TextTokenizer`, shared with the
gateway."""

from __future__ import annotations

import array
import functools
import hashlib
import json
import os
from pathlib import Path

import tokenizers
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

from inferplane.api.model_config import ModelLoadError, gguf_value
from inferplane.api.tokenizer import TextTokenizer

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
    """The tokenizer a GGUF file describes in its metadata, built as HF transformers builds it
    (`transformers.integrations.gguf.gguf_tokenizer_mapping`, the tests' oracle):
    `tokenizer.ggml.model` "gpt2" is byte-level BPE; "llama" is SentencePiece BPE with byte
    fallback, under Gemma's rules for gemma/gemma2/gemma3, phi3's for phi3 and Llama's otherwise."""
    kind = gguf_value(reader, "tokenizer.ggml.model")
    if kind == "gpt2":
        return _byte_level_bpe(reader)
    if kind == "llama":
        return _sentencepiece_bpe(reader)
    raise ModelLoadError(
        f"GGUF tokenizer model {kind!r} is not supported (supported: gpt2 byte-level BPE, llama SentencePiece BPE)"
    )


def _text_tokenizer(reader, tok: Tokenizer, tokens: list[str], add_bos: bool) -> TextTokenizer:
    bos = gguf_value(reader, "tokenizer.ggml.bos_token_id")
    eos = gguf_value(reader, "tokenizer.ggml.eos_token_id")
    return TextTokenizer(
        tokenizer=tok,
        chat_template=gguf_value(reader, "tokenizer.chat_template"),
        bos_token=None if bos is None or bos >= len(tokens) else tokens[bos],
        eos_token=None if eos is None or eos >= len(tokens) else tokens[eos],
        add_bos=add_bos,
        special_ids={i for i, t in tok.get_added_tokens_decoder().items() if t.special},
    )


def _byte_level_bpe(reader) -> TextTokenizer:
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
    return _text_tokenizer(reader, tok, tokens, bool(gguf_value(reader, "tokenizer.ggml.add_bos_token", False)))


# SentencePiece files ("llama" tokenizer model), under the rules transformers 5 applies to them:
#  - Gemma (its GemmaTokenizer): normalizer " " -> "\u2581", no prefix space; a token of two or
#    more spaces is stored with real spaces and is respelled "\u2581\u2581..."; the file has no
#    merges, so they are rebuilt from the vocabulary and ranked by position in the file (Gemma's
#    scores do not follow its merge order).
#  - Llama (LlamaTokenizer, legacy=False): a Metaspace pre-tokenizer that prefixes "\u2581" to
#    the text's first piece only, a decoder that strips that one space; merges from the file, or
#    rebuilt from the vocabulary ranked by score. (transformers ignores add_space_prefix; so do we.)
#  - phi3: as Llama, but the prefix comes from a normalizer, so every piece between added tokens
#    gets one, and there is no pre-tokenizer.
# All: BPE with byte fallback (<0xE2> tokens, fused back into UTF-8 by the decoder); control
# tokens and the tokenizer class's named ones added as special tokens; user-defined ones (Gemma's
# "\n\n", "<table>") added whole but not special, so skip_special_tokens keeps them.
_GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")
# The named tokens transformers' tokenizer class adds as special when it builds one (when in the vocabulary).
_CLASS_SPECIAL_TOKENS = {"gemma": ("<unk>", "<bos>", "<eos>", "<pad>", "<mask>"), "llama": ("<unk>", "<s>", "</s>")}


def _sentencepiece_bpe(reader) -> TextTokenizer:
    architecture = gguf_value(reader, "general.architecture")
    rules = "gemma" if architecture in _GEMMA_ARCHITECTURES else "phi3" if architecture == "phi3" else "llama"
    tokens: list[str] = gguf_value(reader, "tokenizer.ggml.tokens")
    types: list[int] = gguf_value(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    merges: list[str] | None = gguf_value(reader, "tokenizer.ggml.merges")
    scores: list[float] | None = None if merges is not None or rules == "gemma" else (
        gguf_value(reader, "tokenizer.ggml.scores") or [0.0] * len(tokens))
    named = [gguf_value(reader, f"tokenizer.ggml.{key}_token_id") for key in ("bos", "eos", "unknown", "padding")]
    build = functools.partial(_build_sentencepiece, rules, tokens, types, merges, scores, named)
    # Only a vocabulary without merges is slow to build (its merges are rebuilt in Python).
    tok = build() if merges is not None else _cached_build(build, rules, tokens, types, scores, named)
    # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise; so does transformers.
    return _text_tokenizer(reader, tok, tokens, bool(gguf_value(reader, "tokenizer.ggml.add_bos_token", True)))


def _build_sentencepiece(rules: str, tokens: list[str], types: list[int], merges: list[str] | None,
                         scores: list[float] | None, named_ids: list[int | None]) -> Tokenizer:
    spelled = tokens
    if rules == "gemma":
        spelled = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}
    if merges is not None:
        pairs = [tuple(m.split(" ")) for m in merges]
    elif rules == "gemma":
        pairs = _merges_from_vocab(vocab, {t: -i for i, t in enumerate(spelled)})
    else:
        pairs = _merges_from_vocab(vocab, dict(zip(spelled, scores, strict=False)))

    if rules == "gemma":
        tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
        tok.normalizer = normalizers.Replace(" ", "\u2581")
        tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
        tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    else:
        tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=True, byte_fallback=True))
        if rules == "phi3":
            tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
        else:
            tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
        tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(content=" ", left=1)])

    special = [spelled[i] for i, kind in enumerate(types) if kind == _GGML_CONTROL]
    named = [spelled[i] for i in named_ids if i is not None and 0 <= i < len(spelled)]
    named += [t for t in _CLASS_SPECIAL_TOKENS["gemma" if rules == "gemma" else "llama"] if t in vocab]
    taken = set(special)
    special += [t for t in dict.fromkeys(named) if t not in taken]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    # A user-defined token spelled otherwise in the vocabulary (Gemma's runs of spaces, respelled
    # above) stays a plain vocabulary token, as in transformers.
    taken.update(special)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, kind in zip(tokens, types, strict=False)
                    if kind == _GGML_USER_DEFINED and t in vocab and t not in taken])
    return tok


def _cache_dir() -> Path:
    return Path(os.environ.get("INFERPLANE_TOKENIZER_DIR") or Path.home() / ".cache" / "inferplane" / "tokenizers")


def _cached_build(build, rules: str, tokens: list[str], types: list[int], scores: list[float] | None,
                  named_ids: list[int | None]) -> Tokenizer:
    """`build()`, kept on disk as tokenizer JSON under `INFERPLANE_TOKENIZER_DIR` (default
    `~/.cache/inferplane/tokenizers`). Rebuilding the merges of a vocabulary without them is a
    Python loop over every cut of every token (1.2M for Gemma 3's 262k tokens): several seconds on
    a busy 2-core machine, where reading the JSON back takes about half as long. The key is a hash
    of everything the build reads -- the rules, tokens, token types, scores and named ids -- plus
    this module's source and the tokenizers version, so an edited rule or a new file never meets a
    stale entry. A cache that cannot be read or written only costs the build."""
    digest = hashlib.sha256()
    for part in (Path(__file__).read_bytes(), tokenizers.__version__.encode(), repr((rules, named_ids)).encode(),
                 "\0".join(tokens).encode("utf-8", "surrogatepass"), array.array("q", types).tobytes(),
                 array.array("d", scores or ()).tobytes()):
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    path = _cache_dir() / f"{digest.hexdigest()}.json"
    try:
        return Tokenizer.from_file(str(path))
    except Exception:  # absent, or unreadable: build it
        pass
    tok = build()
    partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tok.save(str(partial), pretty=False)
        os.replace(partial, path)  # whole or not at all, for a worker that starts alongside
    except Exception:  # a read-only or full disk: serve without the cache
        partial.unlink(missing_ok=True)
    return tok


def _merges_from_vocab(vocab: dict[str, int], ranks: dict[str, float]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies (its files store none): every cut of a
    token into two vocabulary tokens, ordered as transformers' `generate_merges` orders them --
    higher-ranked token first, then longer left piece, then longer right piece, then the token's
    place in `ranks` (one cut of a token per left length, so nothing else ties). One dict look-up
    per cut (1.2M cuts, 515k merges for Gemma's 262k tokens) and one sort: 2-3 s on a busy 2-core
    machine, where transformers takes a minute or more."""
    keyed = []
    for order, (token, rank) in enumerate(ranks.items()):
        size = len(token)
        for cut in range(1, size):
            left = token[:cut]
            if left in vocab:
                right = token[cut:]
                if right in vocab:
                    keyed.append((-rank, -cut, cut - size, order, left, right))
    keyed.sort()
    return [(left, right) for *_, left, right in keyed]
