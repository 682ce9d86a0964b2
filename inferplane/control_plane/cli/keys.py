"""`inferplane keys create|list|revoke`: API keys straight on the database (platform admin).

`create` prints the key once; nothing can show it again.
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
    if args.json:
        print_json({"key": created.secret, **_as_dict(created.info)})
    else:
        print(created.secret)
        print(f"# key id {created.info.id} for tenant {created.info.tenant_id}, scopes "
              f"{' '.join(created.info.scopes)}; store it now, it cannot be shown again")  # fmt: skip
    return 0


def _as_dict(info: Any) -> dict[str, Any]:
    import dataclasses

    return dataclasses.asdict(info)


def _list(args: argparse.Namespace, sessions: Any) -> int:
    from inferplane.control_plane.auth import ALL_TENANTS, list_keys

    with sessions() as s:
        keys = list_keys(s, args.tenant if args.tenant else ALL_TENANTS)
    if args.json:
        print_json(keys)
        return 0
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
    return 0


def _revoke(args: argparse.Namespace, sessions: Any) -> int:
    from inferplane.control_plane.auth import ALL_TENANTS, parse_key, revoke_key

    key_id = args.key_id
    if key_id.startswith("ip_"):
        key_id = parse_key(key_id)[0]
    with sessions.begin() as s:
        info = revoke_key(s, key_id, ALL_TENANTS, actor=cli_actor())
    print(f"revoked key {info.id} of tenant {info.tenant_id}")
    return 0


def run(args: argparse.Namespace) -> int:
    command = {"create": _create, "list": _list, "revoke": _revoke}[args.keys_command]
    return run_cli_command(command, args)
