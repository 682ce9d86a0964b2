"""Alert routing: Alertmanager's notifications, stored and forwarded to the owning tenant's webhooks.

`payload` validates Alertmanager's webhook body; `store` records alerts (deduplicated by
fingerprint) and enqueues one delivery per tenant webhook on each firing/resolved transition, in the
same transaction; `webhooks` manages tenants' URLs and secrets; `outbox` claims due deliveries and
records each attempt; `signing` is the HMAC a receiver verifies; `forwarder` is the asyncio loop
that POSTs them. Query functions take a `Session` and never commit (see `control_plane.db`).
"""
