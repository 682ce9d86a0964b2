"""Bounds on structured-output constraints that both the gateway and the worker enforce.

The worker's `structured.GrammarLimits` holds every bound and checks them all; the gateway checks
the ones it can see in a request body without a grammar engine (here), so an oversized constraint
is refused at validation, before it is built, sent and parsed again on a replica.
"""

from __future__ import annotations

MAX_CONSTRAINT_CHOICES = 1024  # entries of a choice constraint (OpenAI allows 1,000 enum values)
MAX_REGEX_CHARS = 8192
