"""The Responses API's stored answers on SQLite and PostgreSQL: per tenant, expiring, deleted with
their tenant (the route's use of them is tests/e2e/test_responses_api.py)."""

from __future__ import annotations

from datetime import timedelta

import sqlalchemy as sa

from inferplane.control_plane import db, stored_responses, tenants
from inferplane.control_plane.orm import utcnow


def test_a_response_is_its_tenants_until_it_expires_or_is_deleted(engine: sa.Engine) -> None:
    sessions = db.session_factory(engine)
    now = utcnow()
    with sessions.begin() as s:
        for tenant in ("a", "b"):
            tenants.create_tenant(s, tenant, actor="test")
        stored_responses.save(s, "a", {"id": "resp_1", "output": [{"type": "message"}]},
                              [{"type": "message", "role": "user", "content": "Hi"}], now=now)
        stored_responses.save(s, "a", {"id": "resp_old", "output": []}, [], now=now - stored_responses.RETENTION)
    with sessions.begin() as s:
        found = stored_responses.get(s, "a", "resp_1")
        assert found is not None and found.response["output"] == [{"type": "message"}]
        assert found.conversation == [{"type": "message", "role": "user", "content": "Hi"}]
        assert found.expires_at - found.created_at == stored_responses.RETENTION
        # another tenant's id is missing, as an unknown one is; so is an expired one
        assert stored_responses.get(s, "b", "resp_1") is None
        assert not stored_responses.remove(s, "b", "resp_1")
        assert stored_responses.get(s, "a", "resp_old") is None
        assert not stored_responses.remove(s, "a", "resp_old")
    with sessions.begin() as s:
        assert stored_responses.purge_expired(s) == 1  # the expired row goes; the live one stays
        assert stored_responses.get(s, "a", "resp_1") is not None
        assert stored_responses.remove(s, "a", "resp_1")
        assert stored_responses.get(s, "a", "resp_1") is None
    with sessions.begin() as s:
        stored_responses.save(s, "b", {"id": "resp_b", "output": []}, [], now=now + timedelta(seconds=1))
    with sessions.begin() as s:
        tenants.delete_tenant(s, "b", actor="test")
    with sessions.begin() as s:
        assert s.execute(sa.text("SELECT count(*) FROM responses")).scalar() == 0


def test_conversation_size_is_its_json() -> None:
    items = [{"type": "message", "role": "user", "content": "é"}]
    assert stored_responses.conversation_bytes(items) == len(
        '[{"type":"message","role":"user","content":"é"}]'.encode())
