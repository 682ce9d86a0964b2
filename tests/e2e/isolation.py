"""The check both modes share: two tenants, one prompt, one served name behind mixed isolation."""

from __future__ import annotations

import httpx

PROMPT = "Tenant data that must not leak: the quarterly numbers are " + "very " * 12 + "good."


def cached_tokens(base_url: str, key: str, model: str) -> int:
    reply = httpx.post(f"{base_url}/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                       json={"model": model, "prompt": PROMPT, "max_tokens": 2, "temperature": 0})
    assert reply.status_code == 200, reply.text
    return reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def assert_tenants_do_not_share_the_prefix_cache(base_url: str, first_key: str, second_key: str, model: str) -> None:
    """The first tenant's repeat hits its own cache (so there is a cache to leak); the second misses."""
    cached_tokens(base_url, first_key, model)
    assert cached_tokens(base_url, first_key, model) > 0, "the radix cache served no prefix to its own tenant"
    assert cached_tokens(base_url, second_key, model) == 0, "another tenant's prompt was served from cache"
