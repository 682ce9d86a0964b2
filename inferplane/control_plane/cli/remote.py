"""The admin CLI against a running gateway (`--url`): the same commands through the admin API
instead of on the database, for a platform whose database this machine cannot reach (a cluster's),
or to have a change take effect in the gateway at once.

The credential is the platform admin's: `$INFERPLANE_ADMIN_KEY`, else the file `--admin-key-file`
names (default `<home>/admin-key`, which `inferplane up` writes), or an admin JWT in the variable.
Answers come back as the API gives them; `record` turns one into what the table printers read.
"""

from __future__ import annotations

import argparse
import os
from datetime import datetime
from pathlib import Path
from typing import Any

from inferplane.control_plane.db_url import default_home
from inferplane.control_plane.errors import ControlPlaneError

ENV_URL = "INFERPLANE_URL"
ENV_ADMIN_KEY = "INFERPLANE_ADMIN_KEY"


class RemoteError(ControlPlaneError):
    """The gateway refused the call: its status and its error message, as the API gave them."""

    def __init__(self, status: int, message: str):
        super().__init__(f"{message} (HTTP {status})")
        self.status = status


def add_remote_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", dest="gateway_url", default=os.environ.get(ENV_URL),  # `url` is a webhook's
                        help=f"a running gateway (e.g. http://127.0.0.1:8080): act through its admin API instead "
                             f"of on the database (default: ${ENV_URL})")
    parser.add_argument("--admin-key-file", default=None,
                        help=f"the platform admin key for --url (default: ${ENV_ADMIN_KEY}, else <home>/admin-key)")


def admin_credential(args: argparse.Namespace) -> str:
    if os.environ.get(ENV_ADMIN_KEY) and not args.admin_key_file:
        return os.environ[ENV_ADMIN_KEY]
    home = Path(args.home).expanduser() if getattr(args, "home", None) else default_home()
    path = Path(args.admin_key_file).expanduser() if args.admin_key_file else home / "admin-key"
    try:
        return path.read_text().strip()
    except OSError as exc:
        raise RemoteError(401, f"no admin key for {args.gateway_url}: set ${ENV_ADMIN_KEY} or --admin-key-file "
                               f"({path}: {exc.strerror})") from None


class AdminAPI:
    """A platform admin's calls to one gateway's admin API."""

    def __init__(self, url: str, credential: str, timeout: float = 60.0):
        import httpx

        self._client = httpx.Client(base_url=url.rstrip("/"), timeout=timeout,
                                    headers={"Authorization": f"Bearer {credential}"})
        self.url = url

    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        """The answer's body; RemoteError for a refusal."""
        return self.exchange(method, path, **kwargs)[1]

    def exchange(self, method: str, path: str, **kwargs: Any) -> tuple[int, Any]:
        """(status, body) of a call the gateway accepted (2xx); RemoteError for a refusal."""
        import httpx

        try:
            response = self._client.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise RemoteError(503, f"cannot reach the gateway at {self.url}: {exc}") from None
        try:
            body = response.json()
        except ValueError:
            body = None
        if response.status_code >= 400:
            error = body.get("error") if isinstance(body, dict) else None
            message = error.get("message") if isinstance(error, dict) else response.text[:500]
            raise RemoteError(response.status_code, message or response.reason_phrase)
        return response.status_code, body

    def close(self) -> None:
        self._client.close()


def record(data: dict[str, Any], kind: type) -> Any:
    """An API answer as the database form's record: an instance of `kind`, the record's own
    dataclass (the admin API answers with its fields; its properties, such as a key's `active`,
    then hold as they do on the database), `*_at` as datetimes."""
    return kind(**{k: datetime.fromisoformat(v) if k.endswith("_at") and isinstance(v, str) else v
                   for k, v in data.items()})


def run_remote(command: Any, args: argparse.Namespace) -> int:
    """Runs `command(args, api)` against `args.gateway_url`; a refusal prints one line and exits 1."""
    from contextlib import closing

    from inferplane.control_plane.cli.common import one_line_errors

    with one_line_errors():
        api = AdminAPI(args.gateway_url, admin_credential(args))
        with closing(api):
            return int(command(args, api) or 0)
    return 1
