"""Per-tenant radix cache salt.

A keyed HMAC rather than a plain hash of the tenant id: tenant ids are not secret, and a guessable
salt would let one tenant send prompts under another's salt and probe its cached prefixes by timing.
The salt is stable for a given secret, so a tenant keeps its cache hits (and its replica affinity)
across gateway restarts and across gateway replicas sharing the secret.
"""

from __future__ import annotations

import hashlib
import hmac


def tenant_cache_salt(tenant_id: str, secret: bytes | str) -> str:
    """Hex salt for ``GenerateRequest.cache_salt`` (128 bits are plenty against guessing)."""
    key = secret.encode() if isinstance(secret, str) else secret
    if not key:
        raise ValueError("the cache-salt secret must not be empty")
    return hmac.new(key, b"cache-salt:" + tenant_id.encode(), hashlib.sha256).hexdigest()[:32]
