"""Short-lived admin JWTs: verification (gateway) and issuing (CLI, tests).

The verifier is configured with exactly one algorithm and one key, and passes only that algorithm
to pyjwt, which closes the classic holes: `alg: none` is refused, and an HS256 token forged with an
RS256 public key as the HMAC secret is refused (HS256 is not in the list; and a PEM key is never
accepted as an HS256 secret here). `exp`, `iat`, `aud` and `sub` are required; tokens valid for
longer than `max_lifetime_s` are refused, so a leaked token is a short-lived problem.

Claims: `sub` (who, for the audit log), `aud`, `exp`, `iat`, optional `iss`, `scope` (space-separated,
as in OAuth; default "admin") and optional `tenant` (restricts the token to one tenant).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal

import jwt

from inferplane.control_plane.auth import SCOPE_ADMIN, SCOPES, KeyCache, Principal, verify_bootstrap_key
from inferplane.control_plane.errors import InvalidInput, Unauthenticated

Algorithm = Literal["HS256", "RS256"]
DEFAULT_AUDIENCE = "inferplane-admin"
MIN_HS256_SECRET_BYTES = 32


def _is_pem(key: str | bytes) -> bool:
    text = key.decode(errors="replace") if isinstance(key, bytes) else key
    return "-----BEGIN" in text or text.startswith("ssh-rsa")


@dataclass(frozen=True)
class JWTSettings:
    """`key`: the HS256 shared secret, or the RS256 public key (PEM) — never a private key."""

    algorithm: Algorithm
    key: str | bytes
    audience: str = DEFAULT_AUDIENCE
    issuer: str | None = None
    leeway_s: float = 30.0
    max_lifetime_s: float = 3600.0

    def __post_init__(self) -> None:
        if self.algorithm not in ("HS256", "RS256"):
            raise InvalidInput(f"unsupported JWT algorithm {self.algorithm!r}; use HS256 or RS256")
        if self.algorithm == "HS256":
            if _is_pem(self.key):
                raise InvalidInput(
                    "an HS256 secret must not be a PEM key (that is the RS256/HS256 confusion)"
                )
            if len(self.key.encode() if isinstance(self.key, str) else self.key) < MIN_HS256_SECRET_BYTES:
                raise InvalidInput(f"an HS256 secret needs at least {MIN_HS256_SECRET_BYTES} bytes")
        elif not _is_pem(self.key) or "PRIVATE KEY" in (
            self.key.decode() if isinstance(self.key, bytes) else self.key
        ):
            raise InvalidInput("RS256 verification takes the PEM public key (not a private key)")


class AdminTokenVerifier:
    """Verifies admin JWTs into a `Principal` (via "jwt", subject "jwt:<sub>")."""

    def __init__(self, settings: JWTSettings):
        self.settings = settings
        if settings.algorithm == "RS256":
            from cryptography.hazmat.primitives.serialization import load_pem_public_key

            key = settings.key.encode() if isinstance(settings.key, str) else settings.key
            self._key: Any = load_pem_public_key(key)
        else:
            self._key = settings.key

    def verify(self, token: str, *, scope: str = SCOPE_ADMIN) -> Principal:
        """`Unauthenticated` for any invalid token; `Forbidden` if valid but without `scope`."""
        s = self.settings
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError as e:
            raise Unauthenticated(f"malformed token: {e}") from None
        if header.get("alg") != s.algorithm:
            raise Unauthenticated(f"token algorithm {header.get('alg')!r} is not accepted")
        try:
            claims = jwt.decode(
                token,
                self._key,
                algorithms=[s.algorithm],
                audience=s.audience,
                issuer=s.issuer,
                leeway=s.leeway_s,
                options={"require": ["exp", "iat", "aud", "sub"]},
            )
        except jwt.PyJWTError as e:
            raise Unauthenticated(f"invalid token: {e}") from None
        # pyjwt has checked exp (past) and iat (not in the future) against the clock, but it also
        # accepts them as numeric strings ("1800000000"); the claims are NumericDates (numbers).
        if not all(isinstance(claims[c], (int, float)) and not isinstance(claims[c], bool) for c in ("exp", "iat")):
            raise Unauthenticated("invalid token: exp and iat must be numbers (seconds since the epoch)")
        if claims["exp"] - claims["iat"] > s.max_lifetime_s:
            raise Unauthenticated(f"invalid token: lifetime over {s.max_lifetime_s:.0f} s")
        raw_scope = claims.get("scope", SCOPE_ADMIN)
        if not isinstance(raw_scope, str):
            raise Unauthenticated("invalid token: scope must be a space-separated string")
        scopes = frozenset(raw_scope.split()) & SCOPES
        tenant = claims.get("tenant")
        if tenant is not None and not isinstance(tenant, str):
            raise Unauthenticated("invalid token: tenant must be a string")
        principal = Principal(subject=f"jwt:{claims['sub']}", tenant_id=tenant, scopes=scopes, via="jwt")
        principal.require(scope)
        return principal


def issue_token(
    key: str | bytes,
    *,
    algorithm: Algorithm,
    subject: str,
    audience: str = DEFAULT_AUDIENCE,
    ttl_s: float = 900,
    scopes: str = SCOPE_ADMIN,
    tenant: str | None = None,
    issuer: str | None = None,
    now: float | None = None,
) -> str:
    """Signs a token: `key` is the HS256 secret or the RS256 *private* key (PEM)."""
    issued = int(time.time() if now is None else now)
    claims: dict[str, Any] = {
        "sub": subject,
        "aud": audience,
        "iat": issued,
        "exp": issued + int(ttl_s),
        "scope": scopes,
    }
    if tenant is not None:
        claims["tenant"] = tenant
    if issuer is not None:
        claims["iss"] = issuer
    return jwt.encode(claims, key, algorithm=algorithm)


def authenticate_admin(
    credential: str,
    *,
    jwt_verifier: AdminTokenVerifier | None = None,
    bootstrap_key: str | None = None,
    key_cache: KeyCache | None = None,
) -> Principal:
    """One entry point for admin endpoints' bearer credentials.

    Tried in order: the bootstrap admin key (platform admin), an API key with the `admin` scope
    (an admin *of its own tenant*: `Principal.tenant_id` is set, and callers must scope queries to
    it), then a JWT. `Unauthenticated` if none accepts it, `Forbidden` if a key or token is valid
    but lacks the `admin` scope.
    """
    if bootstrap_key:
        try:
            return verify_bootstrap_key(credential, bootstrap_key)
        except Unauthenticated:
            pass
    if credential.startswith("ip_"):
        if key_cache is None:
            raise Unauthenticated("API keys are not accepted here")
        return key_cache.verify(credential, SCOPE_ADMIN)
    if jwt_verifier is not None:
        return jwt_verifier.verify(credential, scope=SCOPE_ADMIN)
    raise Unauthenticated("invalid admin credential")
