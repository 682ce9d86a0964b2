"""Holds requests for a served model with no replica while the autoscaler starts one.

A deployment scaled to zero would otherwise answer every request 503 until something scaled it up;
here the request waits in a bounded queue (the spec's `autoscaling.queueSize` and
`queueTimeoutSeconds`), the held count is a signal that makes the autoscaler want a replica at
once, and the request proceeds the moment the router has one. If the served model has a spillover
deployment with replicas, nothing is held: the router sends the request there while the primary
starts. A full queue or a wait past the timeout is a 503 with Retry-After, never a hang.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from inferplane.control_plane.errors import ServiceUnavailable


@dataclass(frozen=True)
class HoldPolicy:
    queue_size: int
    timeout: float


class Activator:
    def __init__(self, *, poll_interval: float = 0.05) -> None:
        self._policies: dict[str, HoldPolicy] = {}
        self._held: dict[str, int] = {}
        self._poll = poll_interval

    def configure(self, model: str, policy: HoldPolicy | None) -> None:
        """Hold requests for `model` under `policy` (None: never hold, answer 503 at once)."""
        if policy is None:
            self._policies.pop(model, None)
        else:
            self._policies[model] = policy

    def held(self, model: str) -> int:
        return self._held.get(model, 0)

    async def wait_for_replica(self, model: str, has_replica: Callable[[], bool]) -> None:
        """Returns once `has_replica()`; raises ServiceUnavailable (503, model_starting) when the queue
        is full or time runs out."""
        if has_replica():
            return
        policy = self._policies.get(model)
        if policy is None:
            return  # not scalable from zero: routing answers no_replica_available
        if self.held(model) >= policy.queue_size:
            raise ServiceUnavailable(f"model {model!r} is starting a replica and its queue of {policy.queue_size} "
                                     "held requests is full", code="model_starting", retry_after=policy.timeout / 2)
        self._held[model] = self.held(model) + 1
        loop = asyncio.get_running_loop()
        deadline = loop.time() + policy.timeout
        try:
            while not has_replica():
                if loop.time() >= deadline:
                    raise ServiceUnavailable(f"model {model!r} had no replica ready within {policy.timeout:g} s",
                                             code="model_starting", retry_after=policy.timeout / 2)
                await asyncio.sleep(self._poll)
        finally:
            self._held[model] -= 1
