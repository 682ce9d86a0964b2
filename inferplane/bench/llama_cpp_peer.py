"""llama.cpp as a contender in `inferplane bench cpu --peer llama.cpp`, through llama-cpp-python's
bindings of the C API (the optional dependency `llama-cpp-python`, which pip builds from source
with the machine's compiler, so it uses the vector instructions this CPU has).

The high-level `Llama` class decodes one sequence; batched decoding (16 sequences at once, what
llama.cpp's `batched` example and server do) needs the C API: one `llama_batch` per step, a token
per sequence, each tagged with its sequence id, over a context with `n_seq_max` sequences. Sampling
is greedy (the argmax of each sequence's logits), as for every other contender in the bench.
"""

from __future__ import annotations

import ctypes
import math
import time
from pathlib import Path

import numpy as np


def available() -> str | None:
    """None when llama-cpp-python imports, else why not (the bench prints it)."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as exc:
        return (f"llama-cpp-python is not installed ({exc}); `pip install llama-cpp-python` "
                "(pip builds it from source with cmake and a C++ compiler)")
    return None


def _quiet(_level, _text, _user_data) -> None:
    """llama.cpp logs every tensor it loads to stderr; the bench prints its own lines."""


def quantized_copy(source: Path, ftype_name: str, cache_dir: Path, threads: int) -> Path:
    """`source` requantized by llama.cpp's own quantizer to `ftype_name` (e.g. "Q8_0"), cached by
    name and size: how a user of llama.cpp makes a Q8_0 file from whatever the hub had."""
    import llama_cpp

    target = cache_dir / f"{source.stem}.{ftype_name}.{source.stat().st_size}.gguf"
    if target.exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = threads
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype_name}")
    params.allow_requantize = True
    partial = target.with_suffix(".partial")
    rc = llama_cpp.llama_model_quantize(str(source).encode(), str(partial).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({source.name} -> {ftype_name}) returned {rc}")
    partial.replace(target)
    return target


class LlamaCpp:
    """One GGUF file loaded by llama.cpp, with a context for `max_seqs` sequences of `seq_len`."""

    _log_callback = None  # kept alive: llama.cpp holds the pointer

    def __init__(self, path: Path, threads: int, max_seqs: int, seq_len: int):
        import llama_cpp

        if LlamaCpp._log_callback is None:
            LlamaCpp._log_callback = llama_cpp.llama_log_callback(_quiet)
            llama_cpp.llama_log_set(LlamaCpp._log_callback, None)
        self.lib = llama_cpp
        self.path = path
        start = time.perf_counter()
        llama_cpp.llama_backend_init()
        model_params = llama_cpp.llama_model_default_params()
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), model_params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        ctx_params = llama_cpp.llama_context_default_params()
        ctx_params.n_ctx = max_seqs * seq_len + 16
        ctx_params.n_batch = max(512, max_seqs)
        ctx_params.n_ubatch = max(512, max_seqs)
        ctx_params.n_seq_max = max_seqs
        ctx_params.n_threads = threads
        ctx_params.n_threads_batch = threads
        ctx_params.kv_unified = True
        self.ctx = llama_cpp.llama_init_from_model(self.model, ctx_params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.n_batch = int(ctx_params.n_batch)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.batch = llama_cpp.llama_batch_init(self.n_batch, 0, max_seqs)
        self.load_seconds = time.perf_counter() - start

    def weight_bytes(self) -> int:
        """Bytes of weights one batch-1 decode step reads from this file: every tensor but the token
        embeddings (one row of those), which a tied head reads in full."""
        from inferplane.worker.model.gguf_file import open_gguf

        tensors = open_gguf(str(self.path)).tensors
        tied = not any(t.name == "output.weight" for t in tensors)
        return sum(int(t.n_bytes) for t in tensors if tied or t.name != "token_embd.weight")

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)

    def _clear(self) -> None:
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """entries: (token, position, sequence, wants logits), at most n_batch of them."""
        b = self.batch
        for i, (token, pos, seq, logits) in enumerate(entries):
            b.token[i] = token
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = 1 if logits else 0
        b.n_tokens = len(entries)
        rc = self.lib.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _logits(self, i: int) -> np.ndarray:
        return np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))

    def _prefill(self, prompts: list[list[int]]) -> list[int]:
        """Feeds every prompt (chunks of n_batch tokens); returns each one's greedy next token."""
        entries = [(tok, pos, seq, pos == len(p) - 1) for seq, p in enumerate(prompts) for pos, tok in enumerate(p)]
        nxt = [0] * len(prompts)
        for start in range(0, len(entries), self.n_batch):
            chunk = entries[start:start + self.n_batch]
            self._decode(chunk)
            for i, (_, _, seq, wants) in enumerate(chunk):
                if wants:
                    nxt[seq] = int(self._logits(i).argmax())
        return nxt

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        """Greedy decoding of every prompt at once, `new_tokens` each (no stop at EOS)."""
        self._clear()
        tokens = self._prefill(prompts)
        out = [[t] for t in tokens]
        positions = [len(p) for p in prompts]
        for _ in range(new_tokens - 1):
            self._decode([(out[s][-1], positions[s], s, True) for s in range(len(prompts))])
            for s in range(len(prompts)):
                out[s].append(int(self._logits(s).argmax()))
                positions[s] += 1
        return out

    def perplexity(self, token_ids: list[int], window: int) -> float:
        """Perplexity over non-overlapping windows, each from a fresh context (as the gate scores)."""
        nll, count = 0.0, 0
        for w0 in range(0, len(token_ids), window):
            ids = token_ids[w0:w0 + window]
            if len(ids) < 2:
                continue
            self._clear()
            for start in range(0, len(ids), self.n_batch):
                chunk = ids[start:start + self.n_batch]
                self._decode([(t, start + i, 0, True) for i, t in enumerate(chunk)])
                for i in range(len(chunk)):
                    pos = start + i
                    if pos + 1 >= len(ids):
                        break
                    logits = self._logits(i).astype(np.float64)
                    top = logits.max()
                    nll -= logits[ids[pos + 1]] - top - math.log(np.exp(logits - top).sum())
                    count += 1
        return math.exp(nll / count)
