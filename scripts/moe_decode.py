"""cpu-int8 decode of a Mixture-of-Experts model with the fused decode (one C call a step, experts
included) against the same engine layer by layer, in interleaved rounds.

    python scripts/moe_decode.py                      # a random Qwen3-MoE: 12 layers, 64 experts, 8 a token
    python scripts/moe_decode.py --experts 8 --top-k 2 --layers 8   # Mixtral's routing shape

No MoE checkpoint is reachable offline here, so transformers builds one from a config (random
weights route as decisively as trained ones only on average; the work a step does is the same).
Prints decode tokens/s for each batch size and the ratio; not a test.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from inferplane import LLM, SamplingParams
from inferplane.worker.ops import fused_decode


def save_moe(path: str, args: argparse.Namespace) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "qwen3_moe", vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64, num_key_value_heads=4, head_dim=64,
        num_experts=args.experts, num_experts_per_tok=args.top_k, moe_intermediate_size=args.moe_inter,
        decoder_sparse_step=1, norm_topk_prob=True, max_position_embeddings=4096, eos_token_id=None,
        bos_token_id=None, pad_token_id=0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


def decode_rate(llm: LLM, batch: int, new_tokens: int, fused: bool) -> float:
    """Decode tokens/s of `batch` sequences: generate 1 and new_tokens + 1, the difference."""
    prompts = [[(7 * i + j) % 1000 + 1 for j in range(32)] for i in range(batch)]
    real = fused_decode.FusedDecode.forward
    if not fused:
        fused_decode.FusedDecode.forward = lambda *a, **k: None
    try:
        def run(n: int) -> float:
            start = time.perf_counter()
            llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
            return time.perf_counter() - start
        return batch * new_tokens / (run(new_tokens + 1) - run(1))
    finally:
        fused_decode.FusedDecode.forward = real


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--moe-inter", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        llm = LLM(save_moe(folder, args), runtime="cpu-int8", device="cpu", skip_quality_gate=True, kv_manager="paged")
        print(f"random Qwen3-MoE: {args.layers} layers, hidden {args.hidden}, {args.experts} experts "
              f"({args.top_k} a token, {args.moe_inter} wide); cpu-int8, {torch.get_num_threads()} threads")
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            decode_rate(llm, batch, 4, True)  # warm both paths
            decode_rate(llm, batch, 4, False)
            best = {True: 0.0, False: 0.0}
            for _ in range(args.rounds):
                for fused in (True, False):
                    best[fused] = max(best[fused], decode_rate(llm, batch, args.new_tokens, fused))
            print(f"batch {batch:3d}: fused {best[True]:8.1f} tokens/s, layer by layer {best[False]:8.1f} "
                  f"({best[True] / best[False]:.2f}x)")


if __name__ == "__main__":
    main()
