"""An embedding model loaded from its folder, and `embed`: token-id lists in, one vector each out.

The folder is a Hugging Face BERT encoder (config.json, safetensors, tokenizer.json), usually a
sentence-transformers export whose modules.json says how to pool. Inputs come tokenized (the
gateway tokenizes, see worker.proto's EmbedRequest), so the tokenizer here is only what Info sends
the gateway; it is sent with padding and truncation off, since a tokenizer.json exported for
training often pads to a fixed length and truncates silently (all-MiniLM-L6-v2's pads every input
to 128 tokens), and neither may happen to an input a client sent.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer

from inferplane.api.architectures import config_architecture, model_kind
from inferplane.api.model_config import ModelLoadError
from inferplane.api.tokenizer import TextTokenizer
from inferplane.worker.embedding.pooling import Pooling, read_pooling
from inferplane.worker.model.bert import BertConfig, BertModel, load_bert
from inferplane.worker.model.hf_folder import read_config


def folder_architecture(path: str) -> str | None:
    """The architecture a HF folder's config.json names (api/architectures.config_architecture);
    None for anything else (a GGUF file's loader reads its own)."""
    if not os.path.isdir(path) or not os.path.exists(os.path.join(path, "config.json")):
        return None
    return config_architecture(read_config(path))


def _tokenizer(folder: str) -> TextTokenizer:
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.exists(path):
        raise ModelLoadError(f"{folder} has no tokenizer.json")
    tok = Tokenizer.from_file(path)
    tok.no_padding()
    tok.no_truncation()
    specials = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    return TextTokenizer(tokenizer=tok, special_ids=specials)


@dataclass
class EmbeddingEncoder:
    name: str
    path: str
    config: BertConfig
    model: BertModel
    pooling: Pooling
    tokenizer: TextTokenizer
    device: torch.device
    dtype: torch.dtype
    max_model_len: int

    @property
    def dimensions(self) -> int:
        return self.config.hidden_size * len(self.pooling.modes)

    @property
    def architecture(self) -> str:
        return self.config.architecture

    def check(self, inputs: Sequence[Sequence[int]]) -> None:
        """ValueError naming `input` (the gateway's 400) for an empty input, one longer than the
        model's positions, or a token id outside its vocabulary."""
        vocab = self.config.vocab_size
        for i, ids in enumerate(inputs):
            where = f"input: item {i} " if len(inputs) > 1 else "input: "
            if not ids:
                raise ValueError(f"{where}is empty")
            if len(ids) > self.max_model_len:
                raise ValueError(f"{where}has {len(ids)} tokens; this model takes at most {self.max_model_len}")
            top = max(ids)
            if top >= vocab:
                raise ValueError(f"{where}has token id {top}, outside the vocabulary (0..{vocab - 1})")

    @torch.inference_mode()
    def embed(self, inputs: Sequence[Sequence[int]]) -> torch.Tensor:
        """One padded forward over the inputs → float32 [len(inputs), dimensions] on the CPU."""
        self.check(inputs)
        longest = max(len(ids) for ids in inputs)
        ids = torch.full((len(inputs), longest), self.config.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(inputs), longest), dtype=torch.long)
        for row, tokens in enumerate(inputs):
            ids[row, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            mask[row, :len(tokens)] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        hidden = self.model(ids, mask)
        return self.pooling(hidden, mask).to("cpu", torch.float32)


def load_encoder(model: str, device: torch.device, dtype: torch.dtype,
                 max_model_len: int | None = None) -> EmbeddingEncoder:
    """A HF folder's embedding model. `max_model_len` may lower the longest input (the model's
    positions), never raise it. Weights of a generative architecture are refused by name."""
    path = os.path.expanduser(model)
    if not os.path.isdir(path):
        raise ModelLoadError(f"model {model!r}: the embedding runtime loads a Hugging Face folder "
                             "(config.json, safetensors, tokenizer.json)")
    architecture = folder_architecture(path)
    kind = model_kind(architecture)
    if kind != "embedding":
        hint = ("it generates: serve it with runtime paged, radix, cpu-int8 or auto (kind generate)"
                if kind == "generate" else "runtime embedding serves encoder models such as bert")
        raise ModelLoadError(f"model {model!r} ({architecture or 'no architecture'}) is not an embedding model; {hint}")
    pooling = read_pooling(path)
    encoder = load_bert(path, device, dtype)
    positions = encoder.config.max_position_embeddings
    return EmbeddingEncoder(name=model, path=path, config=encoder.config, model=encoder, pooling=pooling,
                            tokenizer=_tokenizer(path), device=device, dtype=dtype,
                            max_model_len=min(max_model_len or positions, positions))
