"""`inferplane bench fairness`'s cases for issue 53, classes 5 and 6: what they send is what they say.

`slow-heads`: an unfinished head, dribbled or huge, ends when the gateway closes the connection
(its bounds: gateway/http_protocol.py), so each copy reconnects and keeps the flood going.
`refused-prompts`: the harness gives the `limited` tenant a key of 5 requests a minute, and the
flood's prompt is far over the context.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from inferplane.bench import fairness, fairness_harness
from inferplane.bench.gateway_harness import _create_key, free_port
from inferplane.control_plane.gateway.server import Gateway, GatewaySettings


def test_the_cases_are_listed_with_what_they_send() -> None:
    cases = fairness.flood_cases(slots=8)
    assert cases["slow-heads"].heads and cases["slow-heads"].copies >= 2
    refused = cases["refused-prompts"]
    assert refused.tenant == fairness.LIMITED
    body = json.dumps({"model": "tiny", "messages": fairness_harness.CHAT, **refused.extra})
    assert 900_000 < len(body) < 1 << 20  # about a megabyte, within the gateway's body limit


async def test_an_unfinished_head_ends_when_the_gateway_closes_it(tmp_path: Path) -> None:
    port = free_port()
    gateway = Gateway(GatewaySettings(db_url=f"sqlite:///{tmp_path / 'gw.db'}", port=port, header_timeout_seconds=1))
    await gateway.start()
    try:
        for slow in (True, False):  # a minute of dribbling, 64 MiB: both cut short
            await asyncio.wait_for(fairness_harness._unfinished_head(f"http://127.0.0.1:{port}", slow=slow), 30)
    finally:
        await gateway.stop()


def test_the_harness_makes_a_key_with_a_request_limit(tmp_path: Path) -> None:
    gateway = Gateway(GatewaySettings(db_url=f"sqlite:///{tmp_path / 'gw.db'}"))
    try:
        secret = _create_key(gateway, fairness.LIMITED, None, 5)
        gateway.keys.refresh()
        assert gateway.keys.verify(secret).requests_per_minute == 5
    finally:
        gateway.engine.dispose()
