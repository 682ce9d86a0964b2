"""`inferplane bench faults`: streams through replicas of which one is SIGKILLed (and started again)
every `--kill-every` seconds; what the clients read against an uninterrupted answer.

Two worker processes (a tiny random model by default, so that the bench measures the platform, not
the model; or `--model`) behind a gateway process. `--clients` clients each stream greedy
completions of `--max-tokens` tokens in a loop for `--seconds`; meanwhile a killer SIGKILLs one
worker, chosen in turn, every `--kill-every` seconds, and starts it again. Every answer is compared
with the uninterrupted answer to the same prompt (greedy: one answer per prompt, taken first from a
quiet stack): the tokens lost and duplicated (goal: 0 and 0), answers that ended in an error, and,
for answers whose worker was killed while they streamed, the longest pause between two text events
against the same answer's median pause: what a migration adds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import tempfile
import time
from dataclasses import dataclass, field

import httpx

from inferplane.bench.gateway_harness import SERVED_MODEL, free_port, start_gateway, start_worker, wait_serving


@dataclass
class Answer:
    prompt: str
    text: str = ""
    error: str | None = None
    gaps: list[float] = field(default_factory=list)  # seconds between text events
    started: float = 0.0
    ended: float = 0.0


async def stream(client: httpx.AsyncClient, key: str, prompt: str, max_tokens: int) -> Answer:
    answer = Answer(prompt, started=time.monotonic())
    last = None
    body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    try:
        async with client.stream("POST", "/v1/completions", json=body,
                                 headers={"Authorization": f"Bearer {key}"}) as response:
            if response.status_code != 200:
                answer.error = f"HTTP {response.status_code}"
                return answer
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line.removeprefix("data: "))
                if "error" in event:
                    answer.error = event["error"].get("code", "error")
                    continue
                now = time.monotonic()
                if last is not None:
                    answer.gaps.append(now - last)
                last = now
                answer.text += "".join(c["text"] for c in event["choices"])
    except httpx.HTTPError as exc:
        answer.error = type(exc).__name__
    answer.ended = time.monotonic()
    return answer


def lost_and_duplicated(got: str, expected: str) -> tuple[int, int]:
    """Characters missing from and added to `got` against `expected` (the tiny model's tokens are
    one character each; for another model these count characters, not tokens)."""
    common = 0
    while common < min(len(got), len(expected)) and got[common] == expected[common]:
        common += 1
    return len(expected) - common, len(got) - common


async def run(args: argparse.Namespace, model: str, home: str) -> dict:
    ports = [free_port(), free_port()]
    addresses = [f"127.0.0.1:{p}" for p in ports]
    flags = ("--max-model-len", str(args.max_tokens + 64))
    workers = {a: start_worker(model, p, *flags, log_path=f"{home}/worker-{i}.log")
               for i, (a, p) in enumerate(zip(addresses, ports, strict=True))}
    for address, worker in workers.items():
        await asyncio.to_thread(wait_serving, address, worker)
    gateway = await asyncio.to_thread(start_gateway, addresses, log_path=f"{home}/gateway.log",
                                      extra=("--health-poll-interval", "0.5"))
    prompts = [f"story number {i} about the sea" for i in range(args.clients * 4)]
    kills: list[tuple[float, str]] = []
    try:
        async with httpx.AsyncClient(base_url=gateway.base_url, timeout=httpx.Timeout(600)) as client:
            expected = {p: (await stream(client, gateway.key, p, args.max_tokens)).text for p in prompts}
            stop = time.monotonic() + args.seconds

            async def killer() -> None:
                turn = 0
                while time.monotonic() + args.kill_every < stop:
                    await asyncio.sleep(args.kill_every)
                    address = addresses[turn % len(addresses)]
                    turn += 1
                    workers[address].send_signal(signal.SIGKILL)
                    kills.append((time.monotonic(), address))
                    await asyncio.to_thread(workers[address].wait)
                    port = int(address.rsplit(":", 1)[1])
                    workers[address] = start_worker(model, port, *flags, log_path=f"{home}/worker-again.log")
                    await asyncio.to_thread(wait_serving, address, workers[address])

            async def client_loop(i: int) -> list[Answer]:
                answers = []
                while time.monotonic() < stop:
                    answers.append(await stream(client, gateway.key, prompts[(i + 4 * len(answers)) % len(prompts)],
                                                args.max_tokens))
                return answers

            results = await asyncio.gather(killer(), *(client_loop(i) for i in range(args.clients)))
    finally:
        gateway.stop()
        for worker in workers.values():
            worker.kill()
            worker.wait()
    answers = [a for group in results[1:] for a in group]
    lost = duplicated = mismatched = 0
    added = []
    for a in answers:
        if a.error is None:
            missing, extra = lost_and_duplicated(a.text, expected[a.prompt])
            lost, duplicated = lost + missing, duplicated + extra
            mismatched += a.text != expected[a.prompt]
        if any(a.started < at < a.ended for at, _ in kills) and len(a.gaps) > 2:
            added.append(max(a.gaps) - statistics.median(a.gaps))
    return {"answers": len(answers), "kills": len(kills), "answers_through_a_kill": len(added),
            "errors": sum(a.error is not None for a in answers), "lost": lost, "duplicated": duplicated,
            "mismatched": mismatched,
            "added_latency_p50_s": round(statistics.median(added), 3) if added else None,
            "added_latency_max_s": round(max(added), 3) if added else None}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="inferplane bench faults", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="weights for the workers (default: a tiny random model)")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=150)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--kill-every", type=float, default=10.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="inferplane-faults-") as home:
        model = args.model
        if model is None:
            from inferplane.bench.tiny_model import make_tiny_model

            model = make_tiny_model(f"{home}/tiny")
        result = asyncio.run(run(args, model, home))
    if args.json:
        print(json.dumps(result))
        return
    print(f"{result['answers']} answers from {args.clients} clients over {args.seconds:.0f} s, "
          f"{result['kills']} workers SIGKILLed, {result['answers_through_a_kill']} answers streaming through a kill")
    print(f"errors {result['errors']}, tokens lost {result['lost']}, duplicated {result['duplicated']}, "
          f"answers differing from the uninterrupted one {result['mismatched']}")
    print(f"added latency at a kill (longest pause minus the answer's median pause): "
          f"p50 {result['added_latency_p50_s']} s, max {result['added_latency_max_s']} s")


if __name__ == "__main__":
    main()
