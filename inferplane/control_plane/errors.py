"""The control plane's errors (the gateway's included), one class per HTTP status it answers with.

Every class is a `ValueError` so plain callers (the CLI, tests) can catch one thing, and carries
`status` (the HTTP code), `code` (a stable machine-readable string for the error body; a raise may
name a more precise one, such as `context_length_exceeded`), the request field to blame and, where
waiting helps, `retry_after`, so the gateway maps any of them with one handler instead of an
`isinstance` ladder, on REST and gRPC alike.
"""

from __future__ import annotations

import math


class ControlPlaneError(ValueError):
    """Base class: `status` is the HTTP status, `code` the OpenAI-style error `code`."""

    status: int = 400
    code: str = "invalid_request_error"
    # The request field to blame (OpenAI's error `param`), when one is: "n" for too many choices.
    param: str | None = None
    # Seconds after which a retry may succeed (the Retry-After header); None: do not invite one.
    retry_after: float | None = None

    def __init__(self, message: str = "", *, code: str | None = None, param: str | None = None,
                 retry_after: float | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code
        if param is not None:
            self.param = param
        if retry_after is not None:
            self.retry_after = max(0.0, float(retry_after))

    @property
    def retry_after_header(self) -> str | None:
        """The `Retry-After` header value: whole seconds, rounded up, at least 1 (0 invites a hot
        loop); None when waiting is not the remedy."""
        return None if self.retry_after is None else str(max(1, math.ceil(self.retry_after)))


class InvalidInput(ControlPlaneError):
    """400: the request names something malformed (a bad name, scope, path, duration...)."""

    status = 400
    code = "invalid_request_error"


class RequestTooLarge(InvalidInput):
    """400: the request alone needs more than a limit ever allows (tokens than the key's per-minute
    budget holds, sequences than its tenant's or key's concurrent-sequence limit): waiting never helps."""

    code = "request_too_large"


class Unauthenticated(ControlPlaneError):
    """401: missing, malformed, unknown, revoked or expired credential.

    The message is deliberately generic in the cases that would tell an attacker which key ids exist.
    """

    status = 401
    code = "invalid_api_key"


class Forbidden(ControlPlaneError):
    """403: the credential is valid but lacks the scope (or tenant) the operation needs."""

    status = 403
    code = "permission_denied"


class NotFound(ControlPlaneError):
    """404: no such object *visible to the caller* (another tenant's private objects are 404 too)."""

    status = 404
    code = "not_found"


class ModelNotFound(NotFound):
    """404 for a model the caller asked to run: OpenAI's code, which its clients and users look for."""

    code = "model_not_found"


class Conflict(ControlPlaneError):
    """409: the object already exists, or is in a state that forbids the operation."""

    status = 409
    code = "conflict"


class RateLimited(ControlPlaneError):
    """429: a per-key rate limit or a tenant quota is exhausted; retry after `retry_after` seconds."""

    status = 429
    code = "rate_limit_exceeded"

    def __init__(self, message: str, retry_after: float):
        super().__init__(message, retry_after=retry_after)


class ConcurrencyLimited(RateLimited):
    """429: the key's or tenant's limit on sequences in flight at once is reached; retry when one ends."""

    code = "concurrency_limit_exceeded"


class QuotaExceeded(RateLimited):
    """429: the tenant's monthly token quota is used up; `retry_after` runs to the next month."""

    code = "insufficient_quota"


class ServiceUnavailable(ControlPlaneError):
    """503: the platform cannot serve this now, through no fault of the request: a replica failed
    (`upstream_error`) or is still starting (`model_starting`, with `retry_after`)."""

    status = 503
    code = "upstream_error"


class UpstreamTimeout(ControlPlaneError):
    """504: the model replica did not answer within the request's deadline."""

    status = 504
    code = "timeout"
