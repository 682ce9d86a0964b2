"""Parsing of the size strings users write: Kubernetes quantities ("8Gi", "500m") and byte sizes ("2GiB").

The worker's `--kv-cache-memory` takes bytes ("2GiB") or a fraction of free GPU memory ("0.9"), while
pod resources use Kubernetes quantities; validation compares the two, so both parse here, once.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": Decimal(1), "k": Decimal(10**3),
            "K": Decimal(10**3), "M": Decimal(10**6), "G": Decimal(10**9), "T": Decimal(10**12),
            "P": Decimal(10**15), "E": Decimal(10**18)}
_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|K|M|G|T|P|E)?$")
_BYTES = re.compile(r"^([0-9]+(?:\.[0-9]+)?)\s*(B|KiB|MiB|GiB|TiB|KB|MB|GB|TB|Ki|Mi|Gi|Ti|K|M|G|T)?$")
# The same grammar as a JSON-schema pattern, so that the CRD rejects what this module cannot parse.
KV_CACHE_MEMORY_PATTERN = (
    r"^(0?\.[0-9]+|1(\.0+)?|[0-9]+(\.[0-9]+)?\s*(B|KiB|MiB|GiB|TiB|KB|MB|GB|TB|Ki|Mi|Gi|Ti|K|M|G|T))$"
)


# parse_bytes' grammar as a JSON-schema pattern (sizes that are bytes only: the KV tiers').
BYTES_PATTERN = r"^[0-9]+(\.[0-9]+)?\s*(B|KiB|MiB|GiB|TiB|KB|MB|GB|TB|Ki|Mi|Gi|Ti|K|M|G|T)?$"


def parse_quantity(text: str | int | float) -> Decimal:
    """A Kubernetes resource quantity ("2", "500m", "8Gi") as a number of base units."""
    if isinstance(text, int | float):
        return Decimal(str(text))
    match = _QUANTITY.match(str(text).strip())
    if not match:
        raise ValueError(f"not a Kubernetes quantity: {text!r}")
    number, suffix = Decimal(match.group(1)), match.group(2) or ""
    return number * (_BINARY[suffix] if suffix in _BINARY else _DECIMAL[suffix])


def parse_bytes(text: str) -> int:
    """A byte size such as "2GiB", "512MiB" or "1073741824"; binary and SI suffixes both work."""
    match = _BYTES.match(str(text).strip())
    if not match:
        raise ValueError(f"not a byte size: {text!r}")
    suffix = (match.group(2) or "B").removesuffix("B") if match.group(2) != "B" else ""
    try:
        number = Decimal(match.group(1))
    except InvalidOperation as exc:  # pragma: no cover - the regex admits only decimals
        raise ValueError(f"not a byte size: {text!r}") from exc
    factor = _BINARY.get(suffix) or _DECIMAL.get(suffix.upper() if suffix != "K" else "K", Decimal(1))
    return int(number * factor)


def kv_cache_fraction(text: str) -> float | None:
    """The fraction in "0.9" (of free GPU memory), or None when the value is a byte size."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value if 0.0 < value <= 1.0 else None
