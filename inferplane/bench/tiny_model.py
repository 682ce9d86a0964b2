"""A tiny random Llama with a real tokenizer, for gateway tests and benchmarks.

The gateway tokenizes every prompt and renders chat templates itself, so a model without a
tokenizer cannot be served through it. This one is small enough that a CPU worker loads it in a
second and answers a one-token request in well under a millisecond of compute, which makes the
gateway (not the model) the thing a benchmark or an end-to-end test exercises.

The tokenizer is a byte-level BPE over the 256 byte symbols (no merges: any text encodes, one
token per byte) plus the special tokens ``<s>`` and ``</s>``; a ChatML-like template renders chats.

The output head is shaped so that generation is predictable where tests need it to be: a random
model that emits ``</s>`` at a random step makes stream lengths (and so tests about streams that
are cut midway) flaky, and one that emits lone non-ASCII bytes produces no text at all while the
detokenizer waits for the rest of a UTF-8 character. So rows ``±SCALE·e_i`` for ASCII tokens give
every position a logit of at least ``SCALE``, while the rows of ``</s>``, the other non-ASCII bytes and
the unused ids are zero: greedy decoding never ends early and always yields ASCII, and sampling at
temperature 1 picks one of those ids with probability under 1e-6 per token.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

VOCAB_SIZE = 320  # >= 256 byte symbols + the special tokens; the embedding table's size
HIDDEN = 32  # 2 x HIDDEN ASCII tokens carry the ±e_i output rows
ASCII_TOKENS = 94  # the sorted byte-level alphabet starts with the printable ASCII characters "!".."~"
SCALE = 20.0
BOS, EOS = "<s>", "</s>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def _build_tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # the 256 printable stand-ins for bytes
    vocab = {symbol: i for i, symbol in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(BOS, special=True, normalized=False),
                            AddedToken(EOS, special=True, normalized=False)])
    assert tok.get_vocab_size() <= VOCAB_SIZE
    return tok


def _shape_head(weight) -> None:
    """See the module docstring: after the final RMSNorm (weight 1) the hidden vector u has
    |u|_2 = sqrt(HIDDEN), so max_i |u_i| >= 1 and the best ±SCALE·e_i row scores >= SCALE > 0."""
    import torch

    with torch.no_grad():
        weight[ASCII_TOKENS:] = 0.0
        for i in range(HIDDEN):
            weight[2 * i].zero_()
            weight[2 * i + 1].zero_()
            weight[2 * i, i] = SCALE
            weight[2 * i + 1, i] = -SCALE


def _complete(folder: Path) -> bool:
    return all((folder / name).exists() for name in _FILES)


def make_tiny_model(folder: str | os.PathLike, seed: int = 0) -> str:
    """Writes the model into ``folder`` (created if needed) unless it is already there; returns the path.

    The files are written under temporary names and renamed last, so a process killed midway never
    leaves a folder that looks complete but is not.
    """
    path = Path(folder)
    if _complete(path):
        return str(path)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    tok = _build_tokenizer()
    bos_id, eos_id = tok.token_to_id(BOS), tok.token_to_id(EOS)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         initializer_range=0.15, rope_theta=10000.0, tie_word_embeddings=False,
                         bos_token_id=bos_id, eos_token_id=eos_id)
    model = LlamaForCausalLM(config)
    _shape_head(model.lm_head.weight)
    model.save_pretrained(str(path), safe_serialization=True)
    tok.save(str(path / "tokenizer.json.tmp"))
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
                        "add_bos_token": False, "model_max_length": 1024, "chat_template": CHAT_TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    os.replace(path / "tokenizer.json.tmp", path / "tokenizer.json")  # last: marks the folder complete
    return str(path)


def main() -> None:
    """`python -m inferplane.bench.tiny_model FOLDER`: write the model (handy for manual runs)."""
    import sys

    print(make_tiny_model(sys.argv[1] if len(sys.argv) > 1 else "tiny-model"))


if __name__ == "__main__":
    main()
