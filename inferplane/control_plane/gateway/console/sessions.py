"""Console sessions: a credential exchanged once for a short-lived signed session in a cookie.

Why a session and not the key in the browser: a key in page storage is readable by any script
the page runs, and lives as long as the key. The console sends the key once (`POST
/console/api/session`) and gets an HttpOnly, SameSite=Strict cookie holding a JWT (the project's
signed tokens, HS256 under a key derived from the gateway's shared secret, so every gateway replica
accepts it) that names the credential, never contains it, and expires within SESSION_TTL_S.

What a session may do is re-derived on every request from what it names, so its rights stay exactly
the credential's: a key session is the key's live principal from the key cache (revoking the key
ends the session within a refresh interval), a bootstrap session holds only while the bootstrap key
is the one it signed in with (a fingerprint of it is in the token), a JWT session ends when its
token would have.

CSRF: the cookie alone authorizes nothing. Every request authenticated by it must also carry the
session's CSRF token in `X-CSRF-Token` (the console's script reads it from `GET /console/api/session`,
which another site cannot read), so a cross-site form post, which can send the cookie but not a
header, is refused with 403; SameSite=Strict keeps the cookie off cross-site requests besides.
"""

from __future__ import annotations

import hashlib
import hmac
import http.cookies
import secrets
import threading
import time
from dataclasses import dataclass

import jwt

from inferplane.api.priority import BANDS
from inferplane.control_plane.auth import BOOTSTRAP_PRINCIPAL, SCOPES, KeyCache, Principal, verify_bootstrap_key
from inferplane.control_plane.errors import Forbidden, Unauthenticated
from inferplane.control_plane.tokens import AdminTokenVerifier

COOKIE_NAME = "ip_session"
CSRF_HEADER = "x-csrf-token"
SESSION_TTL_S = 3600  # an hour: a console left open signs in again after it
AUDIENCE = "inferplane-console"
ALGORITHM = "HS256"


@dataclass(frozen=True)
class SessionInfo:
    """What the console's script may know of its session (no secret but the CSRF token)."""

    csrf: str
    role: str  # "platform-admin" | "tenant"
    tenant: str | None
    scopes: tuple[str, ...]
    subject: str
    expires_at: int
    bands: tuple[str, ...] = BANDS  # the priority bands a key may be given (the keys page offers them)


def session_cookie(cookie_header: str | None) -> str | None:
    """The session token in a request's Cookie header (None: none, or a header that does not parse)."""
    if not cookie_header or COOKIE_NAME not in cookie_header:
        return None
    cookies = http.cookies.SimpleCookie()
    try:
        cookies.load(cookie_header)
    except http.cookies.CookieError:
        return None
    morsel = cookies.get(COOKIE_NAME)
    return morsel.value if morsel is not None else None


def _fingerprint(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()[:32]


class ConsoleSessions:
    """Issues and checks console sessions for one gateway (any replica sharing its secret)."""

    def __init__(self, secret: bytes, keys: KeyCache, *, bootstrap_key: str | None = None,
                 jwt_verifier: AdminTokenVerifier | None = None, ttl_s: int = SESSION_TTL_S):
        # Its own key, derived from the gateway's shared secret: a session token is never valid as
        # anything else, and rotating that secret ends every session.
        self._key = hmac.new(secret, b"inferplane console session v1", hashlib.sha256).digest()
        self.keys = keys
        self.bootstrap_key = bootstrap_key
        self.jwt_verifier = jwt_verifier
        self.ttl_s = ttl_s
        self._signed_out: dict[str, float] = {}  # session id -> its expiry (kept until then)
        self._lock = threading.Lock()

    # -- signing in ---------------------------------------------------------------------------

    def sign_in(self, credential: str) -> tuple[str, SessionInfo]:
        """A session for `credential` (an API key, the bootstrap key or an admin JWT): the cookie's
        token and what the page may know. `Unauthenticated` for a credential nothing accepts."""
        credential = credential.strip()
        now = int(time.time())
        expires = now + self.ttl_s
        claims: dict = {"aud": AUDIENCE, "iat": now, "jti": secrets.token_urlsafe(16),
                        "csrf": secrets.token_urlsafe(32)}
        principal = None
        if credential.startswith("ip_"):
            principal = self.keys.verify(credential)
            claims.update(via="key", sub=principal.key_id)
        elif self.bootstrap_key:
            try:
                principal = verify_bootstrap_key(credential, self.bootstrap_key)
                claims.update(via="bootstrap", sub="bootstrap", fp=_fingerprint(credential))
            except Unauthenticated:
                pass
        if principal is None:
            if self.jwt_verifier is None or credential.count(".") != 2:
                raise Unauthenticated("not an API key (ip_...), the admin key or an admin token")
            principal = self.jwt_verifier.verify(credential)
            token_expiry = jwt.decode(credential, options={"verify_signature": False})["exp"]
            expires = min(expires, int(token_expiry))
            claims.update(via="jwt", sub=principal.subject, tenant=principal.tenant_id,
                          scope=" ".join(sorted(principal.scopes)))
        claims["exp"] = expires
        token = jwt.encode(claims, self._key, algorithm=ALGORITHM)
        return token, self._info(claims, principal)

    @staticmethod
    def _info(claims: dict, principal: Principal) -> SessionInfo:
        return SessionInfo(csrf=claims["csrf"], role="tenant" if principal.tenant_id is not None else "platform-admin",
                           tenant=principal.tenant_id, scopes=tuple(sorted(principal.scopes)),
                           subject=principal.subject, expires_at=int(claims["exp"]))

    # -- each request -------------------------------------------------------------------------

    def claims(self, token: str) -> dict:
        """The token's claims if it is a live session (signature, audience, expiry, not signed out)."""
        try:
            claims = jwt.decode(token, self._key, algorithms=[ALGORITHM], audience=AUDIENCE,
                                options={"require": ["exp", "iat", "aud", "sub", "jti", "csrf"]})
        except jwt.PyJWTError:
            raise Unauthenticated("the console session is invalid or has expired; sign in again") from None
        with self._lock:
            if claims["jti"] in self._signed_out:
                raise Unauthenticated("the console session was signed out; sign in again")
        return claims

    def principal(self, token: str, csrf: str | None) -> tuple[Principal, SessionInfo]:
        """Who a request carrying session `token` acts as, given the `X-CSRF-Token` it sent (None for
        the one read that hands the page its token). `Unauthenticated` for a dead session,
        `Forbidden` for a missing or wrong CSRF token."""
        claims = self.claims(token)
        if csrf is not None and not hmac.compare_digest(csrf.encode(), claims["csrf"].encode()):
            raise Forbidden("X-CSRF-Token: missing or not this session's (a console session's requests carry it)")
        via = claims.get("via")
        if via == "key":
            principal = self.keys.principal_of(claims["sub"])
        elif via == "bootstrap":
            current = _fingerprint(self.bootstrap_key) if self.bootstrap_key else ""
            if not current or not hmac.compare_digest(str(claims.get("fp", "")), current):
                raise Unauthenticated("the admin key this session signed in with has changed; sign in again")
            principal = BOOTSTRAP_PRINCIPAL
        elif via == "jwt":
            principal = Principal(subject=claims["sub"], tenant_id=claims.get("tenant"),
                                  scopes=frozenset(str(claims.get("scope", "")).split()) & SCOPES, via="jwt")
        else:
            raise Unauthenticated("the console session is invalid; sign in again")
        return principal, self._info(claims, principal)

    def sign_out(self, token: str) -> None:
        """Ends the session here at once (the cookie is cleared too); other gateway replicas refuse
        it once it expires, within SESSION_TTL_S."""
        claims = self.claims(token)
        now = time.time()
        with self._lock:
            self._signed_out = {jti: exp for jti, exp in self._signed_out.items() if exp > now}
            self._signed_out[claims["jti"]] = float(claims["exp"])
