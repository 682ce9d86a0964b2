"""The worker as a real process: gRPC streaming, cancellation, health transitions, SIGTERM drain."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from inferplane.local.supervisor import free_port
from inferplane.v1 import worker_pb2, worker_pb2_grpc

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVING = health_pb2.HealthCheckResponse.SERVING




def start_worker(model: str, *extra: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    cmd = [sys.executable, "-m", "inferplane.cli", "worker", "--model", model, "--host", "127.0.0.1",
           "--port", str(port), "--metrics-port", "0", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return proc, port


def wait_for_line(proc: subprocess.Popen, prefix: str, timeout: float) -> str:
    """The first line of the worker's stdout that starts with `prefix` (read on a thread, so a
    worker that never prints it fails the test instead of hanging it)."""
    found: queue.Queue[str] = queue.Queue()

    def read() -> None:
        for line in proc.stdout:
            if line.startswith(prefix):
                found.put(line)
                return
        found.put("")  # the worker exited first

    threading.Thread(target=read, daemon=True).start()
    try:
        line = found.get(timeout=timeout)
    except queue.Empty:
        raise AssertionError(f"the worker printed no {prefix!r} line in {timeout} s") from None
    assert line, f"the worker exited before printing {prefix!r}"
    return line


def health(stub, timeout: float = 1) -> int | None:
    try:
        return stub.Check(health_pb2.HealthCheckRequest(service="inferplane.v1.Worker"), timeout=timeout).status
    except grpc.RpcError:
        return None  # not listening yet


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def request(text: str, max_tokens: int, **params) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(text=text, params=worker_pb2.SamplingParams(max_tokens=max_tokens, **params))


@pytest.mark.slow
def test_worker_lifecycle_stream_cancel_and_drain():
    proc, port = start_worker("smollm2-135m", "--drain-grace-seconds", "60")
    try:
        # The server listens before the model loads, and says so. The channel is made only then: one
        # made earlier backs off between refused connections (seconds, growing), and on a busy
        # machine its first answer came after loading had finished.
        wait_for_line(proc, "worker loading:", 120)
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        health_stub = health_pb2_grpc.HealthStub(channel)
        stub = worker_pb2_grpc.WorkerStub(channel)
        seen = [wait_for(lambda: health(health_stub, timeout=30), 60, "the gRPC server")]  # busy machine: patience
        # The server answers while the model is still loading.
        assert seen[0] == NOT_SERVING
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(request("hi", 2), timeout=5))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        wait_for(lambda: health(health_stub) == SERVING, 120, "SERVING")

        info = stub.Info(worker_pb2.InfoRequest())
        assert info.architecture == "llama" and info.max_model_len == 8192

        # A streamed generation: deltas, then a final message with usage.
        chunks = list(stub.Generate(request("The capital of France is", 12, temperature=0.0), timeout=60))
        assert len(chunks) == 12 and chunks[-1].finished and chunks[-1].finish_reason == "length"
        assert "Paris" in "".join(c.text for c in chunks)
        assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].usage.prompt_tokens > 0

        # Chat goes through the model's template.
        chat = worker_pb2.GenerateRequest(
            chat=worker_pb2.Chat(messages=[worker_pb2.ChatMessage(role="user", content="Say hello")]),
            params=worker_pb2.SamplingParams(max_tokens=5))
        assert list(stub.Generate(chat, timeout=60))[-1].finished

        # Bad input names the field.
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(request("x", 5, top_p=1.5), timeout=10))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(worker_pb2.GenerateRequest(params=worker_pb2.SamplingParams(max_tokens=1)), timeout=10))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

        # A cancelled stream aborts its sequence: its blocks come back.
        call = stub.Generate(request("Write a long story about a dragon.", 2000, ignore_eos=True), timeout=60)
        next(call)
        assert stub.Stats(worker_pb2.StatsRequest()).values["blocks_used"] > 0
        call.cancel()
        wait_for(lambda: stub.Stats(worker_pb2.StatsRequest()).values["num_running"] == 0, 30, "abort")
        assert stub.Stats(worker_pb2.StatsRequest()).values["blocks_used"] == 0

        # A deadline is honoured the same way.
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(request("Count to a million:", 3000, ignore_eos=True), timeout=1.0))
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_for(lambda: stub.Stats(worker_pb2.StatsRequest()).values["blocks_used"] == 0, 30, "deadline abort")

        # SIGTERM while a request is in flight: it completes, new work is refused, exit 0.
        result: dict = {}

        def consume():
            result["chunks"] = list(stub.Generate(request("List the planets:", 40, ignore_eos=True), timeout=120))

        consumer = threading.Thread(target=consume)
        consumer.start()
        wait_for(lambda: stub.Stats(worker_pb2.StatsRequest()).values["num_running"] == 1, 30, "in flight")
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: health(health_stub) in (NOT_SERVING, None), 10, "NOT_SERVING on drain")
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(request("hi", 2), timeout=5))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        consumer.join(timeout=120)
        assert result["chunks"][-1].finished and result["chunks"][-1].finish_reason == "length"
        assert len(result["chunks"]) == 40
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("model", ["/nonexistent/model.gguf", "corrupt"])
def test_a_missing_or_corrupt_model_exits_non_zero_with_one_line(model, tmp_path):
    if model == "corrupt":
        bad = tmp_path / "model.gguf"
        bad.write_bytes(b"not a gguf file at all")
        model = str(bad)
    proc, _ = start_worker(model)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode != 0
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "model" in errors[0].lower()


def test_a_cpu_int8_worker_refuses_a_model_that_fails_the_quality_gate(tmp_path):
    from inferplane.bench.tiny_model import make_tiny_model

    model = make_tiny_model(str(tmp_path / "tiny"))
    # Scales 1.5x too large: the start-up gate measures the damage and the worker will not serve.
    proc, _ = start_worker(model, "--runtime", "cpu-int8", "--quant-scale-multiplier", "1.5")
    _, stderr = proc.communicate(timeout=180)
    assert proc.returncode != 0
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "perplexity" in errors[0].lower(), stderr[-2000:]


def test_worker_flags_are_the_engine_options_with_their_defaults() -> None:
    """One home for engine defaults: every EngineOptions field has a flag, defaulting to its value."""
    import argparse

    from inferplane.worker.engine.options import EngineOptions
    from inferplane.worker.serve import cli

    parser = argparse.ArgumentParser()
    cli.configure(parser)
    assert cli.engine_options(parser.parse_args(["--model", "m"])) == EngineOptions()
    changed = cli.engine_options(parser.parse_args(["--model", "m", "--max-num-seqs", "8", "--quantize-head"]))
    assert (changed.max_num_seqs, changed.quantize_head) == (8, True)
    negated = cli.engine_options(parser.parse_args(["--model", "m", "--no-quantize-head", "--no-requantize-q4"]))
    assert (negated.quantize_head, negated.requantize_q4) == (False, False)
