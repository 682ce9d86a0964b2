"""`inferplane up`: run the platform on this machine; Ctrl-C stops everything."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="*", help="InferenceDeployment YAML files (default: smollm2-135m on the CPU)")
    add_platform_arguments(parser)


def add_platform_arguments(parser: argparse.ArgumentParser) -> None:
    """Where and how the platform runs: `up` and `serve` take the same."""
    parser.add_argument("--home", default=os.environ.get("INFERPLANE_HOME", str(Path.home() / ".inferplane")),
                        help="state folder (SQLite database, keys, logs)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080, help="REST gateway port")
    parser.add_argument("--grpc-port", type=int, default=8081, help="tenant gRPC API port (0 disables)")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="the gateway's Prometheus /metrics port, apart from the API port (its series name "
                             "tenants, keys and adapters); 0 disables it (default: a free port, shown in the banner "
                             "and by `inferplane status`)")
    parser.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for the workers")


def _python() -> str:
    """The interpreter that has `openai` installed next to inferplane (the venv's, under make up)."""
    return os.path.relpath(sys.executable) if sys.executable.startswith(os.getcwd()) else sys.executable


def _inferplane() -> str:
    """How to run `inferplane` from the shell that ran this one: the same script (under `make up`
    it is .venv/bin/inferplane, not on PATH), else this interpreter with `-m inferplane.cli`."""
    script = Path(sys.argv[0])
    if script.name == "inferplane" and script.exists():
        return os.path.relpath(script) if str(script.resolve()).startswith(os.getcwd()) else str(script.resolve())
    return f"{_python()} -m inferplane.cli"


def _example_model(platform, deployments) -> tuple[str, str]:
    """The model the banner's examples call and how: the first generative one, asked as a "chat"
    where its tokenizer has a template, else for a "completion" (a base model without one answers a
    chat call with a 400); an "embedding" call only where every model is an embedding model."""
    from inferplane.control_plane.errors import ModelNotFound

    embedding = None
    for deployment in deployments:
        try:
            served = platform.gateway.catalog.get(deployment.served_model_name, None)
        except ModelNotFound:
            continue
        if served.kind == "generate":
            return served.name, "chat" if served.tokenizer.chat_template is not None else "completion"
        embedding = embedding or served.name
    return (embedding, "embedding") if embedding else (deployments[0].served_model_name, "chat")


def _examples(base: str, model: str, mode: str) -> list[str]:
    """A curl and an `openai` client call of `model`: a chat, a completion or an embedding."""
    auth = "-H \"Authorization: Bearer $INFERPLANE_API_KEY\" -H 'Content-Type: application/json' \\"
    client = (f"  {_python()} -c \"import os; from openai import OpenAI; c = OpenAI(base_url='{base}/v1', "
              f"api_key=os.environ['INFERPLANE_API_KEY']); ")
    if mode == "chat":
        return [f"  curl -s {base}/v1/chat/completions {auth}",
                f"    -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}], "
                f"\"max_tokens\": 32}}'",
                client + f"print(c.chat.completions.create(model='{model}', "
                f"messages=[{{'role': 'user', 'content': 'Hello!'}}], max_tokens=32).choices[0].message.content)\""]
    if mode == "embedding":
        return [f"  curl -s {base}/v1/embeddings {auth}",
                f"    -d '{{\"model\": \"{model}\", \"input\": \"The capital of France is Paris.\"}}'",
                client + f"print(len(c.embeddings.create(model='{model}', "
                f"input='The capital of France is Paris.').data[0].embedding))\""]
    return [f"  curl -s {base}/v1/completions {auth}",
            f"    -d '{{\"model\": \"{model}\", \"prompt\": \"The capital of France is\", \"max_tokens\": 32}}'",
            client + f"print(c.completions.create(model='{model}', prompt='The capital of France is', "
            f"max_tokens=32).choices[0].text)\""]


def banner(platform, host: str, port: int, grpc_port: int | None) -> str:
    """What `inferplane up` prints once the workers serve. Every command in it works when pasted
    into a POSIX shell, in order: the first exports the tenant key the others use."""
    base = f"http://{host}:{port}"
    deployments = list(platform.supervisor.deployments.values())
    model, mode = _example_model(platform, deployments)
    key = platform.tenant_key
    models = ", ".join(sorted(d.served_model_name for d in deployments))
    lines = ["", f"inferplane is up: {base}/v1  (models: {models})"]
    if key:
        lines += [f"tenant 'default' API key (shown once, keep it): {key}"]
        export = f"export INFERPLANE_API_KEY={key}"
    else:
        lines += ["the tenant key was shown on the first start; the first command below makes a new one"]
        # Through the admin API, which needs no access to the database file (a key written straight
        # to the database works at once too: the gateway's key cache catches up on an unknown key).
        export = (f"export INFERPLANE_API_KEY=$(curl -s -X POST {base}/admin/v1/keys "
                  f"-H \"Authorization: Bearer $(cat {platform.home / 'admin-key'})\" "
                  "-H 'Content-Type: application/json' -d '{\"tenant_id\": \"default\"}' | "
                  f"{_python()} -c 'import json, sys; print(json.load(sys.stdin)[\"key\"])')")
    lines += [f"admin key: in {platform.home / 'admin-key'}",
              f"model files: copy weights into {platform.home / 'models'} to register them through the admin API",
              f"console: {base}/console/  (sign in with the tenant key, or the admin key for the operator pages)",
              "", "try it:", f"  {export}", *_examples(base, model, mode), ""]
    if grpc_port:
        lines += [f"gRPC tenant API (inferplane.v1.Inference) on {host}:{grpc_port}"]
    gateway_metrics = platform.gateway_metrics_url
    lines += [f"metrics: {gateway_metrics or 'off'} (gateway)" + "".join(
        f", http://127.0.0.1:{r.metrics_port}/metrics ({d.name}[{r.index}])" for d in deployments for r in d.replicas),
        f"logs: {platform.home / 'logs'}    status: {_inferplane()} status --home {platform.home}",
        "", "Ctrl-C stops everything.", ""]
    return "\n".join(lines)


async def _main(args: argparse.Namespace) -> int:
    from inferplane.api.deployment import SpecError
    from inferplane.local.manifests import kept_documents, read_manifests

    try:
        # the built-in default only where nothing is given and nothing was kept from an earlier run
        manifests = read_manifests(args.files, default=not kept_documents(Path(args.home).expanduser()))
    except (OSError, SpecError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return await run_platform(args, manifests)


async def run_platform(args: argparse.Namespace, manifests: list) -> int:
    """Runs the platform with `manifests` (platform.Manifest) until a signal: the banner once the
    workers serve; 2 for a model that cannot be served, 1 for workers that did not start."""
    import asyncio
    import signal

    from inferplane.api.deployment import SpecError
    from inferplane.api.model_resolution import ModelResolutionError
    from inferplane.control_plane.db import DatabaseUnusable
    from inferplane.local.deployment_control import LocalDeploymentControl
    from inferplane.local.platform import LocalPlatform
    from inferplane.storage.fetch import FetchError

    grpc_port = args.grpc_port or None
    if args.metrics_port is not None and not 0 <= args.metrics_port < 65536:
        print("error: --metrics-port must be 0..65535 (0: off)", file=sys.stderr)
        return 2
    metrics_port = 0 if args.metrics_port is None else args.metrics_port or None
    try:
        platform = LocalPlatform(Path(args.home).expanduser(), manifests, args.host, args.port, grpc_port,
                                 metrics_port=metrics_port)
        # deployments added, changed and removed through the admin API while it runs
        platform.gateway.context.deployment_control = LocalDeploymentControl(platform, args.ready_timeout)
    except (DatabaseUnusable, SpecError) as exc:  # a damaged SQLite file, a bad kept deployment: one line
        print(f"error: {exc}", file=sys.stderr)
        return 2
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # SIGHUP too: closing the terminal must stop the workers as Ctrl-C does, not orphan them.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, stop.set)
    try:
        try:
            await platform.start()
        except (ModelResolutionError, FetchError, ValueError) as exc:  # InvalidInput is a ValueError
            print(f"error: {exc}", file=sys.stderr, flush=True)
            return 2
        for name, fetched in platform.fetches.items():
            how = (f"fetched {fetched.size_bytes / 2**20:.1f} MiB in {fetched.fetch_seconds:.2f} s"
                   if fetched.downloaded else "in the cache")
            print(f"model of {name}: {how}, verified in {fetched.verify_seconds:.2f} s ({fetched.sha256[:12]})",
                  flush=True)
        print(f"starting workers (logs in {platform.home / 'logs'}) ...", flush=True)
        ready = asyncio.create_task(platform.wait_ready(args.ready_timeout))
        done, _ = await asyncio.wait({ready, asyncio.create_task(stop.wait())}, return_when=asyncio.FIRST_COMPLETED)
        if ready in done and not ready.result():
            problems = platform.supervisor.failed_to_start() or ["workers did not become ready in time"]
            print("error: " + "; ".join(problems), file=sys.stderr, flush=True)
            return 1
        if not stop.is_set():
            print(banner(platform, args.host, args.port, grpc_port), flush=True)
            await stop.wait()
        print("stopping ...", flush=True)
        return 0
    finally:
        await platform.stop()
        print("stopped", flush=True)


def run(args: argparse.Namespace) -> int:
    return run_async(_main(args))


def run_async(main) -> int:
    """`main` on the services' event loop, with warnings logged as the other services log them."""
    import logging

    from inferplane import aio

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return aio.run(main)
