"""`inferplane keys create|list|revoke`: API keys straight on the database (platform admin), or
with `--url` through a running gateway's admin API (cli/remote.py).

`create` prints the key once; nothing can show it again. Either way the key works at once: the
gateway that created it refreshed its key cache, and one that has not seen it yet catches up on the
first request with it (auth.KeyCache.catch_up).
"""

from __future__ import annotations

import argparse
import re
from datetime import timedelta
from typing import Any

from inferplane.api.priority import BANDS
from inferplane.control_plane.cli.common import (
    add_db_arguments,
    cli_actor,
    limit_cell,
    print_json,
    run_cli_command,
)

_DURATION_RE = re.compile(r"^(\d+)([smhdw]?)$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> timedelta:
    """ "90d", "12h", "30m", "3600s" or plain seconds."""
    match = _DURATION_RE.match(text.strip().lower())
    if match is None or int(match.group(1)) == 0:
        raise argparse.ArgumentTypeError(f"invalid duration {text!r}: use e.g. 30d, 12h, 15m, 3600s")
    return timedelta(seconds=int(match.group(1)) * _UNITS[match.group(2)])


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="keys_command", required=True)
    create = sub.add_parser("create", help="create an API key (printed once)")
    create.add_argument("--tenant", required=True)
    create.add_argument(
        "--scopes", default="infer,models:read", help="comma-separated: infer, models:read, admin"
    )
    create.add_argument("--name", default=None, help="a label to recognise the key by")
    create.add_argument("--expires-in", type=parse_duration, default=None, help="e.g. 90d (default: never)")
    create.add_argument("--rpm", type=int, default=None,
                        help="requests per minute (default: the tenant's ceiling, else unlimited)")
    create.add_argument("--tpm", type=int, default=None,
                        help="tokens per minute (default: the tenant's ceiling, else unlimited)")
    create.add_argument("--priority", choices=BANDS, default=None,
                        help="priority band of its requests: the tenant's or a less urgent one (default: the tenant's)")
    create.add_argument("--max-concurrent-sequences", type=int, default=None,
                        help="sequences it may have in flight at once, at most the tenant's (default: no limit of "
                             "its own)")
    create.add_argument("--json", action="store_true")
    add_db_arguments(create)
    listing = sub.add_parser("list", help="list keys (never their secrets)")
    listing.add_argument("--tenant", default=None, help="only this tenant's keys")
    listing.add_argument("--json", action="store_true")
    add_db_arguments(listing)
    revoke = sub.add_parser("revoke", help="revoke a key; gateways refuse it within seconds")
    revoke.add_argument("key_id", help="the id part of ip_<id>_<secret> (or the whole key)")
    add_db_arguments(revoke)


def _create(args: argparse.Namespace, sessions: Any) -> int:
    from inferplane.control_plane.auth import create_key

    with sessions.begin() as s:
        created = create_key(
            s,
            args.tenant,
            actor=cli_actor(),
            scopes=args.scopes,
            name=args.name,
            expires_in=args.expires_in,
            requests_per_minute=args.rpm,
            tokens_per_minute=args.tpm,
            priority=args.priority,
            max_concurrent_sequences=args.max_concurrent_sequences,
        )
    _print_created(args, created.secret, created.info)
    return 0


def _print_created(args: argparse.Namespace, secret: str, info: Any) -> None:
    if args.json:
        print_json({"key": secret, **_as_dict(info)})
    else:
        print(secret)
        print(f"# key id {info.id} for tenant {info.tenant_id}, scopes "
              f"{' '.join(info.scopes)}; store it now, it cannot be shown again")  # fmt: skip


def _create_remote(args: argparse.Namespace, api: Any) -> int:
    from inferplane.control_plane.auth import KeyInfo
    from inferplane.control_plane.cli.remote import record

    body = {"tenant_id": args.tenant, "scopes": [s for s in args.scopes.split(",") if s], "name": args.name,
            "expires_in_seconds": int(args.expires_in.total_seconds()) if args.expires_in else None,
            "requests_per_minute": args.rpm, "tokens_per_minute": args.tpm, "priority": args.priority,
            "max_concurrent_sequences": args.max_concurrent_sequences}
    answer = api.call("POST", "/admin/v1/keys", json={k: v for k, v in body.items() if v is not None})
    secret = answer.pop("key")
    _print_created(args, secret, record(answer, KeyInfo))
    return 0


def _as_dict(info: Any) -> dict[str, Any]:
    import dataclasses

    return dataclasses.asdict(info)


def _list(args: argparse.Namespace, sessions: Any) -> int:
    from inferplane.control_plane.auth import ALL_TENANTS, list_keys

    with sessions() as s:
        keys = list_keys(s, args.tenant if args.tenant else ALL_TENANTS)
    _print_keys(args, keys)
    return 0


def _list_remote(args: argparse.Namespace, api: Any) -> int:
    from inferplane.control_plane.auth import KeyInfo
    from inferplane.control_plane.cli.remote import record

    params = {"tenant_id": args.tenant} if args.tenant else {}
    _print_keys(args, [record(k, KeyInfo) for k in api.call("GET", "/admin/v1/keys", params=params)["data"]])
    return 0


def _print_keys(args: argparse.Namespace, keys: list[Any]) -> None:
    if args.json:
        print_json(keys)
        return
    print(f"{'KEY ID':<18} {'TENANT':<20} {'STATE':<8} {'SCOPES':<28} {'REQ/MIN':>9} {'TOK/MIN':>10} {'SEQS':>6} "
          f"{'BAND':<10} {'EXPIRES':<17} {'LAST USED':<17} NAME")
    for k in keys:
        state = "revoked" if k.revoked_at else ("active" if k.active else "expired")
        expires = f"{k.expires_at:%Y-%m-%d %H:%M}" if k.expires_at else "never"
        used = f"{k.last_used_at:%Y-%m-%d %H:%M}" if k.last_used_at else "never"
        print(f"{k.id:<18} {k.tenant_id:<20} {state:<8} {' '.join(k.scopes):<28} "
              f"{limit_cell(k.requests_per_minute):>9} {limit_cell(k.tokens_per_minute):>10} "
              f"{limit_cell(k.max_concurrent_sequences):>6} {k.priority or '-':<10} "
              f"{expires:<17} {used:<17} {k.name or ''}")  # fmt: skip


def _revoke(args: argparse.Namespace, sessions: Any) -> int:
    from inferplane.control_plane.auth import ALL_TENANTS, revoke_key

    with sessions.begin() as s:
        info = revoke_key(s, _key_id(args.key_id), ALL_TENANTS, actor=cli_actor())
    print(f"revoked key {info.id} of tenant {info.tenant_id}")
    return 0


def _key_id(text: str) -> str:
    """The id of a key given as its id or whole (ip_<id>_<secret>)."""
    from inferplane.control_plane.auth import parse_key

    return parse_key(text)[0] if text.startswith("ip_") else text


def _revoke_remote(args: argparse.Namespace, api: Any) -> int:
    info = api.call("DELETE", f"/admin/v1/keys/{_key_id(args.key_id)}")
    print(f"revoked key {info['id']} of tenant {info['tenant_id']}")
    return 0


def run(args: argparse.Namespace) -> int:
    command, remote = {"create": (_create, _create_remote), "list": (_list, _list_remote),
                       "revoke": (_revoke, _revoke_remote)}[args.keys_command]
    return run_cli_command(command, args, remote)
