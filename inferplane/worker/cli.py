"""`inferplane worker`: one process, one model replica, served over gRPC.

The engine flags are made from `EngineOptions`' fields, with their defaults and help (one home for
them); the operator's manifests and the local supervisor start workers with the flags that
`api.resolve.ResolvedDeployment.engine_args` writes from a spec.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from inferplane.worker.options import EngineOptions


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
    from inferplane.worker.engine import Engine
    from inferplane.worker.model.loader import load_model
    from inferplane.worker.runtimes import check_runtime, prepare_weights

    check_runtime(args.runtime)
    options = engine_options(args)
    options.validate()
    device = options.resolve_device()
    dtype = options.resolve_dtype(device)
    loaded = load_model(args.model, device, dtype, max_positions=args.max_model_len)
    report = prepare_weights(options, loaded)
    return Engine(loaded, options, device, dtype), report


async def _serve(args: argparse.Namespace) -> int:
    import asyncio

    from prometheus_client import start_http_server

    from inferplane.worker.async_engine import AsyncEngine
    from inferplane.worker.metrics import WorkerMetrics
    from inferplane.worker.server import WorkerServer, WorkerState, print_line

    name = args.served_model_name or args.model
    state = WorkerState(model=name, runtime=args.runtime)
    server = WorkerServer(state, args.host, args.port)
    await server.start()
    print_line(f"worker loading: model={args.model} runtime={args.runtime} grpc={args.host}:{server.port}")
    try:
        engine, report = await asyncio.get_running_loop().run_in_executor(None, _build_engine, args)
    except Exception as exc:  # any load failure: one line, non-zero exit
        print(f"error: {exc}", file=sys.stderr, flush=True)
        await server.server.stop(0)
        return 1
    state.extra_stats = {k: float(v) for k, v in report.items()}
    state.info = dict(model=name, runtime=args.runtime, max_model_len=engine.max_model_len,
                      block_size=engine.block_size, architecture=engine.loaded.config.architecture,
                      device=str(engine.device), dtype=str(engine.dtype).removeprefix("torch."),
                      **(engine.tokenizer.to_wire() if engine.tokenizer is not None else {}))
    metrics = WorkerMetrics(name, args.runtime, lambda: {**state.engine.last_stats, **state.extra_stats})
    state.engine = AsyncEngine(engine, on_finished=metrics.observe_finished)
    if args.metrics_port:
        start_http_server(args.metrics_port, addr=args.host, registry=metrics.registry)
    if not server.stop_requested.is_set():
        await server.set_serving(True)
        print_line(f"worker ready: model={name} runtime={args.runtime} grpc={args.host}:{server.port} "
                   f"metrics={args.metrics_port or 'off'} kv_blocks={engine.kv.num_blocks} "
                   f"kv_dtype={str(engine.kv_dtype).removeprefix('torch.')}")
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
