"""`inferplane quant-check`: the int8 quality gate over the whole evaluation text.

Loads the model in float32, makes a quantized copy the way the cpu-int8 runtime does (a GGUF
file's Q4 blocks as they are, other linears and the output head in int8, unless told otherwise),
and compares them window by window. Exit status 0 when the perplexity rise is within the threshold, 1 when it is
not, 2 when the check could not run.
"""

from __future__ import annotations

import argparse


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="alias, GGUF file or HF folder")
    parser.add_argument("--threshold-pct", type=float, default=2.0,
                        help="largest allowed perplexity rise, %%")
    parser.add_argument("--max-tokens", type=int, default=None, help="evaluate only this many tokens")
    parser.add_argument("--window", type=int, default=512, help="tokens per independently scored window")
    parser.add_argument("--quantize-head", action=argparse.BooleanOptionalAction, default=True,
                        help="int8 output head, as the runtime's default (--no-quantize-head: float32)")
    parser.add_argument("--requantize-q4", action="store_true",
                        help="a GGUF file's 4-, 5-, 6- and 8-bit linears requantized to int8 instead of served as "
                             "they are")
    parser.add_argument("--corrupt-scales", type=float, default=1.0, metavar="FACTOR",
                        help="multiply every int8 scale by FACTOR (a wrong quantization: the gate must fail)")


def run(args: argparse.Namespace) -> int:
    import copy
    import time

    import torch

    from inferplane.api.model_config import ModelLoadError
    from inferplane.worker.model.loader import load_model
    from inferplane.worker.quant import gate
    from inferplane.worker.quant.convert import calibration_tokens, convert_model

    start = time.perf_counter()
    try:
        loaded = load_model(args.model, torch.device("cpu"), torch.float32)
        token_ids = gate.eval_tokens(loaded.tokenizer, args.max_tokens)
    except (ModelLoadError, ValueError) as exc:
        print(f"quant-check: {exc}")
        return 2
    int8_model = copy.deepcopy(loaded.model)
    report = convert_model(int8_model, quantize_head=args.quantize_head, scale_multiplier=args.corrupt_scales,
                           gguf_path=loaded.path, calibration_ids=calibration_tokens(loaded),
                           q4_blocks=not args.requantize_q4)
    with report.dispatch.int8_only():  # score the int8 kernel (decode's path), not float GEMM for prefill
        result = gate.compare_models(loaded.model, int8_model, token_ids, window=args.window,
                                     threshold_pct=args.threshold_pct)
    from_blocks = f", {report.from_q8_0} straight from Q8_0 blocks" if report.from_q8_0 else ""
    for kind, count in report.from_file_blocks.items():
        from_blocks += f", {count} served from the file's {kind.upper()} blocks"
    print(f"model {loaded.name}: {report.source_layers} linear layers as {len(report.layers)} "
          f"(q/k/v and gate/up fused){from_blocks}")
    print(f"weights: quantized {report.int8_bytes / 2**20:.1f} MiB vs float32 "
          f"{report.float_bytes / 2**20:.1f} MiB ({report.int8_bytes / report.float_bytes:.3f}x)")
    if args.corrupt_scales != 1.0:
        print(f"scales deliberately multiplied by {args.corrupt_scales}")
    print(f"perplexity float32: {result.ppl_float32:.4f}")
    print(f"perplexity int8:    {result.ppl_int8:.4f}")
    print(f"perplexity rise:    {result.ppl_rise_pct:+.3f}% (threshold {result.threshold_pct:.2f}%)")
    print(f"top-1 agreement:    {result.top1_agreement:.2%}")
    print(f"mean KL(f32||int8): {result.kl_mean:.5f}")
    print(f"tokens scored:      {result.tokens} ({time.perf_counter() - start:.0f}s)")
    print(result.summary())
    return 0 if result.passed else 1
