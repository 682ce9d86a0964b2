"""The `inferplane` console script.

Each subcommand lives in its own module, imported only when it runs, so that `inferplane operator`
does not pay for importing torch and `inferplane worker` does not import the control plane.
A subcommand module provides `configure(parser)` and `run(args) -> int`; `configure` must stay
cheap (no heavy imports), since every module's `configure` runs to build `--help`.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "worker": ("inferplane.worker.serve.cli", "run one model replica as a gRPC worker"),
    "bench": ("inferplane.cli.bench", "run a benchmark against its peers"),
    "operator": ("inferplane.operator.cli", "run the Kubernetes operator (kopf)"),
    "up": ("inferplane.local.cli.up", "run the whole platform on this machine"),
    "serve": ("inferplane.local.cli.serve", "serve one model (a file, folder or name) like `up`, no manifest"),
    "deployments": ("inferplane.local.cli.deployments",
                    "deployments on a running `inferplane up`: apply -f FILE|list|get|delete"),
    "status": ("inferplane.local.cli.status", "what `inferplane up` runs: ports, health, models, logs"),
    "gateway": ("inferplane.control_plane.cli.gateway", "run the control plane gateway"),
    "models": ("inferplane.control_plane.cli.models", "model registry: pull|register|list|show|delete"),
    "tenants": ("inferplane.control_plane.cli.tenants", "tenants: create|list, alert webhooks"),
    "keys": ("inferplane.control_plane.cli.keys", "API keys: create|list|revoke"),
    "crd": ("inferplane.cli.crd", "print the InferenceDeployment CRD generated from the spec models"),
    "monitoring": ("inferplane.cli.monitoring", "Prometheus rules and Grafana dashboards: render|rules"),
    "quant-check": ("inferplane.worker.quant.cli", "int8 quality gate: perplexity, agreement, KL"),
    "fetch-model": ("inferplane.storage.cli", "fetch and verify model weights into the node cache"),
}


def _version() -> str:
    """The installed distribution's version (pyproject.toml's), or what a source tree without one says."""
    try:
        return importlib.metadata.version("inferplane")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def _available() -> dict[str, tuple[str, str]]:
    """Only subcommands whose module exists are offered, so --help never lists a dead end."""
    found = {}
    for name, (module, help_text) in SUBCOMMANDS.items():
        try:
            spec = importlib.util.find_spec(module)
        except ModuleNotFoundError:
            spec = None
        if spec is not None:
            found[name] = (module, help_text)
    return found


def main(argv: list[str] | None = None) -> int:
    from inferplane.local.runstate import die_with_parent

    die_with_parent()  # a child of `inferplane up`'s supervisor ends with it
    parser = argparse.ArgumentParser(prog="inferplane", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"inferplane {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name, (module_name, help_text) in _available().items():
        module = importlib.import_module(module_name)
        module.configure(sub.add_parser(name, help=help_text))
        modules[name] = module
    args = parser.parse_args(argv)
    return int(modules[args.command].run(args) or 0)

