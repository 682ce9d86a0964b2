"""Where the control plane's database is: the one home of its environment variables and defaults.

Apart from db.py so that the command-line modules can name them in `--help` without importing
SQLAlchemy (cli/__init__.py: `configure` stays cheap).
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_DB_URL = "INFERPLANE_DB_URL"  # what every command reads
ENV_DATABASE_URL = "INFERPLANE_DATABASE_URL"  # what the Helm chart sets; the gateway reads it first


def default_home() -> Path:
    return Path(os.environ.get("INFERPLANE_HOME") or Path.home() / ".inferplane")


def default_db_url(home: str | Path | None = None) -> str:
    """`$INFERPLANE_DB_URL` if set (and no explicit home), else SQLite at `<home>/inferplane.db`."""
    if home is None and os.environ.get(ENV_DB_URL):
        return os.environ[ENV_DB_URL]
    folder = Path(home).expanduser() if home is not None else default_home()
    return f"sqlite:///{folder / 'inferplane.db'}"
