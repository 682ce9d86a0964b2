"""The signature on every delivery: `sha256=<hex HMAC-SHA256 of "<timestamp>." + body>`.

The timestamp (unix seconds, sent as `X-Inferplane-Timestamp`) is inside the signed text so a
receiver can refuse old replays; the body is signed as sent, byte for byte, so a receiver must
verify the raw body before parsing it.
"""

from __future__ import annotations

import hashlib
import hmac
import time

TIMESTAMP_HEADER = "X-Inferplane-Timestamp"
SIGNATURE_HEADER = "X-Inferplane-Signature"
DELIVERY_HEADER = "X-Inferplane-Delivery"  # the delivery id: a receiver may drop repeats (at-least-once)


def signature(secret: str, timestamp: int, body: bytes) -> str:
    digest = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return f"sha256={digest}"


def verify(secret: str, timestamp: str, body: bytes, header: str, *, tolerance: float = 300.0,
           now: float | None = None) -> bool:
    """What a receiver does: the signature matches and the timestamp is within `tolerance` seconds."""
    try:
        sent = int(timestamp)
    except ValueError:
        return False
    if abs((time.time() if now is None else now) - sent) > tolerance:
        return False
    return hmac.compare_digest(signature(secret, sent, body), header)
