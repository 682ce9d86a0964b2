"""The control plane: tenants, API keys, model registry, limits and usage; routing; gateways.

Data and security layer (one job per module, nothing imported here so `import inferplane.control_plane`
stays free):

- `db`        engines, sessions, `init_db(url)` (Alembic migrations in `migrations/`)
- `cli_models`, `cli_tenants`, `cli_keys` (+ `cli_common`): the `inferplane models|tenants|keys` commands
- `orm`       the tables
- `errors`    `ControlPlaneError` (a `ValueError`) and one subclass per HTTP status (400/401/403/404/409/429)
- `tenants`   create/list/get/delete tenants, monthly quota
- `auth`      API keys (`ip_<id>_<secret>`, stored hashed), scopes, `KeyCache`, `Principal`, bootstrap key
- `tokens`    admin JWTs (`AdminTokenVerifier`, `issue_token`)
- `registry`  models: register from a path/alias, list/get/resolve/delete/verify, tenant visibility
- `limits`    per-key token buckets (`RateLimiter`), monthly quota (`QuotaTracker`)
- `usage`     `UsageRecorder` (batched writes), `query_usage` for `GET /v1/usage`
- `audit`     the audit log of admin actions

Conventions: query functions take a `Session` and never commit (the caller owns the transaction);
tenant-facing ones take the caller's tenant id, or `auth.ALL_TENANTS` for a platform admin; results
are frozen dataclasses that outlive their session.
"""
