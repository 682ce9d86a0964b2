"""`inferplane bench serve`: an OpenAI-compatible load test against any running endpoint (our gateway,
llama.cpp's llama-server, vLLM), as `vllm bench serve` is one: streamed requests at a fixed rate
(Poisson arrivals) or a fixed concurrency, or a sweep of either, and per request TTFT, inter-token
latency, TPOT, end-to-end latency and output tokens; percentiles, throughputs and goodput under SLOs.

What it sends: bench/serve_workloads.py (synthetic shapes, shared prefix, multi-turn, bench spec's
datasets). Sampling: bench/sampling_cases.py's sampled case by default, as a chat client samples.
Every request streams with `stream_options: {include_usage: true}`, so output tokens are the
server's own count where it sends usage (all three do); otherwise the text chunks are counted and
the summary says how many requests were counted so. `--ignore-eos` forces the output length: it
sends `ignore_eos` (llama-server, vLLM and our gateway) and `min_tokens` = max_tokens (for servers
that have only the latter); the summary counts the requests that still came back short.

A failed request (HTTP status, an error event mid-stream, a dropped connection, a timeout) is
counted with its error text and the run goes on; the first error is printed. The numbers and their
definitions: bench/serve_stats.py and docs/bench-serve.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import math
import os
import random
import time
from dataclasses import asdict

import httpx

from inferplane import aio
from inferplane.bench import serve_plot, serve_workloads
from inferplane.bench.sampling_cases import SAMPLED
from inferplane.bench.serve_stats import RequestRecord, arrival_offsets, parse_slos, summarize
from inferplane.bench.serve_workloads import Conversation, Shape

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
ERROR_CHARS = 500  # of an error body kept per request


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="inferplane bench serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", required=True, help="the server, e.g. http://127.0.0.1:8080 (a trailing /v1 is fine)")
    p.add_argument("--model", required=True, help="the model name requests carry")
    p.add_argument("--endpoint", default=ENDPOINTS[0], choices=ENDPOINTS)
    p.add_argument("--api-key", default=os.environ.get("INFERPLANE_API_KEY") or os.environ.get("OPENAI_API_KEY"),
                   help="bearer key (default $INFERPLANE_API_KEY, else $OPENAI_API_KEY; none: no header)")
    p.add_argument("--workload", default="random", choices=serve_workloads.WORKLOADS)
    p.add_argument("--num-prompts", type=int, default=32, help="requests per run (multi-turn: all turns counted)")
    p.add_argument("--input-len", type=int, default=128, help="words of each user message (synthetic workloads)")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens of each request")
    p.add_argument("--prefix-len", type=int, default=256, help="words of the shared system prompt "
                                                               "(shared-prefix, multi-turn; 0: none for multi-turn)")
    p.add_argument("--turns", type=int, default=3, help="requests per conversation (multi-turn)")
    p.add_argument("--request-rate", default="inf",
                   help="arrivals per second, Poisson; inf: all at once; a comma list sweeps (e.g. 1,2,4)")
    p.add_argument("--max-concurrency", default=None,
                   help="requests in flight at most; a comma list sweeps (e.g. 1,4,8); with a rate list, every pair")
    p.add_argument("--temperature", type=float, default=SAMPLED["temperature"])
    p.add_argument("--top-p", type=float, default=SAMPLED["top_p"])
    p.add_argument("--ignore-eos", action="store_true",
                   help="force --output-len tokens: sends ignore_eos and min_tokens=max_tokens")
    p.add_argument("--goodput", nargs="+", default=[], metavar="KEY:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 (keys: ttft, tpot, e2el)")
    p.add_argument("--seed", type=int, default=0, help="for the texts and the arrival schedule")
    p.add_argument("--warmup", type=int, default=1, help="requests sent (and not counted) before the first run")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take in all")
    p.add_argument("--json", default=None, metavar="FILE", help="write config, per-request records and summaries")
    p.add_argument("--plot", default=None, metavar="FILE", help="write an SVG: latency CDFs (and the sweep's p50/p99)")
    args = p.parse_args(argv)
    try:
        args.rates = _numbers(args.request_rate, float, "--request-rate")
        args.concurrencies = ([None] if args.max_concurrency is None
                              else _numbers(args.max_concurrency, int, "--max-concurrency"))
        args.slos = parse_slos(args.goodput)
        args.shape = Shape(args.workload, args.num_prompts, args.input_len, args.output_len, args.prefix_len,
                           args.turns)
        serve_workloads.check(args.shape)
        if args.timeout <= 0 or args.warmup < 0:
            raise ValueError("--timeout must be positive and --warmup at least 0")
    except ValueError as exc:
        p.error(str(exc))
    return args


def _numbers(text: str, kind: type, flag: str) -> list:
    values = []
    for item in text.split(","):
        try:
            value = kind(item.strip())
        except ValueError:
            raise ValueError(f"{flag} takes a comma list of numbers, got {text!r}") from None
        if not value > 0 or (kind is float and math.isnan(value)):
            raise ValueError(f"{flag} values must be positive, got {item.strip()!r}")
        values.append(value)
    return values


def _url(base_url: str, endpoint: str) -> str:
    base = base_url.rstrip("/")
    return base + (endpoint.removeprefix("/v1") if base.endswith("/v1") else endpoint)


def request_body(args: argparse.Namespace, history: list[dict], output_len: int) -> dict:
    """One streamed request of `history` (chat messages; a transcript for /v1/completions)."""
    body: dict = {"model": args.model, "max_tokens": output_len, "stream": True,
                  "stream_options": {"include_usage": True}, "temperature": args.temperature, "top_p": args.top_p}
    if args.endpoint == "/v1/completions":
        body["prompt"] = serve_workloads.transcript(history)
    else:
        body["messages"] = history
    if args.ignore_eos:
        body["ignore_eos"] = True
        body["min_tokens"] = output_len
    return body


def _chunk_text(choice: dict) -> str:
    delta = choice.get("delta")
    if isinstance(delta, dict):  # chat; reasoning models stream their thinking apart from the answer
        return (delta.get("content") or "") + (delta.get("reasoning_content") or delta.get("reasoning") or "")
    return choice.get("text") or ""


async def send(client: httpx.AsyncClient, url: str, headers: dict, body: dict, record: RequestRecord,
               t0: float, timeout: float) -> str:
    """Sends one request, fills `record` (never raises for the server's or the network's failures);
    returns the answer's text (for a conversation's next turn). `timeout`: seconds for all of it."""
    parts: list[str] = []
    sent = time.perf_counter()
    record.start = sent - t0
    last: float | None = None
    done = False
    try:
        async with asyncio.timeout(timeout), client.stream("POST", url, json=body, headers=headers) as response:
            record.status = response.status_code
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                record.error = f"HTTP {response.status_code}: {text.strip()[:ERROR_CHARS]}"
                return ""
            async for line in response.aiter_lines():
                if not line.startswith("data:"):  # blank separators, ": keep-alive" comments, event names
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if event.get("error"):
                    record.error = f"error event mid-stream: {json.dumps(event['error'])[:ERROR_CHARS]}"
                    return ""
                if usage := event.get("usage"):
                    record.prompt_tokens = usage.get("prompt_tokens")
                    if usage.get("completion_tokens") is not None:
                        record.output_tokens = int(usage["completion_tokens"])
                        record.token_source = "usage"
                for choice in event.get("choices") or []:
                    record.finish_reason = choice.get("finish_reason") or record.finish_reason
                    if text := _chunk_text(choice):
                        now = time.perf_counter()
                        if last is None:
                            record.ttft = now - sent
                        else:
                            record.itl.append(now - last)
                        last = now
                        record.chunks += 1
                        parts.append(text)
        if not done:
            record.error = "the stream ended without [DONE]"
            return ""
    except TimeoutError:
        record.error = f"no complete answer within --timeout {timeout:g} s"
        return ""
    except Exception as exc:  # connection, malformed event: a failed request, never a crashed run
        record.error = f"{type(exc).__name__}: {exc}"[:ERROR_CHARS]
        return ""
    record.e2e = time.perf_counter() - sent
    record.ok = True
    if record.token_source == "chunks":
        record.output_tokens = record.chunks
    answer = "".join(parts)
    record.output_chars = len(answer)
    return answer


def _headers(args: argparse.Namespace) -> dict:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


def _client(args: argparse.Namespace, connections: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits)  # send() bounds the total


async def run_point(args: argparse.Namespace, conversations: list[Conversation], rate: float,
                    concurrency: int | None, variant: int) -> tuple[list[RequestRecord], float]:
    """One run: conversations arrive by the schedule; a conversation's turns follow one another;
    at most `concurrency` requests are in flight. Returns the records (by index) and the duration."""
    offsets = arrival_offsets(len(conversations), rate, random.Random(f"{args.seed}:{variant}:arrivals"))
    slots = asyncio.Semaphore(concurrency) if concurrency else None
    url, headers = _url(args.base_url, args.endpoint), _headers(args)
    turns = max(len(c.turns) for c in conversations)
    records: list[RequestRecord] = []
    async with _client(args, concurrency or len(conversations)) as client:
        t0 = time.perf_counter()

        async def converse(ci: int, conversation: Conversation) -> None:
            await asyncio.sleep(max(0.0, t0 + offsets[ci] - time.perf_counter()))
            history: list[dict] = []
            failed_turn: int | None = None
            for t, added in enumerate(conversation.turns):
                record = RequestRecord(ci * turns + t, ci, t, conversation.output_len)
                records.append(record)
                if failed_turn is not None:
                    record.error = f"not sent: turn {failed_turn} of this conversation failed"
                    record.start = time.perf_counter() - t0
                    continue
                history += added
                async with slots or contextlib.nullcontext():
                    answer = await send(client, url, headers, request_body(args, history, conversation.output_len),
                                        record, t0, args.timeout)
                if not record.ok:
                    failed_turn = t
                history.append({"role": "assistant", "content": answer})

        await asyncio.gather(*(converse(i, c) for i, c in enumerate(conversations)))
        duration = time.perf_counter() - t0
    return sorted(records, key=lambda r: r.index), duration


async def warm_up(args: argparse.Namespace) -> str:
    """`--warmup` requests of their own texts (never the runs'), sent one at a time; the first error."""
    if not args.warmup:
        return ""
    shape = Shape("random", args.warmup, min(args.input_len, 32), min(args.output_len, 8))
    url, headers = _url(args.base_url, args.endpoint), _headers(args)
    async with _client(args, 1) as client:
        for i, conversation in enumerate(serve_workloads.build(shape, args.seed, variant=-1)):
            record = RequestRecord(i, i, 0, conversation.output_len)
            await send(client, url, headers, request_body(args, list(conversation.turns[0]), record.output_len),
                       record, time.perf_counter(), args.timeout)
            if not record.ok:
                return record.error
    return ""


def _label(rate: float, concurrency: int | None) -> str:
    pace = f"rate {rate:g}/s" if math.isfinite(rate) else "rate inf"
    return pace + (f", concurrency {concurrency}" if concurrency else "")


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def report(label: str, s: dict) -> str:
    """The run's summary as printed (vLLM's layout, so eyes used to it find their numbers)."""
    lines = [f"{'=' * 20} {label} {'=' * 20}",
             f"{'Successful requests:':<40}{s['completed']}",
             f"{'Failed requests:':<40}{s['failed']}"]
    if s["failed"]:
        lines.append(f"{'First error:':<40}{s['first_error']}")
    lines += [f"{'Benchmark duration (s):':<40}{s['duration_s']:.2f}",
              f"{'Total input tokens:':<40}{s['total_input_tokens']}",
              f"{'Total generated tokens:':<40}{s['total_output_tokens']}",
              f"{'Request throughput (req/s):':<40}{_fmt(s['request_throughput'])}",
              f"{'Output token throughput (tok/s):':<40}{_fmt(s['output_throughput'])}",
              f"{'Total token throughput (tok/s):':<40}{_fmt(s['total_token_throughput'])}"]
    if s["goodput"] is not None:
        slos = ", ".join(f"{k} <= {v:g} ms" for k, v in s["slos_ms"].items())
        lines.append(f"{'Goodput (req/s):':<40}{_fmt(s['goodput'])}  ({slos})")
    if s["completed"] and s["output_tokens_from_usage"] < s["completed"]:
        lines.append(f"{'Output tokens counted as chunks:':<40}{s['completed'] - s['output_tokens_from_usage']} "
                     "requests (no usage from the server)")
    if s["short_of_output_len"]:
        lines.append(f"{'Shorter than --output-len:':<40}{s['short_of_output_len']} requests")
    for key, title in (("ttft_ms", "Time to first token"), ("tpot_ms", "Time per output token (excl. 1st)"),
                       ("itl_ms", "Inter-token latency"), ("e2e_ms", "End-to-end latency")):
        d = s[key]
        lines.append(f"{'-' * 8} {title} (ms) {'-' * 8}")
        lines.append("  ".join(f"{name} {_fmt(d[name])}" for name in ("mean", "p50", "p90", "p99")))
    return "\n".join(lines)


def sweep_table(runs: list[dict]) -> str:
    head = ("run", "ok", "fail", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "ITL p50", "E2E p50",
            "E2E p99", "goodput")
    rows = [head]
    for run in runs:
        s = run["summary"]
        rows.append((run["label"], str(s["completed"]), str(s["failed"]), _fmt(s["request_throughput"]),
                     _fmt(s["output_throughput"], 1), _fmt(s["ttft_ms"]["p50"], 1), _fmt(s["ttft_ms"]["p99"], 1),
                     _fmt(s["tpot_ms"]["p50"], 1), _fmt(s["itl_ms"]["p50"], 1), _fmt(s["e2e_ms"]["p50"], 1),
                     _fmt(s["e2e_ms"]["p99"], 1), _fmt(s["goodput"])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    cells = [[c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))]
             for r in rows]
    return "\n".join("  ".join(row) for row in cells)


async def _bench(args: argparse.Namespace) -> dict:
    warmup_error = await warm_up(args)
    if warmup_error:
        print(f"warmup failed: {warmup_error}", flush=True)
    runs = []
    points = [(rate, conc) for rate in args.rates for conc in args.concurrencies]
    for variant, (rate, concurrency) in enumerate(points):
        conversations = serve_workloads.build(args.shape, args.seed, variant)
        records, duration = await run_point(args, conversations, rate, concurrency, variant)
        summary = summarize(records, duration, args.slos)
        label = _label(rate, concurrency)
        print(report(label, summary), flush=True)
        runs.append({"label": label, "request_rate": rate if math.isfinite(rate) else "inf",
                     "max_concurrency": concurrency, "summary": summary,
                     "requests": [r.as_json() for r in records]})
    if len(runs) > 1:
        print(sweep_table(runs), flush=True)
    config = {k: v for k, v in vars(args).items() if k not in ("api_key", "shape", "slos", "rates", "concurrencies")}
    config["api_key"] = "given" if args.api_key else "none"
    config["shape"] = asdict(args.shape)
    return {"benchmark": "serve", "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "config": config, "warmup_error": warmup_error, "runs": runs}


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    result = aio.run(_bench(args))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(_finite(result), handle, indent=1, allow_nan=False)
        print(f"wrote {args.json}")
    if args.plot:
        serve_plot.write_svg(args.plot, result["runs"])
        print(f"wrote {args.plot}")
    return 0


def _finite(value: object) -> object:
    """NaN (a figure with nothing to measure, e.g. TTFT when every request failed) as null: strict JSON."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
