"""Issue 53, item 9: what a gateway's end costs the usage records.

Usage is buffered and written every `usage_flush_interval` seconds (2 s in a gateway), so a
`kill -9` loses at most what was recorded since the last successful flush. A stop (SIGTERM,
SIGINT: the gateway's and `inferplane up`'s signal handlers call Gateway.stop) writes the rest:
checked here on a real gateway and database, with an interval that never elapses.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from inferplane.control_plane.gateway.server import Gateway, GatewaySettings
from inferplane.control_plane.usage import query_usage


def test_the_default_flush_interval_is_the_documented_bound() -> None:
    assert GatewaySettings(db_url="sqlite://").usage_flush_interval == 2.0


def test_a_gateway_stop_writes_the_usage_not_yet_flushed(tmp_path: Path) -> None:
    gateway = Gateway(GatewaySettings(db_url=f"sqlite:///{tmp_path / 'gw.db'}", usage_flush_interval=3600))
    gateway.usage.start()
    for _ in range(3):
        gateway.usage.record("acme", "chat", prompt_tokens=2, completion_tokens=3)
    assert gateway.usage.pending_records() == 1
    asyncio.run(gateway.stop())
    check = Gateway(GatewaySettings(db_url=f"sqlite:///{tmp_path / 'gw.db'}"))
    try:
        with check.sessions() as session:
            rows = query_usage(session, "acme")
        assert [(r.requests, r.total_tokens) for r in rows] == [(3, 15)]
    finally:
        check.engine.dispose()
