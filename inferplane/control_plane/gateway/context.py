"""Everything a gateway process holds: database sessions, key cache, limits, usage, catalog, router."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sqlalchemy.orm import Session, sessionmaker

from inferplane.control_plane.auth import SCOPE_ADMIN, KeyCache, Principal
from inferplane.control_plane.errors import Forbidden, Unauthenticated
from inferplane.control_plane.gateway.catalog import Catalog
from inferplane.control_plane.gateway.inference import InferenceService
from inferplane.control_plane.gateway.metrics import GatewayMetrics
from inferplane.control_plane.outbound import OutboundPolicy
from inferplane.control_plane.tokens import AdminTokenVerifier, authenticate_admin

if TYPE_CHECKING:
    from inferplane.control_plane.alerts.forwarder import AlertForwarder
    from inferplane.control_plane.gateway.console.sessions import ConsoleSessions
    from inferplane.control_plane.gateway.deployment_control import DeploymentControl


@dataclass
class GatewayContext:
    sessions: sessionmaker[Session]
    keys: KeyCache
    catalog: Catalog
    inference: InferenceService
    metrics: GatewayMetrics
    bootstrap_key: str | None = None
    jwt_verifier: AdminTokenVerifier | None = None
    max_body_bytes: int = 1 << 20
    # Folders a platform admin may register weights from over the API (nothing outside them).
    model_roots: tuple[str, ...] = ()
    # Alert routing: the secret Alertmanager sends (None: its webhook answers 503), and the forwarder
    # to wake when alerts are enqueued (None: none runs in this process; the next one to poll delivers).
    alert_webhook_secret: str | None = None
    alert_forwarder: AlertForwarder | None = None
    # Where requests that callers steer (webhooks, http(s) model sources) may connect besides public
    # addresses: the operator's allow-list (empty: public addresses only).
    outbound: OutboundPolicy = field(default_factory=OutboundPolicy)
    # Called after an admin registers a LoRA adapter, so it is served without waiting for the next
    # refresh from the registry (None: the next refresh serves it).
    refresh_adapters: Callable[[], None] | None = None
    # Console sign-ins (gateway/console/): a session cookie stands in for the credential it was
    # exchanged for, with a CSRF header (None: no console, the cookie is ignored).
    console: ConsoleSessions | None = None
    # Deployment name -> its resource's status conditions (the cluster's catalog sync sets it; None:
    # no resources behind the deployments, as under `inferplane up`).
    deployment_conditions: Callable[[], Mapping[str, list[dict[str, Any]]]] | None = None
    # Deployments changed through the admin API (`inferplane up` sets it; None in a cluster, where
    # InferenceDeployment resources are the one way in).
    deployment_control: DeploymentControl | None = None

    def tenant_principal(self, credential: str | None) -> Principal:
        if not credential:
            raise Unauthenticated("missing API key: send 'Authorization: Bearer ip_...'")
        return self.keys.verify(credential)

    def admin_principal(self, credential: str | None) -> Principal:
        if not credential:
            raise Unauthenticated("missing admin credential")
        return authenticate_admin(credential, jwt_verifier=self.jwt_verifier, bootstrap_key=self.bootstrap_key,
                                  key_cache=self.keys)


    async def authenticate(self, authorization: str | None, session: str | None, csrf: str | None, *,
                           admin: bool) -> Principal:
        """`caller`, and where a key is refused because this gateway's key cache does not hold it
        yet, once more after the cache caught up (KeyCache.catch_up): a key made a moment ago
        through the database works at once."""
        try:
            return self.caller(authorization, session, csrf, admin=admin)
        except Unauthenticated:
            if not self.keys.unknown(bearer(authorization)):
                raise
        await self.keys.catch_up()
        return self.caller(authorization, session, csrf, admin=admin)

    def caller(self, authorization: str | None, session: str | None, csrf: str | None, *,
               admin: bool) -> Principal:
        """Who calls the tenant API (`admin` False) or the admin API: the bearer credential, or
        without one, a console session cookie with its CSRF header (sessions.py says why both)."""
        credential = bearer(authorization)
        if credential or not session or self.console is None:
            return self.admin_principal(credential) if admin else self.tenant_principal(credential)
        principal, _ = self.console.principal(session, csrf or "")
        if admin:
            if principal.tenant_id is not None:
                principal.require(SCOPE_ADMIN)
        elif principal.tenant_id is None:
            raise Forbidden("the tenant API acts for a tenant: sign in to the console with one of its keys")
        return principal


def bearer(header: str | None) -> str | None:
    """'Bearer x' → 'x'; a bare key is accepted too (gRPC metadata often carries it that way)."""
    if not header:
        return None
    scheme, _, value = header.partition(" ")
    return value.strip() if scheme.lower() == "bearer" and value else header.strip()
