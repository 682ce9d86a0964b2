"""The REST gateway's routes, one `APIRouter` per domain; `rest.create_app` includes them in order.

  alerts      Alertmanager's webhook, a tenant's alerts, its webhook URLs
  service     /healthz, /readyz and the root banner (not in the OpenAPI schema)
  inference   the OpenAI-compatible tenant API: models, completions, chat, embeddings
  messages    Anthropic's Messages API, served as chat completions
  responses   OpenAI's Responses API, served as chat completions, its answers stored per tenant
  usage       a tenant's token usage
  tenants     /admin/v1/tenants
  keys        /admin/v1/keys
  registry    /admin/v1/models and /admin/v1/adapters
  deployments /admin/v1/deployments: InferenceDeployments on a running `inferplane up`
  console     the web console's page, sign-in and sign-out, and its operators' views (sessions: ../console/)

`dependencies` is what they share: the gateway's context (on `app.state`), the authenticated
caller, and what a caller may manage.
"""
