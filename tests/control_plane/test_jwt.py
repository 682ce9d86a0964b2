"""Admin JWTs: pinned algorithms, required claims, and the classic forgeries refused."""

from __future__ import annotations

import base64
import json
import time

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from inferplane.control_plane.errors import Forbidden, InvalidInput, Unauthenticated
from inferplane.control_plane.tokens import AdminTokenVerifier, JWTSettings, issue_token

SECRET = "x" * 48


@pytest.fixture(scope="module")
def rsa_keys() -> tuple[bytes, bytes]:
    private = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    private_pem = private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public_pem = private.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return private_pem, public_pem


def _hs() -> AdminTokenVerifier:
    return AdminTokenVerifier(JWTSettings("HS256", SECRET))


def _b64(data: dict) -> str:
    return base64.urlsafe_b64encode(json.dumps(data).encode()).rstrip(b"=").decode()


def test_hs256_round_trip() -> None:
    p = _hs().verify(issue_token(SECRET, algorithm="HS256", subject="alice"))
    assert (p.subject, p.tenant_id, p.via, p.scopes) == ("jwt:alice", None, "jwt", frozenset({"admin"}))


def test_rs256_round_trip_and_tenant_claim(rsa_keys: tuple[bytes, bytes]) -> None:
    private, public = rsa_keys
    verifier = AdminTokenVerifier(JWTSettings("RS256", public.decode()))
    p = verifier.verify(issue_token(private, algorithm="RS256", subject="bob", tenant="acme"))
    assert (p.subject, p.tenant_id) == ("jwt:bob", "acme")


def test_alg_none_is_refused() -> None:
    now = int(time.time())
    claims = {"sub": "eve", "aud": "inferplane-admin", "iat": now, "exp": now + 60, "scope": "admin"}
    unsigned = f"{_b64({'alg': 'none', 'typ': 'JWT'})}.{_b64(claims)}."
    with pytest.raises(Unauthenticated):
        _hs().verify(unsigned)


def test_hs256_signed_with_the_public_key_is_refused(rsa_keys: tuple[bytes, bytes]) -> None:
    """The RS256/HS256 confusion: the public key is public, so an attacker can HMAC with it."""
    _, public = rsa_keys
    now = int(time.time())
    claims = {"sub": "eve", "aud": "inferplane-admin", "iat": now, "exp": now + 60, "scope": "admin"}
    header = _b64({"alg": "HS256", "typ": "JWT"})
    body = _b64(claims)
    import hashlib
    import hmac

    sig = hmac.new(public, f"{header}.{body}".encode(), hashlib.sha256).digest()
    forged = f"{header}.{body}.{base64.urlsafe_b64encode(sig).rstrip(b'=').decode()}"
    verifier = AdminTokenVerifier(JWTSettings("RS256", public))
    with pytest.raises(Unauthenticated, match="algorithm"):
        verifier.verify(forged)
    # and a verifier cannot be configured to take a PEM as an HS256 secret in the first place
    with pytest.raises(InvalidInput):
        JWTSettings("HS256", public)


@pytest.mark.parametrize(
    "claims, message",
    [
        ({"exp": -600}, "expired"),
        ({"iat": 600, "exp": 900}, "iat"),
        ({"aud": "someone-else"}, "(?i)audience"),
        ({"exp": None}, "exp"),
        ({"iat": None}, "iat"),
        ({"sub": None}, "sub"),
        ({"iat": 0, "exp": 86400}, "lifetime"),
    ],
    ids=["expired", "future-iat", "wrong-aud", "no-exp", "no-iat", "no-sub", "too-long"],
)
def test_bad_claims_are_refused(claims: dict, message: str) -> None:
    now = int(time.time())
    payload = {"sub": "alice", "aud": "inferplane-admin", "iat": now, "exp": now + 300, "scope": "admin"}
    for name, value in claims.items():
        if value is None:
            payload.pop(name)
        elif name in ("iat", "exp"):
            payload[name] = now + value
        else:
            payload[name] = value
    token = jwt.encode(payload, SECRET, algorithm="HS256")
    with pytest.raises(Unauthenticated, match=message):
        _hs().verify(token)


def test_wrong_secret_and_garbage_are_refused() -> None:
    for token in (issue_token("y" * 48, algorithm="HS256", subject="a"), "not.a.token", ""):
        with pytest.raises(Unauthenticated):
            _hs().verify(token)


def test_scope_is_enforced() -> None:
    token = issue_token(SECRET, algorithm="HS256", subject="viewer", scopes="models:read")
    with pytest.raises(Forbidden):
        _hs().verify(token)
    assert _hs().verify(token, scope="models:read").scopes == frozenset({"models:read"})


def test_settings_validation(rsa_keys: tuple[bytes, bytes]) -> None:
    private, _ = rsa_keys
    with pytest.raises(InvalidInput, match="32 bytes"):
        JWTSettings("HS256", "short")
    with pytest.raises(InvalidInput, match="public key"):
        JWTSettings("RS256", private)
    with pytest.raises(InvalidInput):
        JWTSettings("none", SECRET)  # type: ignore[arg-type]


@pytest.mark.parametrize("claim", ["exp", "iat"])
def test_numeric_date_claims_given_as_strings_are_refused(claim: str) -> None:
    """pyjwt accepts "1800000000" for exp/iat; the lifetime check then met a string (500 before)."""
    now = int(time.time())
    payload = {"sub": "alice", "aud": "inferplane-admin", "iat": now, "exp": now + 300, "scope": "admin"}
    payload[claim] = str(payload[claim])
    token = jwt.encode(payload, SECRET, algorithm="HS256")
    with pytest.raises(Unauthenticated, match="exp and iat must be numbers|must be an integer"):
        _hs().verify(token)


def test_a_configured_issuer_is_required_and_checked() -> None:
    now = int(time.time())
    verifier = AdminTokenVerifier(JWTSettings("HS256", SECRET, issuer="https://idp.example"))
    payload = {"sub": "alice", "aud": "inferplane-admin", "iat": now, "exp": now + 300, "scope": "admin"}
    good = jwt.encode({**payload, "iss": "https://idp.example"}, SECRET, algorithm="HS256")
    assert verifier.verify(good).subject == "jwt:alice"
    for bad in ({**payload, "iss": "https://evil.example"}, payload):
        with pytest.raises(Unauthenticated, match="(?i)iss"):
            verifier.verify(jwt.encode(bad, SECRET, algorithm="HS256"))
