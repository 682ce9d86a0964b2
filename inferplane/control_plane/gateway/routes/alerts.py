"""Alert routing over REST: Alertmanager's webhook, tenants' alert listing, tenants' webhook URLs.

`POST /alerts/v1/webhook` takes Alertmanager's notifications, authenticated with the shared secret
Alertmanager sends as `Authorization: Bearer <secret>` (its webhook_config's
`http_config.authorization`). Without a configured secret it answers 503, not 404: Alertmanager
retries 5xx answers and drops 4xx ones, so notifications sent while routing is being switched on are
kept and resent, and its logs say "not configured" instead of a misleading "no such URL". A missing
or wrong secret is 401; a malformed body is 400 naming the field, and nothing of it is stored (the
whole body is validated before the one transaction that writes it).

`GET /v1/alerts` lists the calling key's tenant's alerts only, each delivery with its outcome class
(delivered, refused, failed), never the receiver's status code or the connection error (those are
in the gateway's log and the database, for the operator); `/admin/v1/tenants/{id}/webhooks`
manages where they are sent (a platform admin, or that tenant's admin). A URL whose host is a
literal internal address the gateway's outbound policy refuses is a 400 `address_not_allowed`
naming `url`; host names are checked when the gateway connects.
"""

from __future__ import annotations

import hmac
from typing import Literal

from fastapi import APIRouter, Header, Query, Request, Response
from pydantic import Field, ValidationError
from starlette.concurrency import run_in_threadpool

from inferplane.control_plane.alerts import store, webhooks
from inferplane.control_plane.alerts.payload import AlertmanagerWebhook
from inferplane.control_plane.errors import Forbidden, InvalidInput
from inferplane.control_plane.gateway.admin_types import WEBHOOK_SECRET_MAX_LENGTH, WEBHOOK_URL_MAX_LENGTH, AdminBody
from inferplane.control_plane.gateway.context import bearer
from inferplane.control_plane.gateway.errors import error_response, validation_error_response
from inferplane.control_plane.gateway.routes.dependencies import AdminCaller, Context, TenantCaller, own_tenant


class WebhookIn(AdminBody):
    url: str = Field(max_length=WEBHOOK_URL_MAX_LENGTH)
    secret: str | None = Field(default=None, max_length=WEBHOOK_SECRET_MAX_LENGTH)  # none: generated, returned once


router = APIRouter()


# Not in the OpenAPI schema, like /metrics: Alertmanager calls it, not the API's clients.
@router.post("/alerts/v1/webhook", include_in_schema=False)
async def alertmanager_webhook(request: Request, ctx: Context, authorization: str | None = Header(default=None)):
    secret = ctx.alert_webhook_secret
    if not secret:
        return error_response(503, "alert routing is not configured on this gateway: start it with "
                                   "--alert-webhook-secret-file or $INFERPLANE_ALERT_WEBHOOK_SECRET",
                              "alert_routing_disabled")
    given = bearer(authorization)
    if not given or not hmac.compare_digest(given.encode(), secret.encode()):
        return error_response(401, "missing or wrong alert webhook secret: send 'Authorization: Bearer "
                                   "<secret>'", "invalid_webhook_secret")
    raw = await request.body()
    try:
        payload = AlertmanagerWebhook.model_validate_json(raw)
    except ValidationError as exc:
        return validation_error_response(exc.errors(), status=400)

    def record() -> store.Intake:
        with ctx.sessions.begin() as session:
            return store.record_webhook(session, payload)

    intake = await run_in_threadpool(record)
    if intake.enqueued and ctx.alert_forwarder is not None:
        ctx.alert_forwarder.wake()
    return {"received": intake.received, "transitions": intake.transitions, "deliveries": intake.enqueued}


@router.get("/v1/alerts")
def list_alerts(ctx: Context, principal: TenantCaller, status: Literal["firing", "resolved"] | None = None,
                limit: int = Query(default=100, ge=1, le=1000)):
    if principal.tenant_id is None:
        raise Forbidden("alerts are per tenant; use a tenant's key")
    with ctx.sessions.begin() as session:
        alerts = store.list_alerts(session, principal.tenant_id, status=status, limit=limit)
    return {"object": "list", "tenant": principal.tenant_id,
            "data": [{**{k: v for k, v in a.__dict__.items() if k != "deliveries"},
                      "deliveries": [d.__dict__ for d in a.deliveries]} for a in alerts]}


@router.get("/admin/v1/tenants/{tenant_id}/webhooks")
def admin_list_webhooks(tenant_id: str, ctx: Context, principal: AdminCaller):
    own_tenant(principal, tenant_id)
    with ctx.sessions.begin() as session:
        return {"data": [w.__dict__ for w in webhooks.list_webhooks(session, tenant_id)]}


@router.put("/admin/v1/tenants/{tenant_id}/webhooks",
            responses={201: {"description": "the webhook was added (with its secret if one was generated)"}})
def admin_set_webhook(tenant_id: str, body: WebhookIn, response: Response, ctx: Context, principal: AdminCaller):
    """Adds the URL (201), or gives an existing one a new secret (200). The secret is returned
    only when it was generated here."""
    own_tenant(principal, tenant_id)
    checks = [("url", lambda url: webhooks.validate_webhook_url(url, ctx.outbound), body.url)]
    if body.secret is not None:
        checks.append(("secret", webhooks.validate_webhook_secret, body.secret))
    for param, check, value in checks:  # the CLI's validators, answered as the admin API answers
        try:
            check(value)
        except webhooks.AddressRefused as exc:  # well-formed, but not a destination: 400, not 422
            return error_response(400, str(exc), exc.code, param)
        except InvalidInput as exc:
            return error_response(422, str(exc), "invalid_value", param)
    with ctx.sessions.begin() as session:
        result = webhooks.set_webhook(session, tenant_id, body.url, actor=principal.actor, secret=body.secret,
                                      outbound=ctx.outbound)
    response.status_code = 201 if result.created else 200
    answer = dict(result.webhook.__dict__)
    if result.generated_secret is not None:
        answer["secret"] = result.generated_secret
    return answer


@router.delete("/admin/v1/tenants/{tenant_id}/webhooks/{webhook_id}")
def admin_remove_webhook(tenant_id: str, webhook_id: int, ctx: Context, principal: AdminCaller):
    own_tenant(principal, tenant_id)
    with ctx.sessions.begin() as session:
        return webhooks.remove_webhook(session, tenant_id, webhook_id, actor=principal.actor).__dict__

