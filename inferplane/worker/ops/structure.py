"""A process-wide version of the model modules' structure, for caches of raw pointers into them.

The fused decode (fused_decode.py) hands C an array of pointers to every layer's weights, built
once rather than per step. A pointer goes stale when a module or tensor attribute is reassigned
(a layer swapped for a quantized one, a weight packed into the kernel's layout, a buffer
replaced), never when a tensor is changed in place. So every assignment to an attribute of a
`WatchedModule` bumps `version()`, and a pointer cache built at an older version is rebuilt.
In-place changes keep the pointer valid and need no bump.
"""

from __future__ import annotations

from typing import Any

from torch import nn

_version = 0


def version() -> int:
    """Bumped by every attribute assignment on any WatchedModule in this process."""
    return _version


def bump() -> None:
    """For changes that do not go through a WatchedModule's attributes (a module list edited in place)."""
    global _version
    _version += 1


class WatchedModule(nn.Module):
    """An nn.Module whose attribute assignments (modules, parameters, buffers and plain values
    alike) bump the structure version. Assignments happen while a model is built, converted and
    packed, never while it runs, so the version stays put across decode steps."""

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        bump()
