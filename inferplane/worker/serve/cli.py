"""`inferplane worker`: one process, one model replica, served over gRPC.

The engine flags are made from `EngineOptions`' fields, with their defaults and help (one home for
them); the operator's manifests and the local supervisor start workers with the flags that
`api.resolve.ResolvedDeployment.engine_args` writes from a spec. `--runtime embedding` serves an
embedding model (worker/embedding/) instead of a generative engine, with the same server,
metrics and drain.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import TYPE_CHECKING

from inferplane.worker.engine.options import EngineOptions

if TYPE_CHECKING:
    from inferplane.worker.serve.metrics import WorkerMetrics
    from inferplane.worker.serve.server import WorkerState


def _flag_type(annotation: str) -> type | None:
    """The argparse type for an EngineOptions field's annotation (None: a switch)."""
    if "str" in annotation:
        return str
    if annotation in ("bool", "bool | None"):
        return None
    return float if "float" in annotation else int


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="alias (e.g. smollm2-135m), .gguf file or HF folder")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=50051, help="gRPC port (0 picks a free one)")
    parser.add_argument("--metrics-port", type=int, default=9090, help="Prometheus /metrics port (0 disables)")
    parser.add_argument("--served-model-name", default=None, help="name reported to the gateway")
    parser.add_argument("--drain-grace-seconds", type=float, default=30.0)
    parser.add_argument("--preload-adapter", action="append", default=[], metavar="NAME=URI#SHA256",
                        help="a LoRA adapter to fetch and load into a slot before serving (repeatable; the "
                             "digest may be left out for a local folder); needs --max-loras")
    for option in dataclasses.fields(EngineOptions):
        flag, meta = "--" + option.name.replace("_", "-"), option.metadata
        shown = argparse.SUPPRESS if meta["hidden"] else meta["help"]
        kind = _flag_type(str(option.type))
        if kind is None:  # --flag and --no-flag: a resolved spec can say either (api.resolve.engine_args)
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=option.default, help=shown)
        else:
            parser.add_argument(flag, type=kind, default=option.default, choices=meta["choices"], help=shown)


def engine_options(args: argparse.Namespace) -> EngineOptions:
    """Every EngineOptions field from the flag of the same name (a new option needs a flag, or fails here)."""
    return EngineOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineOptions)})


def _build_engine(args: argparse.Namespace):
    from inferplane.worker.engine.engine import Engine
    from inferplane.worker.engine.runtimes import check_runtime, prepare_weights
    from inferplane.worker.model.loader import load_model
    from inferplane.worker.serve import footprint

    check_runtime(args.runtime)
    options = engine_options(args)
    options.validate()
    _refuse_embedding_model(args.model)
    device = options.resolve_device()
    dtype = options.resolve_dtype(device)
    memory = _memory_plan(args.model, options, device)
    if memory is not None and memory.kv_cache_memory is not None:
        options = dataclasses.replace(options, kv_cache_memory=memory.kv_cache_memory)
    loaded = load_model(args.model, device, dtype, max_positions=args.max_model_len)
    footprint.release_freed_memory()  # the file's dequantizing temporaries
    report = prepare_weights(options, loaded)
    footprint.release_freed_memory()  # cpu-int8: the float32 weights it converted
    engine = Engine(loaded, options, device, dtype)
    if memory is not None:
        report.update(memory.figures())
    measured = footprint.resident_bytes()
    if measured is not None:
        report["memory_resident_bytes"], report["memory_peak_bytes"] = map(float, measured)
    return engine, report, _preload_adapters(engine, args.preload_adapter)


def _memory_plan(model: str, options: EngineOptions, device):
    """The footprint against the memory limit, before anything is loaded (worker/serve/footprint.py):
    MemoryTooSmall (the start fails with its message) where the model cannot fit; a warning where
    the KV pool was fitted below what was asked for."""
    import logging

    from inferplane.api.model_config import read_model_config
    from inferplane.worker.model.loader import resolve_model_path
    from inferplane.worker.serve import footprint

    if device.type != "cpu":  # the weights and KV live in GPU memory, which the engine sizes itself
        return None
    path = resolve_model_path(model)
    config = read_model_config(path)
    settled = options.settled(device)
    max_model_len = min(options.max_model_len or config.max_position_embeddings, config.max_position_embeddings)
    memory = footprint.plan(config, settled, model_path=path, device_type=device.type, max_model_len=max_model_len,
                            limit=footprint.memory_limit())
    if memory is not None and memory.warning:
        logging.getLogger(__name__).warning("%s", memory.warning)
    return memory


def _preload_adapters(engine, flags: list[str]):
    """Fetches and loads each --preload-adapter into a slot (before the engine serves anything, so
    nothing else touches the slots); returns the adapter source requests then share (None without)."""
    if not flags:
        return None
    if engine.adapters is None:
        raise ValueError("--preload-adapter: this engine serves no adapters; set --max-loras")
    if len(flags) > engine.adapters.max_loras:
        raise ValueError(f"--preload-adapter: {len(flags)} adapters for {engine.adapters.max_loras} slots")
    from inferplane.worker.lora.catalog import AdapterCatalog
    from inferplane.worker.lora.sources import AdapterSource

    source = AdapterSource(AdapterCatalog.for_engine(engine))
    for flag in flags:
        name, sep, rest = flag.partition("=")
        if not sep or not name or not rest:
            raise ValueError(f"--preload-adapter: {flag!r} is not NAME=URI#SHA256")
        uri, _, sha256 = rest.rpartition("#") if "#" in rest else (rest, "", "")
        adapter = source.adapter(name, uri, sha256)
        if engine.adapters.acquire(adapter) is None:
            raise ValueError(f"--preload-adapter: no free slot for {name!r}")
    return source


def _refuse_embedding_model(model: str) -> None:
    """A generative runtime given an embedding model's folder says so, rather than 'unsupported
    architecture' from the generative loader."""
    import os

    from inferplane.api.architectures import model_kind
    from inferplane.worker.embedding.encoder import folder_architecture

    architecture = folder_architecture(os.path.expanduser(model))
    if model_kind(architecture) == "embedding":
        raise ValueError(f"model {model!r} ({architecture}) is an embedding model: start the worker with "
                         "--runtime embedding (a deployment: kind: embedding)")


def _build_embedder(args: argparse.Namespace):
    """The embedding runtime's encoder and its settled options: the engine flags that keep a meaning
    there are device, dtype, max_model_len (at most the model's positions), max_num_seqs (inputs per
    forward) and max_num_batched_tokens (padded tokens per forward); the KV ones have nothing to size."""
    from inferplane.worker.embedding.encoder import load_encoder

    options = engine_options(args)
    options.validate()
    device = options.resolve_device()
    options = options.settled(device)
    encoder = load_encoder(args.model, device, options.resolve_dtype(device), max_model_len=args.max_model_len)
    return encoder, options


def _install_engine(state: WorkerState, args: argparse.Namespace, built) -> tuple[WorkerMetrics, str]:
    """A generative engine into the worker's state: (its metrics, the ready line's details)."""
    from inferplane.worker.serve.async_engine import AsyncEngine
    from inferplane.worker.serve.metrics import WorkerMetrics

    engine, report, state.adapter_source = built
    state.extra_stats = {k: float(v) for k, v in report.items()}
    state.info = dict(model=state.model, runtime=args.runtime, max_model_len=engine.max_model_len,
                      block_size=engine.block_size, architecture=engine.loaded.config.architecture,
                      device=str(engine.device), dtype=str(engine.dtype).removeprefix("torch."),
                      **(engine.tokenizer.to_wire() if engine.tokenizer is not None else {}))
    if engine.kv.tiers is not None:  # what it keeps, it can hand to another worker and take from one
        from inferplane.worker.serve.kv_transfer import KVTransfer

        state.transfer = KVTransfer(engine.kv.tiers.store)
    metrics = WorkerMetrics(state.model, args.runtime,
                            lambda: {**state.engine.last_stats, **state.extra_stats, **state.live_stats()})
    state.engine = AsyncEngine(engine, on_finished=metrics.observe_finished)
    details = f"kv_blocks={engine.kv.num_blocks} kv_dtype={str(engine.kv_dtype).removeprefix('torch.')}"
    memory = {name: state.extra_stats.get(f"memory_{name}_bytes") for name in ("resident", "peak", "estimate",
                                                                                 "estimate_needed", "limit")}
    if memory["resident"]:
        details += " memory=" + "/".join(f"{name}:{(memory[name] or 0) / 2**20:.0f}MiB" for name in memory)
    return metrics, details


def _install_embedder(state: WorkerState, args: argparse.Namespace, built) -> tuple[WorkerMetrics, str]:
    """An embedding model's batcher into the worker's state: (its metrics, the ready line's details)."""
    from inferplane.worker.embedding.batcher import EmbeddingBatcher
    from inferplane.worker.serve.metrics import WorkerMetrics

    encoder, options = built
    state.info = dict(model=state.model, runtime=args.runtime, max_model_len=encoder.max_model_len,
                      block_size=args.block_size, architecture=encoder.architecture,
                      device=str(encoder.device), dtype=str(encoder.dtype).removeprefix("torch."),
                      embedding_dimensions=encoder.dimensions, **encoder.tokenizer.to_wire())
    metrics = WorkerMetrics(state.model, args.runtime, lambda: {**state.embedder.last_stats, **state.extra_stats})
    state.embedder = EmbeddingBatcher(encoder, max_inputs=options.max_num_seqs,
                                      max_tokens=options.max_num_batched_tokens, on_finished=metrics.observe_embedding)
    return metrics, f"dimensions={encoder.dimensions} max_model_len={encoder.max_model_len}"


async def _serve(args: argparse.Namespace) -> int:
    import asyncio

    from prometheus_client import start_http_server

    from inferplane.worker.serve.server import WorkerServer, WorkerState, print_line

    embedding = args.runtime == "embedding"
    build, install = (_build_embedder, _install_embedder) if embedding else (_build_engine, _install_engine)
    name = args.served_model_name or args.model
    state = WorkerState(model=name, runtime=args.runtime)
    server = WorkerServer(state, args.host, args.port)
    await server.start()
    print_line(f"worker loading: model={args.model} runtime={args.runtime} grpc={args.host}:{server.port}")
    try:
        built = await asyncio.get_running_loop().run_in_executor(None, build, args)
    except Exception as exc:  # any load failure: one line, non-zero exit
        print(f"error: {exc}", file=sys.stderr, flush=True)
        await server.server.stop(0)
        return 1
    metrics, details = install(state, args, built)
    if args.metrics_port:
        start_http_server(args.metrics_port, addr=args.host, registry=metrics.registry)
    if not server.stop_requested.is_set():
        await server.set_serving(True)
        print_line(f"worker ready: model={name} runtime={args.runtime} grpc={args.host}:{server.port} "
                   f"metrics={args.metrics_port or 'off'} {details}")
    await server.stop_requested.wait()
    print_line("worker draining")
    await server.drain(args.drain_grace_seconds)
    print_line("worker stopped")
    return 0


def run(args: argparse.Namespace) -> int:
    import logging

    from inferplane import aio

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return aio.run(_serve(args))
