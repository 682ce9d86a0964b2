"""`inferplane bench spec`: speculative decoding against none, per workload, batch 1 and 8, greedy and
sampled, each method on its own engine in the same run.

What it prints per row: decode tokens/s for none, ngram and suffix, each method's ratio to none, its
acceptance length (tokens a verifying row emits: 1 + accepted / verifications), and whether its
output was the same tokens as none's (it must be: speculation changes speed, not text). For code
editing at batch 1 it prints the bandwidth bound too: the weight bytes a decode step reads over the
machine's measured read bandwidth (bench cpu's figures), which plain decoding cannot pass.

How it times: decode only, as bench cpu does: t(G) - t(1) for the same requests, their prompts
cached by the first call, over the tokens generated after the first; each method's best of
`--rounds` rounds, the methods taking turns in an order that turns each round. `suffix` learns
from the tenant's earlier requests: before its timed requests it serves eight other requests of
the same workload (under the same cache salt: one tenant, a new one each round), none of which is
timed or repeated.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass

from inferplane.bench.sampling_cases import CASES
from inferplane.bench.spec_workloads import WORKLOADS, requests

METHODS = ("none", "ngram", "suffix")
HISTORY = 8  # earlier requests of the same tenant the suffix method has seen before the timed ones
GOALS = {"code": (2.0, 1.3), "rag": (2.0, 1.3), "chat": (0.95, 0.95)}  # (batch 1, batch 8) on cpu-int8


@dataclass
class Timed:
    tokens_per_s: float
    acceptance: float  # 1 + accepted / verifications (nan without speculation)
    outputs: list[list[int]]


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="inferplane bench spec", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--runtime", default="cpu-int8")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--new-tokens", type=int, default=192, help="max_tokens of each request")
    p.add_argument("--num-tokens", type=int, default=8, help="speculative numTokens")
    p.add_argument("--batch1-requests", type=int, default=4, help="requests timed one after another at batch 1")
    p.add_argument("--modes", default="greedy,sampled")
    p.add_argument("--rounds", type=int, default=2, help="each method's best of this many rounds (fresh tenants)")
    p.add_argument("--threads", type=int, default=0)
    return p.parse_args(argv)


def _prompt(tokenizer, messages: list[dict]) -> str:
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages) + "\nassistant:"


def _spec_totals(llm) -> tuple[float, float]:
    stats = llm.engine.stats()
    accepted = sum(v for k, v in stats.items() if k.startswith("spec_accepted_tokens_total:"))
    verifications = sum(v for k, v in stats.items() if k.startswith("spec_verifications_total:"))
    return accepted, verifications


def _params(mode: str, count: int, new_tokens: int, offset: int):
    from inferplane.worker.engine.sampling import SamplingParams

    settings = CASES[mode]
    return [SamplingParams(max_tokens=new_tokens, seed=offset + i, **settings) for i in range(count)]


def _timed_batch(llm, prompts: list[str], params, salt: str) -> tuple[float, list[list[int]]]:
    """Decode seconds of one batch (t(G) - t(1), prompts cached by the t(1) call) and its outputs."""
    import dataclasses

    first = [dataclasses.replace(p, max_tokens=1) for p in params]
    start = time.perf_counter()
    llm.generate(prompts, first, cache_salt=salt)
    one = time.perf_counter() - start
    start = time.perf_counter()
    outs = llm.generate(prompts, params, cache_salt=salt)
    return max(1e-9, time.perf_counter() - start - one), [o.token_ids for o in outs]


def run_method(llm, method: str, workload: str, mode: str, batch: int, args, round_: int) -> Timed:
    tokenizer = llm.tokenizer
    salt = f"{workload}-{mode}-b{batch}-r{round_}"  # one tenant's namespace per row and round: none sees another's
    if method == "suffix":  # the tenant's earlier requests, which only this method reads
        history = requests(workload, HISTORY, 0)
        llm.generate([_prompt(tokenizer, m) for m in history], _params(mode, HISTORY, args.new_tokens, 0),
                     cache_salt=salt)
    accepted0, verifications0 = _spec_totals(llm)
    offset = HISTORY if batch == 1 else HISTORY + args.batch1_requests
    count = args.batch1_requests if batch == 1 else batch
    chats = requests(workload, count, offset)
    params = _params(mode, count, args.new_tokens, offset)
    seconds, outputs = 0.0, []
    groups = [[i] for i in range(count)] if batch == 1 else [list(range(count))]
    for group in groups:
        spent, outs = _timed_batch(llm, [_prompt(tokenizer, chats[i]) for i in group], [params[i] for i in group],
                                   salt)
        seconds += spent
        outputs += outs
    accepted, verifications = _spec_totals(llm)
    decoded = sum(max(0, len(o) - 1) for o in outputs)
    verified = verifications - verifications0
    acceptance = 1 + (accepted - accepted0) / verified if verified else float("nan")
    return Timed(decoded / seconds, acceptance, outputs)


def main(argv: list[str]) -> int:
    args = _parse(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from inferplane.bench.bandwidth import ReadBandwidth
    from inferplane.bench.cpu import bytes_read_per_token
    from inferplane.worker.llm import LLM

    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    engines = {}
    for method in METHODS:
        speculative = None if method == "none" else {"method": method, "num_tokens": args.num_tokens}
        engines[method] = LLM(args.model, runtime=args.runtime, device="cpu", speculative=speculative,
                              max_num_seqs=max(16, max(int(b) for b in args.batch_sizes.split(","))))
    print(f"model {args.model}, runtime {args.runtime}; torch {torch.__version__}, {threads} threads, "
          f"{os.cpu_count()} CPUs; numTokens {args.num_tokens}, up to {args.new_tokens} new tokens a request; "
          f"batch 1: {args.batch1_requests} requests one after another")
    bound = None
    if args.runtime == "cpu-int8":
        reader = ReadBandwidth(threads)
        reader.measure(reads=5)
        per_token = bytes_read_per_token(engines["none"])
        bound = reader.bytes_per_second / per_token
        print(f"bandwidth bound: {reader.bytes_per_second / 1e9:.1f} GB/s read / {per_token / 2**20:.1f} MiB "
              f"a token = {bound:.0f} tokens/s at batch 1")
    header = f"{'workload':<7} {'mode':<8} {'batch':>5} " + " ".join(
        f"{m + ' tok/s':>12}" for m in METHODS) + "  " + "  ".join(f"{m + ' x':>8} {'len':>5} {'same':>4}"
                                                                  for m in METHODS[1:])
    print(header)
    for workload in args.workloads.split(","):
        for mode in args.modes.split(","):
            for batch in (int(b) for b in args.batch_sizes.split(",")):
                timed: dict[str, Timed] = {}
                for round_ in range(args.rounds):  # the methods' order turns each round: drift hits each alike
                    order = METHODS[round_ % len(METHODS):] + METHODS[:round_ % len(METHODS)]
                    for method in order:
                        run = run_method(engines[method], method, workload, mode, batch, args, round_)
                        if method not in timed or run.tokens_per_s > timed[method].tokens_per_s:
                            timed[method] = run
                base = timed["none"]
                line = f"{workload:<7} {mode:<8} {batch:>5} " + " ".join(
                    f"{timed[m].tokens_per_s:>12.1f}" for m in METHODS)
                for method in METHODS[1:]:
                    t = timed[method]
                    line += (f"  {t.tokens_per_s / base.tokens_per_s:>7.2f}x {t.acceptance:>5.2f} "
                             f"{'yes' if t.outputs == base.outputs else 'NO':>4}")
                if bound is not None and batch == 1:
                    best = max(timed[m].tokens_per_s for m in METHODS[1:])
                    line += f"  best/bound {best / bound:.2f}"
                print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(os.sys.argv[1:]))
