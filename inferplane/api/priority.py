"""Priority bands: the one list of them, their order, and the default.

A band is set on a tenant, on a key and on a deployment (the band its requests get when the tenant
sets none). A key's band may lower its tenant's, never raise it: tenant admins mint their own keys,
so a key above its tenant's band would let a tenant the platform put in `batch` preempt the others.
Key creation refuses such a key (auth.create_key), and `resolve_band` caps whatever a key row says,
so a row from before that check, or a tenant's band lowered after its keys were made, cannot escape.
The gateway resolves a request's band with
`resolve_band` and sends it to the worker (`GenerateRequest.priority`); the worker's flow control
(worker/engine/fair_share.py) admits a higher band first and, when slots or blocks run out, preempts a
lower band first. Within a band, tenants share the replica fairly.

The names are part of the API (admin bodies, the CLI, the CRD), so they live here, at the bottom
of the layers, where every component reads them.
"""

from __future__ import annotations

from typing import Literal

Band = Literal["critical", "standard", "batch"]
BANDS: tuple[Band, ...] = ("critical", "standard", "batch")  # most urgent first
DEFAULT_BAND: Band = "standard"
DEFAULT_RANK = BANDS.index(DEFAULT_BAND)


def band_rank(band: str | None) -> int:
    """0 for the most urgent band; "" or None is the default band. An unknown name is a ValueError
    naming the field, so a worker never guesses what an old or new gateway meant."""
    if not band:
        return DEFAULT_RANK
    try:
        return BANDS.index(band)  # type: ignore[arg-type]
    except ValueError:
        raise ValueError(f"priority: {band!r} is not a band (expected one of {', '.join(BANDS)})") from None


def least_urgent(a: str | None, b: str | None) -> Band:
    """The less urgent of two bands ("" or None: the default band)."""
    return BANDS[max(band_rank(a), band_rank(b))]


def resolve_band(key_band: str | None, tenant_band: str | None, deployment_band: str | None = None) -> Band:
    """A request's band: its tenant's, else its deployment's, else the default; a key's band lowers
    that, never raises it (so the effective band is the less urgent of the two)."""
    tenants = BANDS[band_rank(tenant_band or deployment_band)]
    return least_urgent(key_band, tenants) if key_band else tenants
