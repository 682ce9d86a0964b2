"""Our GGUF dequantizers against the gguf package's reference implementation, and the GGUF
tokenizer against HF transformers' reading of the same file."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from inferplane.api.model_config import ModelLoadError
from inferplane.worker.model.gguf_file import _unpermute_rope, dequantize


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "F16"])
def test_dequantize_matches_the_reference(qtype):
    rng = np.random.default_rng(0)
    weights = rng.normal(0, 0.5, size=(6, 64)).astype(np.float32)
    kind = GGMLQuantizationType[qtype]
    raw = quants.quantize(weights, kind)
    expected = quants.dequantize(raw, kind)
    ours = dequantize(qtype, raw, (6, 64)).numpy()
    np.testing.assert_allclose(ours, expected, rtol=0, atol=1e-6)
    assert np.abs(ours - weights).max() < (0.2 if qtype.startswith("Q4") else 0.02)


def test_an_unsupported_tensor_type_is_named():
    with pytest.raises(ModelLoadError, match="IQ2_XS"):
        dequantize("IQ2_XS", np.zeros(74, dtype=np.uint8), (1, 256))


def test_rope_unpermute_inverts_llama_cpp_permute():
    heads, head_dim, cols = 3, 8, 5
    w = torch.arange(heads * head_dim * cols, dtype=torch.float32).reshape(heads * head_dim, cols)
    # llama.cpp's converter: reshape(heads, 2, d/2, cols).swapaxes(1, 2)
    permuted = w.reshape(heads, 2, head_dim // 2, cols).transpose(1, 2).reshape(heads * head_dim, cols)
    assert torch.equal(_unpermute_rope(permuted, heads), w)


@pytest.mark.slow
def test_gguf_tokenizer_and_chat_template_match_hf():
    from transformers import AutoTokenizer

    from inferplane.api.model_resolution import builtin_model_path
    from inferplane.worker.model.gguf_file import open_gguf
    from inferplane.worker.model.tokenizer import load_gguf_tokenizer

    smollm2 = builtin_model_path("smollm2-135m")
    ours = load_gguf_tokenizer(open_gguf(str(smollm2)))
    hf = AutoTokenizer.from_pretrained(str(smollm2.parent), gguf_file=smollm2.name)
    texts = ["Hello world!", "Prices rose 12.5% in 2024; café au lait costs €3.", "  indented\n\tcode()",
             "<|im_start|>user\nhi<|im_end|>", "日本語のテキスト", "don't won't I'll"]
    for text in texts:
        assert ours.encode(text) == hf.encode(text, add_special_tokens=False), text
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert ours.apply_chat_template(chat) == hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)


def test_incremental_detokenizer_never_splits_a_character(tiny_llama):
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from inferplane.api.tokenizer import IncrementalDetokenizer, TextTokenizer

    # A byte-level vocabulary: every byte its own token, so a multi-byte character spans tokens.
    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(byte_chars))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = TextTokenizer(tok)
    ids = text.encode("a€b日")
    detok = IncrementalDetokenizer(text, [])
    deltas = [detok.add(i) for i in ids]
    assert "".join(deltas) == "a€b日"
    assert all("\ufffd" not in d for d in deltas)


def _assert_same_reading(ours, stock, nested: tuple[str, ...] = ()) -> None:
    """api/gguf_reader.py reads every metadata value and tensor as gguf.GGUFReader does (but arrays of
    arrays, `nested`, which gguf's contents() flattens: a FIXME of its own)."""
    import numpy as np

    assert list(ours.fields) == [key for key in stock.fields if not key.startswith("GGUF.")]
    for key, field in ours.fields.items():
        if key not in nested:
            assert field.contents() == stock.fields[key].contents(), key
    assert ours.data_offset == stock.data_offset
    assert [(t.name, t.tensor_type, t.shape.tolist(), t.n_bytes, t.data_offset, t.data.dtype, t.data.shape)
            for t in ours.tensors] == [(t.name, t.tensor_type, t.shape.tolist(), t.n_bytes, t.data_offset,
                                        t.data.dtype, t.data.shape) for t in stock.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(ours.tensors, stock.tensors, strict=True))


def _write_gguf(path) -> None:
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_array("test.strings", ["a", "", "héllo ✓", "<|im_end|>"])
    writer.add_array("test.ints", [3, -1, 7])
    writer.add_array("test.floats", [0.5, 2.25])
    writer.add_array("test.bools", [True, False])
    writer.add_array("test.nested", [[1, 2], [3]])
    writer.add_uint32("test.scalar", 42)
    writer.add_string("test.text", "plain")
    writer.add_tensor("w", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.add_tensor("q", np.arange(68, dtype=np.uint8).reshape(2, 34), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_the_gguf_reader_reads_what_gguf_reads(tmp_path):
    """Arrays of strings (non-ASCII too), ints, floats, bools and arrays, scalars, a float and a
    quantized tensor: every field and tensor as gguf.GGUFReader has it."""
    import gguf

    from inferplane.api.gguf_reader import open_gguf

    path = tmp_path / "fields.gguf"
    _write_gguf(path)
    ours = open_gguf(str(path))
    _assert_same_reading(ours, gguf.GGUFReader(str(path)), nested=("test.nested",))
    assert ours.fields["test.strings"].contents() == ["a", "", "héllo ✓", "<|im_end|>"]
    assert ours.fields["test.strings"].contents(2) == "héllo ✓"
    assert ours.fields["test.nested"].contents() == [[1, 2], [3]]


def test_a_file_the_gguf_reader_cannot_read_is_a_model_load_error(tmp_path):
    """Not GGUF, truncated in the metadata or in a tensor: one line naming the file, not a crash."""
    from inferplane.api.model_config import ModelLoadError
    from inferplane.worker.model.gguf_file import open_gguf

    good = tmp_path / "good.gguf"
    _write_gguf(good)
    data = good.read_bytes()
    for name, content in (("not.gguf", b"PK\x03\x04" + data[4:]), ("short.gguf", data[:60]),
                          ("cut.gguf", data[:-40])):
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ModelLoadError, match=f"cannot read GGUF file .*{name}"):
            open_gguf(str(tmp_path / name))


def test_the_gguf_reader_reads_smollm2_as_gguf_does():
    import gguf

    from inferplane.api.gguf_reader import open_gguf
    from inferplane.worker.model.loader import resolve_model_path

    path = resolve_model_path("smollm2-135m")
    _assert_same_reading(open_gguf(path), gguf.GGUFReader(path))
