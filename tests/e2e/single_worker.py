"""One tiny-model worker behind one gateway process, for the end-to-end gateway tests."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from inferplane.bench.gateway_harness import GatewayProcess, free_port, start_gateway, start_worker, wait_serving
from inferplane.bench.tiny_model import make_tiny_model


@dataclass
class SingleWorker:
    gateway: GatewayProcess
    worker_address: str
    logs: Path


@contextmanager
def single_worker_gateway(tmp_path_factory: pytest.TempPathFactory, max_num_seqs: int, *,
                          worker_extra: tuple[str, ...] = (), gateway_extra: tuple[str, ...] = ()
                          ) -> Iterator[SingleWorker]:
    """Starts both (the worker with a 256-token context), yields them, stops both; the gateway's
    log must hold no traceback."""
    model = make_tiny_model(tmp_path_factory.mktemp("tiny-model"))
    logs = tmp_path_factory.mktemp("logs")
    address = f"127.0.0.1:{free_port()}"
    worker = start_worker(model, int(address.rsplit(":", 1)[1]), "--max-model-len", "256",
                          "--max-num-seqs", str(max_num_seqs), *worker_extra, log_path=str(logs / "worker.log"))
    gateway = None
    try:
        wait_serving(address, worker)
        gateway = start_gateway([address], log_path=str(logs / "gateway.log"), extra=gateway_extra)
        yield SingleWorker(gateway, address, logs)
    finally:
        if gateway is not None:
            gateway.stop()
        worker.kill()
        worker.wait()
    log = (logs / "gateway.log").read_text()
    assert "Traceback" not in log, log
