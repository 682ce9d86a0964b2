"""What every admin API body shares: strict types and the longest string each field may hold.

The admin API stores what it is given, so every string has a maximum length and every integer is
an integer: without them a tenant admin could store a key with a 50 MB name, and `true` or `"5"`
was taken for 1 or 5. The limits live here, once; the request models of the admin routers
(`routes/`) name them. A value over a limit is a 422 naming the field, like every other admin
body error.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from inferplane.control_plane.alerts.webhooks import MAX_URL_LENGTH, SECRET_MAX_LENGTH

# Integers the database stores as 64-bit: a larger one is a 422 naming the field, not an overflow.
INT64_MAX = 2**63 - 1

TENANT_ID_MAX_LENGTH = 64  # tenants.TENANT_ID_RE's 1-64 characters
DISPLAY_NAME_MAX_LENGTH = 256
KEY_NAME_MAX_LENGTH = 256
SCOPE_MAX_LENGTH = 64  # the known scopes are a few characters; the rest is refused by name anyway
SCOPES_MAX_ITEMS = 16
MODEL_SOURCE_MAX_LENGTH = 2048  # a path, an alias or a URI
MODEL_NAME_MAX_LENGTH = 128  # registry.NAME_RE's 1-128 characters
MODEL_VERSION_MAX_LENGTH = 64  # registry.VERSION_RE's 1-64 characters
SHA256_HEX_LENGTH = 64
WEBHOOK_URL_MAX_LENGTH = MAX_URL_LENGTH  # the webhook validators' own limits
WEBHOOK_SECRET_MAX_LENGTH = SECRET_MAX_LENGTH


class AdminBody(BaseModel):
    """Base of the admin API's request bodies: strict, as the OpenAI bodies are (`openai_types._Base`),
    so a JSON `true` or `"5"` is not an integer."""

    model_config = ConfigDict(strict=True)
