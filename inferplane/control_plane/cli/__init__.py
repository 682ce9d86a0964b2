"""The control plane's subcommands: `gateway` (gateway.py), `models`, `tenants` and `keys`, with what
they share (common.py). Each module's `configure` stays cheap: no SQLAlchemy until a command runs."""
