"""`inferplane bench serve`: its statistics and arrival schedule (unit), and the bench itself against a
gateway process serving a real tiny-model worker (its JSON checked against what the server reports)."""

from __future__ import annotations

import json
import math
import random
import xml.etree.ElementTree as ET

import openai
import pytest

from inferplane.bench import serve, serve_plot, serve_workloads
from inferplane.bench.gateway_harness import SERVED_MODEL
from inferplane.bench.serve_stats import (
    RequestRecord,
    arrival_offsets,
    meets,
    parse_slos,
    percentile,
    summarize,
)
from inferplane.bench.serve_workloads import Shape
from tests.e2e.single_worker import single_worker_gateway

# -- unit: schedule, statistics, workloads, plot ---------------------------------------------------


def test_poisson_schedule_is_seeded_increasing_and_has_the_rate() -> None:
    offsets = arrival_offsets(4000, 8.0, random.Random(7))
    assert offsets == arrival_offsets(4000, 8.0, random.Random(7))
    assert offsets != arrival_offsets(4000, 8.0, random.Random(8))
    assert offsets[0] > 0 and all(b > a for a, b in zip(offsets, offsets[1:], strict=False))
    gaps = [b - a for a, b in zip([0.0, *offsets[:-1]], offsets, strict=True)]
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 8, rel=0.05)  # exponential gaps of mean 1/rate
    # exponential: about e^-1 of the gaps are longer than the mean (a uniform or fixed schedule is not)
    assert sum(g > 1 / 8 for g in gaps) / len(gaps) == pytest.approx(math.exp(-1), abs=0.03)
    assert arrival_offsets(3, math.inf, random.Random(0)) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="positive"):
        arrival_offsets(3, 0.0, random.Random(0))


def test_percentile_interpolates_between_ranks() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == 2.5
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile([5.0], 99) == 5.0
    assert math.isnan(percentile([], 50))


def _record(index: int, ttft: float, e2e: float, tokens: int, itl: list[float]) -> RequestRecord:
    return RequestRecord(index, index, 0, output_len=tokens, ok=True, ttft=ttft, e2e=e2e, itl=itl,
                         prompt_tokens=10, output_tokens=tokens, token_source="usage", chunks=len(itl) + 1)


def test_summary_throughput_tpot_itl_and_goodput() -> None:
    records = [_record(0, 0.1, 1.1, 11, [0.1] * 10),  # TPOT 100 ms
               _record(1, 0.3, 0.8, 6, [0.1] * 5),  # TPOT 100 ms
               _record(2, 0.05, 0.05, 1, []),  # one token: no TPOT
               RequestRecord(3, 3, 0, 8, error="HTTP 401: bad key"),
               RequestRecord(4, 4, 0, 8, error="HTTP 500: later")]
    s = summarize(records, duration=2.0, slos={"ttft": 200, "tpot": 150})
    assert (s["requests"], s["completed"], s["failed"], s["first_error"]) == (5, 3, 2, "HTTP 401: bad key")
    assert s["request_throughput"] == 1.5 and s["output_throughput"] == 9.0 and s["total_token_throughput"] == 24.0
    assert s["ttft_ms"]["p50"] == pytest.approx(100) and s["ttft_ms"]["mean"] == pytest.approx(150)
    assert s["tpot_ms"]["p50"] == pytest.approx(100) and s["tpot_ms"]["p99"] == pytest.approx(100)
    assert s["itl_ms"]["mean"] == pytest.approx(100)  # 15 gaps pooled
    assert s["e2e_ms"]["p99"] == pytest.approx(1094)  # 800 + 0.98 * (1100 - 800)
    assert s["goodput"] == 1.0  # record 1 misses TTFT 200 ms; record 2 has no TPOT to miss
    assert s["short_of_output_len"] == 0 and s["output_tokens_from_usage"] == 3
    assert summarize(records, 2.0, {})["goodput"] is None
    assert not meets(records[3], {"ttft": 1e9})
    empty = summarize([RequestRecord(0, 0, 0, 8, error="x")], 1.0, {"e2el": 1})
    assert empty["goodput"] == 0 and math.isnan(empty["ttft_ms"]["p50"])


def test_slos_parse_and_reject() -> None:
    assert parse_slos(["ttft:500", "tpot:50", "e2el:2000"]) == {"ttft": 500, "tpot": 50, "e2el": 2000}
    for bad in ("ttft", "itl:5", "ttft:fast", "tpot:-1"):
        with pytest.raises(ValueError, match="goodput"):
            parse_slos([bad])


def test_workloads_shapes_and_variants() -> None:
    multi = serve_workloads.build(Shape("multi-turn", 6, input_len=5, turns=3, prefix_len=7), seed=1, variant=0)
    assert len(multi) == 2 and all(len(c.turns) == 3 for c in multi)
    assert multi[0].turns[0][0]["role"] == "system" and len(multi[0].turns[0][0]["content"].split()) == 7
    assert all(len(turn) == 1 and turn[0]["role"] == "user" for turn in multi[0].turns[1:])
    shared = serve_workloads.build(Shape("shared-prefix", 3, input_len=4, prefix_len=9), seed=1, variant=0)
    assert len({c.turns[0][0]["content"] for c in shared}) == 1 and len({c.turns[0][1]["content"] for c in shared}) == 3
    other = serve_workloads.build(Shape("shared-prefix", 3, input_len=4, prefix_len=9), seed=1, variant=1)
    assert other[0].turns[0][0] != shared[0].turns[0][0]  # a later run of a sweep sends other texts
    rag = serve_workloads.build(Shape("spec-rag", 2), seed=0, variant=0)
    assert "Documents:" in rag[0].turns[0][0]["content"]
    with pytest.raises(ValueError, match="multiple of --turns"):
        serve_workloads.check(Shape("multi-turn", 5, turns=3))
    with pytest.raises(ValueError, match="--workload"):
        serve_workloads.check(Shape("sharegpt", 5))


def test_bad_arguments_exit_with_the_flag_named(capsys) -> None:
    for argv, flag in ((["--request-rate", "0"], "--request-rate"), (["--max-concurrency", "a"], "--max-concurrency"),
                       (["--goodput", "ttft"], "--goodput"), (["--workload", "multi-turn", "--num-prompts", "4"],
                                                              "--turns")):
        with pytest.raises(SystemExit) as exited:
            serve.main(["--base-url", "http://127.0.0.1:9", "--model", "m", *argv])
        assert exited.value.code == 2 and flag in capsys.readouterr().err


def test_plot_is_svg_with_a_line_per_series() -> None:
    records = [_record(i, 0.01 * (i + 1), 0.1 * (i + 1), 4, [0.02] * 3).as_json() for i in range(5)]
    runs = [{"label": f"rate {r}/s", "requests": records, "summary": summarize(
        [_record(i, 0.01, 0.1, 4, []) for i in range(3)], 1.0, {})} for r in (1, 2)]
    root = ET.fromstring(serve_plot.svg(runs))
    lines = root.findall("{http://www.w3.org/2000/svg}polyline")
    assert len(lines) == 2 * 2 + 4  # TTFT and E2E CDFs per run, then four percentile series
    assert len(ET.fromstring(serve_plot.svg(runs[:1])).findall("{http://www.w3.org/2000/svg}polyline")) == 2


def _sent(events: list[str] | None, status: int = 200, timeout: float = 30.0) -> tuple[RequestRecord, str]:
    """`serve.send` against a stand-in server answering `events` as SSE lines (None: a stream that
    never ends), for the stream shapes a live server seldom produces on demand."""
    import asyncio

    import httpx

    async def body():
        for event in events or []:
            yield f"{event}\n\n".encode()
        if events is None:
            await asyncio.Event().wait()

    async def go() -> tuple[RequestRecord, str]:
        transport = httpx.MockTransport(lambda request: httpx.Response(status, content=body()))
        async with httpx.AsyncClient(transport=transport) as client:
            record = RequestRecord(0, 0, 0, output_len=4)
            text = await serve.send(client, "http://server/v1/completions", {}, {}, record, 0.0, timeout)
            return record, text

    return asyncio.run(go())


def test_send_reads_streams_and_counts_failures() -> None:
    chunk = 'data: {"choices": [{"index": 0, "text": "%s", "finish_reason": %s}]}'
    record, text = _sent([": keep-alive", chunk % ("ab", "null"), chunk % ("c", '"length"'), "data: [DONE]"])
    assert record.ok and text == "abc" and record.chunks == 2 and len(record.itl) == 1
    assert record.token_source == "chunks" and record.output_tokens == 2  # no usage: chunks counted
    assert record.finish_reason == "length" and record.prompt_tokens is None
    record, _ = _sent([chunk % ("ab", "null"), 'data: {"choices": [], "usage": {"prompt_tokens": 7, '
                                               '"completion_tokens": 5}}', "data: [DONE]"])
    assert record.ok and (record.token_source, record.output_tokens, record.prompt_tokens) == ("usage", 5, 7)
    record, _ = _sent([chunk % ("ab", "null"), 'data: {"error": {"message": "worker lost", "code": 503}}'])
    assert not record.ok and "worker lost" in record.error
    record, _ = _sent([chunk % ("ab", "null")])
    assert not record.ok and record.error == "the stream ended without [DONE]"
    record, _ = _sent(["data: {not json"])
    assert not record.ok and record.error.startswith("JSONDecodeError")
    record, _ = _sent(['{"error": {"message": "bad model"}}'], status=404)
    assert not record.ok and record.status == 404 and record.error == 'HTTP 404: {"error": {"message": "bad model"}}'
    record, _ = _sent(None, timeout=0.05)  # a stream that never ends
    assert not record.ok and record.error == "no complete answer within --timeout 0.05 s"


# -- end to end: the bench against a gateway and a real worker -------------------------------------


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    with single_worker_gateway(tmp_path_factory, max_num_seqs=4) as running:
        yield running.gateway


def _bench(gateway, tmp_path, *argv: str, key: str | None = None) -> dict:
    out = tmp_path / "serve.json"
    assert serve.main(["--base-url", gateway.base_url, "--model", SERVED_MODEL, "--api-key", key or gateway.key,
                       "--json", str(out), "--input-len", "8", "--output-len", "12", *argv]) == 0
    return json.loads(out.read_text())


@pytest.mark.slow
def test_a_run_measures_what_the_server_reports(gateway, tmp_path) -> None:
    plot = tmp_path / "serve.svg"
    result = _bench(gateway, tmp_path, "--num-prompts", "6", "--max-concurrency", "2", "--ignore-eos", "--seed", "3",
                    "--goodput", "ttft:60000", "tpot:60000", "--plot", str(plot))
    (run,) = result["runs"]
    s, records = run["summary"], run["requests"]
    assert result["warmup_error"] == "" and result["config"]["api_key"] == "given"
    assert (s["completed"], s["failed"], len(records)) == (6, 0, 6)
    client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=gateway.key, max_retries=0, timeout=120)
    sent = serve_workloads.build(Shape("random", 6, input_len=8, output_len=12), seed=3, variant=0)
    for record, conversation in zip(records, sent, strict=True):
        assert record["ok"] and record["token_source"] == "usage" and record["finish_reason"] == "length"
        assert record["output_tokens"] == 12  # max_tokens, as the usage chunk says
        assert record["output_chars"] == 12  # the tiny model's tokens are single ASCII bytes
        assert record["chunks"] >= 1 and len(record["itl"]) == record["chunks"] - 1
        assert 0 < record["ttft"] <= record["e2e"]
        again = client.chat.completions.create(model=SERVED_MODEL, messages=list(conversation.turns[0]), max_tokens=1)
        assert record["prompt_tokens"] == again.usage.prompt_tokens
    assert s["total_output_tokens"] == 72 and s["short_of_output_len"] == 0
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        d = s[key]
        assert 0 <= d["p50"] <= d["p90"] <= d["p99"], (key, d)
    within = sum(r["ttft"] <= 60 and r["tpot"] <= 60 for r in records)
    assert s["goodput"] == pytest.approx(within / s["duration_s"]) and s["goodput"] <= s["request_throughput"]
    assert s["output_throughput"] == pytest.approx(s["request_throughput"] * 12)
    assert ET.parse(plot).getroot().tag == "{http://www.w3.org/2000/svg}svg"


@pytest.mark.slow
def test_a_sweep_runs_each_value_in_turn_multi_turn_on_completions(gateway, tmp_path) -> None:
    result = _bench(gateway, tmp_path, "--workload", "multi-turn", "--turns", "2", "--num-prompts", "4",
                    "--prefix-len", "4", "--input-len", "4", "--endpoint", "/v1/completions",
                    "--request-rate", "50,inf", "--max-concurrency", "1,2", "--warmup", "0")
    runs = result["runs"]
    assert [(r["request_rate"], r["max_concurrency"]) for r in runs] == [(50, 1), (50, 2), ("inf", 1), ("inf", 2)]
    for run in runs:
        assert run["summary"]["completed"] == 4 and run["summary"]["failed"] == 0
        by_turn = {(r["conversation"], r["turn"]): r for r in run["requests"]}
        for c in (0, 1):  # the second turn carries the first turn and its answer
            assert by_turn[c, 1]["prompt_tokens"] > by_turn[c, 0]["prompt_tokens"] + by_turn[c, 0]["output_tokens"]
            assert by_turn[c, 1]["start"] >= by_turn[c, 0]["start"] + by_turn[c, 0]["e2e"] - 1e-9


@pytest.mark.slow
def test_a_bad_key_is_counted_as_failures_with_the_error(gateway, tmp_path, capsys) -> None:
    result = _bench(gateway, tmp_path, "--num-prompts", "3", "--max-concurrency", "2", key="ip_not-a-key")
    (run,) = result["runs"]
    s = run["summary"]
    assert (s["completed"], s["failed"]) == (0, 3)
    assert s["first_error"].startswith("HTTP 401:") and "key" in s["first_error"].lower()
    assert result["warmup_error"] == s["first_error"]
    assert s["ttft_ms"]["p50"] is None and s["request_throughput"] == 0  # NaN written as null
    printed = capsys.readouterr().out
    assert "Failed requests:" in printed and "HTTP 401" in printed
