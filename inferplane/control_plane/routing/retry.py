"""Pick, stream, and retry only while it is invisible to the client.

Before the first message nothing has reached the client, so a failed replica costs only latency:
the request moves to another replica (never one already tried). After the first message a retry
would replay or diverge from text the client already has, so the failure surfaces as
``StreamBrokenAfterStart`` and the gateway ends the stream with an error event.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Collection
from typing import TypeVar

import grpc

from inferplane.control_plane.routing.endpoints import Endpoint
from inferplane.control_plane.routing.errors import NoReplicaAvailable, StreamBrokenAfterStart
from inferplane.control_plane.routing.router import Lease, Router, RouteRequest

T = TypeVar("T")
log = logging.getLogger(__name__)

# Codes that say "this replica could not take it", not "this request is wrong". DEADLINE_EXCEEDED is
# absent on purpose: the deadline belongs to the client's request and a retry would only overrun it.
RETRYABLE_CODES = frozenset({
    grpc.StatusCode.UNAVAILABLE,         # process gone, connection refused or reset
    grpc.StatusCode.RESOURCE_EXHAUSTED,  # worker queue full
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.CANCELLED,           # worker cancelled it while draining
})


# Codes that say "this request is wrong" (its message is the tenant's to read): not a replica failure.
_REQUEST_CODES = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                            grpc.StatusCode.DEADLINE_EXCEEDED})


def rpc_code(exc: BaseException | None) -> grpc.StatusCode | None:
    """The gRPC status of a failed worker call, None for anything else."""
    return exc.code() if isinstance(exc, grpc.RpcError) and callable(getattr(exc, "code", None)) else None


def _logged(exc: BaseException, address: str, model: str, what: str) -> None:
    """A replica's failure goes to the log with its address; the errors tenants read never name it."""
    code = rpc_code(exc)
    if code in _REQUEST_CODES:
        return
    details = exc.details() if code is not None and callable(getattr(exc, "details", None)) else str(exc)
    log.warning("replica %s of model %r failed (%s): %s: %s", address, model, what,
                code.name if code is not None else type(exc).__name__, details)


def is_retryable(exc: BaseException) -> bool:
    """Whether ``exc`` is the replica's fault; those count against its health, others do not."""
    code = rpc_code(exc)
    return code in RETRYABLE_CODES if code is not None else isinstance(exc, ConnectionError)


async def route_and_stream(
    router: Router,
    request: RouteRequest,
    call: Callable[[Endpoint], AsyncIterator[T]],
    *,
    max_attempts: int = 3,
    retryable: Callable[[BaseException], bool] = is_retryable,
    on_pick: Callable[[Lease], None] | None = None,
    exclude: Collection[str] = (),
) -> AsyncIterator[T]:
    """Yield the messages of ``call(endpoint)`` from a routed replica, retrying early failures.

    ``call`` opens the worker stream (e.g. ``lambda ep: stub_for(ep).Generate(req, timeout=...)``).
    Raises ``NoReplicaAvailable`` (nothing healthy left, or ``max_attempts`` replicas failed before
    starting; the last failure is its ``__cause__``), ``StreamBrokenAfterStart`` (the failure is
    its ``__cause__``), ``UnknownModel``, or a non-retryable error from the worker unchanged.
    Closing this generator early (client disconnect) closes the worker stream and frees the lease.
    `exclude`: replicas not to pick (those a migrated request already failed on).
    """
    tried: list[str] = list(exclude)
    prefer: str | None = None
    last_error: BaseException | None = None
    for _ in range(max_attempts):
        try:
            lease = router.pick(request, exclude=tried, prefer=prefer)
        except NoReplicaAvailable:
            if last_error is None:
                raise
            raise NoReplicaAvailable(request.model, tuple(tried)) from last_error
        tried.append(lease.address)
        prefer = lease.deployment.name
        if on_pick is not None:
            on_pick(lease)
        verdict: bool | None = None
        opened: object = None
        stream: AsyncIterator[T] | None = None
        sent = 0
        try:
            try:
                opened = call(lease.endpoint)
                stream = aiter(opened)  # type: ignore[call-overload]
            except Exception as exc:  # opening the call failed: nothing was sent yet
                if not retryable(exc):
                    _logged(exc, lease.address, request.model, "not retried")
                    raise
                _logged(exc, lease.address, request.model, "before its first message; retried elsewhere")
                verdict, last_error = False, exc
                continue
            while True:
                try:
                    item = await anext(stream)
                except StopAsyncIteration:
                    verdict = True
                    return
                except Exception as exc:
                    if sent:
                        verdict = False if retryable(exc) else None
                        _logged(exc, lease.address, request.model, f"after {sent} streamed message(s)")
                        raise StreamBrokenAfterStart(lease.address, sent) from exc
                    if not retryable(exc):
                        _logged(exc, lease.address, request.model, "not retried")
                        raise
                    _logged(exc, lease.address, request.model, "before its first message; retried elsewhere")
                    verdict, last_error = False, exc
                    break
                sent += 1
                yield item
        finally:
            lease.release(verdict)
            await _stop(opened, stream)
    raise NoReplicaAvailable(request.model, tuple(tried)) from last_error


async def _stop(opened: object, stream: object) -> None:
    """Stop the worker call: a grpc.aio call is cancelled (a no-op once it has finished; closing the
    iterator it hands out would not end the RPC), an async generator is closed."""
    cancel = getattr(opened, "cancel", None)
    if callable(cancel):
        cancel()
    aclose = getattr(stream, "aclose", None)
    if callable(aclose):
        await aclose()
