"""A gateway's KV index against real worker processes: it learns what a worker holds from its KVEvents
stream, and converges again after the worker restarts (announcing the disk tier it finds) and after
the gateway's own restart (a fresh index from the snapshot)."""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest

from inferplane.control_plane.routing.kv_events import KVEventSubscriber
from inferplane.control_plane.routing.kv_index import KVIndex
from inferplane.control_plane.routing.prefix import block_hashes
from inferplane.local.supervisor import free_port
from inferplane.v1 import worker_pb2, worker_pb2_grpc

from .conftest import prompts_of_lengths
from .test_worker_process import wait_for_line

BS = 4
TIMEOUT = 120  # a shared, loaded machine: generous, never a speed assertion


def start(model: str, port: int, disk: str):
    import os
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "inferplane.cli", "worker", "--model", model, "--host", "127.0.0.1",
           "--port", str(port), "--metrics-port", "0", "--runtime", "radix", "--device", "cpu",
           "--block-size", str(BS), "--num-kv-blocks", "64", "--kv-offload-disk", "64MiB", "--kv-offload-dir", disk]
    with open(f"{disk}.log", "a") as log:  # its log where a failure can be read, never a full pipe
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    wait_for_line(proc, "worker ready", TIMEOUT)
    return proc


async def converged(predicate, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"the index never showed {what}")
        await asyncio.sleep(0.05)


@pytest.mark.slow
def test_the_index_follows_a_worker_through_its_restart_and_the_gateways(tiny_llama, tmp_path) -> None:
    port = free_port()
    address = f"127.0.0.1:{port}"
    prompt = prompts_of_lengths([37], 320, seed=11)[0]
    names = block_hashes(prompt[:-1], BS, "tenant-a")  # what the gateway computes, never sent by the worker
    worker = start(tiny_llama, port, str(tmp_path))

    async def scenario() -> None:
        nonlocal worker
        channel = grpc.aio.insecure_channel(address)
        stub = worker_pb2_grpc.WorkerStub(channel)

        def subscribe() -> tuple[KVIndex, KVEventSubscriber]:
            index = KVIndex()
            subscriber = KVEventSubscriber(index, lambda: [address], lambda _: stub, retry_s=0.2)
            subscriber.sync()
            return index, subscriber

        index, subscriber = subscribe()
        request = worker_pb2.GenerateRequest(token_ids=worker_pb2.TokenIds(ids=prompt), cache_salt="tenant-a",
                                             params=worker_pb2.SamplingParams(max_tokens=2, temperature=0.0))
        async for _ in stub.Generate(request, timeout=TIMEOUT):
            pass
        await converged(lambda: index.held_runs(names, [address]).get(address) == len(names),
                        "the prompt's blocks in the worker's pool")
        assert index.replica_blocks(address)["disk"] >= len(names)

        # A gateway restart: a new index learns everything from the snapshot.
        await subscriber.close()
        index, subscriber = subscribe()
        await converged(lambda: index.held_runs(names, [address]).get(address) == len(names), "the snapshot")

        # A worker restart (killed, a new process on the same address and disk): the stream ends, the
        # replica's entries go, and the new worker's snapshot announces the disk tier it found.
        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=TIMEOUT)
        await converged(lambda: address not in index.replicas(), "the dead worker forgotten")
        worker = await asyncio.to_thread(start, tiny_llama, port, str(tmp_path))
        await converged(lambda: index.held_runs(names, [address]).get(address) == 0.5 * len(names),
                        "the restarted worker's disk blocks")
        assert "pool" not in index.replica_blocks(address) or index.replica_blocks(address)["pool"] == 0
        # Its next turn reads them back: cached_tokens counts blocks from the disk tier.
        async for message in stub.Generate(request, timeout=TIMEOUT):
            if message.finished:
                assert message.usage.cached_tokens == len(names) * BS
        await converged(lambda: index.held_runs(names, [address]).get(address) == len(names),
                        "the blocks back in the pool")
        await subscriber.close()
        await channel.close()

    try:
        asyncio.run(scenario())
    finally:
        worker.kill()
        worker.wait(timeout=TIMEOUT)
