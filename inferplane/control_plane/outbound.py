"""Requests that tenants (or admins over the API) steer: where the gateway may connect, checked at connect time.

A tenant's webhook URL and a platform admin's `http(s)://` model source make the gateway connect to
an address someone else chose. Left open, that is a way into the cluster's network: the gateway's
loopback, the pod network, the cloud metadata service (169.254.169.254), and the delivery log or
the registration error becomes a port scanner. So these requests go through `guarded_transport` /
`guarded_async_transport`, whose connections resolve the host once, check *every* address it
resolves to, and connect to the checked address itself. Checking the name earlier (at registration)
and letting the HTTP client resolve it again later would lose to DNS rebinding: a name that
answers a public address when checked and 127.0.0.1 when connected. Numeric spellings that
`getaddrinfo` accepts (`0x7f000001`, `2130706433`, `127.1`) go through the same resolver, so they
are checked as the address they become. The Host header and TLS SNI/certificate check still use
the URL's host name: only the TCP connection is pinned to the checked address.

Public addresses (`ipaddress`'s `is_global`, less multicast, reserved and site-local ranges, with
the IPv4 address inside IPv4-mapped and 6to4 IPv6 addresses checked as IPv4) are allowed. Anything
else (loopback, RFC 1918, CGNAT 100.64/10, link-local, ULA fc00::/7, unspecified, multicast,
reserved, documentation ranges) is refused unless the operator's allow-list
(`--outbound-allow` / `$INFERPLANE_OUTBOUND_ALLOW`) names it: a CIDR (`10.20.0.0/16`, `127.0.0.1`)
admits those addresses, a host name (`hooks.corp.example`, or `*.corp.example` for its subdomains)
admits whatever that name resolves to. Environment proxies (`HTTP_PROXY`...) are not used for
these requests: a proxy would connect wherever it is told, past the check.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import re
import socket
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpcore
import httpx

from inferplane.control_plane.errors import InvalidInput

ENV_OUTBOUND_ALLOW = "INFERPLANE_OUTBOUND_ALLOW"

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
# host, port -> the addresses to connect to, as text (getaddrinfo's answers, in its order)
Resolver = Callable[[str, int], Sequence[str]]

_HOST_RE = re.compile(r"^(\*\.)?[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?(\.[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?)*$")
_IPV4_FORM_RE = re.compile(r"^[0-9a-fA-FxX.]+$")
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_SHARED = ipaddress.IPv4Network("100.64.0.0/10")  # CGNAT: is_global already says no; spelled out for readers


class AddressNotAllowed(httpx.ConnectError):
    """The host resolved to an address this gateway does not connect to; nothing was sent.

    An `httpx.ConnectError`, so callers that already treat unreachable hosts as failures keep
    working; callers that tell tenants "refused" apart from "failed" check for this class."""

    def __init__(self, host: str, address: str) -> None:
        super().__init__(f"{host} resolves to {address}, an internal address this gateway does not connect to "
                         f"(allow it with --outbound-allow or ${ENV_OUTBOUND_ALLOW})")
        self.host, self.address = host, address


def is_public(ip: IPAddress) -> bool:
    """Whether `ip` is a public unicast address (the default policy's whole rule).

    `is_global` alone lets multicast (224.0.0.0/4, ff00::/8) and deprecated site-local fec0::/10
    through on this Python, and calls every IPv4-mapped address private, public or not; so the IPv4
    address inside a mapped (::ffff:a.b.c.d) or 6to4 (2002:a.b.c.d::) address is checked as IPv4."""
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return is_public(ip.ipv4_mapped)
        if ip.sixtofour is not None and not is_public(ip.sixtofour):
            return False
        if ip in _NAT64 or ip.is_site_local:
            return False
    elif ip in _SHARED:
        return False
    return ip.is_global and not (ip.is_multicast or ip.is_reserved or ip.is_private or ip.is_loopback
                                 or ip.is_link_local or ip.is_unspecified)


def literal_address(host: str) -> IPAddress | None:
    """The address a URL's host spells out literally, in any form `getaddrinfo` would read without
    DNS (`127.0.0.1`, `::1`, `0x7f000001`, `2130706433`, `127.1`, `0177.0.0.1`); None for a name."""
    text = host.strip("[]").rstrip(".")
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        pass
    if not _IPV4_FORM_RE.match(text):
        return None
    try:
        return ipaddress.IPv4Address(socket.inet_aton(text))  # the BSD forms: hex, octal, fewer parts
    except OSError:
        return None


def _parse_entry(entry: str) -> IPNetwork | str:
    text = entry.strip().lower().rstrip(".")
    try:
        return ipaddress.ip_network(text)  # strict: "10.1.2.3/8" is a typo to report, not 10.0.0.0/8
    except ValueError as exc:
        if "/" in text or literal_address(text) is not None:
            raise ValueError(f"outbound allow-list entry {entry!r}: {exc}") from None
    if not _HOST_RE.match(text) or len(text) > 253:
        raise ValueError(f"outbound allow-list entry {entry!r}: neither a CIDR (10.0.0.0/8, 127.0.0.1) nor a host "
                         "name (hooks.corp.example, *.corp.example)")
    return text


def split_entries(text: str | None) -> list[str]:
    """`$INFERPLANE_OUTBOUND_ALLOW`'s form: entries separated by commas and/or whitespace."""
    return [e for e in re.split(r"[,\s]+", text or "") if e]


@dataclass(frozen=True)
class OutboundPolicy:
    """Where steered requests may connect: public addresses, plus the allow-list. The default
    (empty) policy is the safe one, so forgetting to pass a policy refuses instead of allowing."""

    networks: tuple[IPNetwork, ...] = ()
    hosts: frozenset[str] = frozenset()  # exact names, and "*.suffix" for subdomains of suffix

    @classmethod
    def parse(cls, entries: Iterable[str]) -> OutboundPolicy:
        """From allow-list entries (CIDRs, single addresses, host names); `ValueError` naming a bad one."""
        networks: list[IPNetwork] = []
        hosts: set[str] = set()
        for entry in entries:
            parsed = _parse_entry(entry)
            if isinstance(parsed, str):
                hosts.add(parsed)
            else:
                networks.append(parsed)
        return cls(tuple(networks), frozenset(hosts))

    @classmethod
    def from_env(cls) -> OutboundPolicy:
        """The allow-list in `$INFERPLANE_OUTBOUND_ALLOW` (the CLI commands that write to the database
        read it, so they refuse what the gateway would); `InvalidInput` naming a bad entry."""
        try:
            return cls.parse(split_entries(os.environ.get(ENV_OUTBOUND_ALLOW)))
        except ValueError as exc:
            raise InvalidInput(f"${ENV_OUTBOUND_ALLOW}: {exc}") from None

    def host_allowed(self, host: str) -> bool:
        """Whether `host` is an allow-listed name (then every address it resolves to is allowed)."""
        name = host.lower().rstrip(".")
        if name in self.hosts:
            return True
        return any(h.startswith("*.") and name.endswith(h[1:]) for h in self.hosts)

    def address_allowed(self, ip: IPAddress) -> bool:
        """Public, or inside an allow-listed network (an IPv4-mapped address as its IPv4 address too)."""
        candidates = [ip] if not isinstance(ip, ipaddress.IPv6Address) or ip.ipv4_mapped is None \
            else [ip, ip.ipv4_mapped]
        return is_public(ip) or any(c in net for c in candidates for net in self.networks if c.version == net.version)

    def refused_address(self, host: str, addresses: Iterable[str]) -> str | None:
        """The first of `host`'s resolved addresses the policy refuses (None: all allowed). One
        refused address refuses the host: otherwise a name answering [public, internal] would reach
        the internal one whenever the public one does not answer."""
        if self.host_allowed(host):
            return None
        for text in addresses:
            try:
                ip = ipaddress.ip_address(text.split("%", 1)[0])  # drop an IPv6 zone id ("fe80::1%eth0")
            except ValueError:
                return text
            if not self.address_allowed(ip):
                return text
        return None

    def refused_literal(self, host: str) -> IPAddress | None:
        """For checks before any connection (a URL being registered): the literal address in `host`
        when the policy refuses it; None for names (those are checked when connecting)."""
        ip = literal_address(host)
        if ip is None or self.host_allowed(host) or self.address_allowed(ip):
            return None
        return ip


def resolve(host: str, port: int) -> list[str]:
    """The system resolver: every address `host` has, once each, in getaddrinfo's order."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def check_url(url: str, policy: OutboundPolicy, *, resolver: Resolver = resolve) -> None:
    """Resolves the URL's host and raises `AddressNotAllowed` if the policy refuses an address; for
    a use that may not connect at all (a cached download). A name that does not resolve passes:
    the connection, if any, fails later without reaching anything."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        addresses = resolver(host, port)
    except OSError:
        return
    refused = policy.refused_address(host, addresses)
    if refused is not None:
        raise AddressNotAllowed(host, refused)


def _checked(policy: OutboundPolicy, host: str, addresses: Sequence[str]) -> Sequence[str]:
    if not addresses:
        raise httpcore.ConnectError(f"{host} has no address")
    refused = policy.refused_address(host, addresses)
    if refused is not None:
        raise AddressNotAllowed(host, refused)
    return addresses


class _GuardedAsyncBackend(httpcore.AsyncNetworkBackend):
    """httpcore's network layer with the check in front: resolve, check all, connect to a checked address."""

    def __init__(self, policy: OutboundPolicy, resolver: Resolver) -> None:
        self._policy, self._resolver = policy, resolver
        self._inner = httpcore.AnyIOBackend()

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                          socket_options: Iterable[Any] | None = None) -> httpcore.AsyncNetworkStream:
        try:
            found = await asyncio.wait_for(asyncio.to_thread(self._resolver, host, port), timeout)
        except TimeoutError:
            raise httpcore.ConnectTimeout(f"resolving {host} timed out") from None
        except OSError as exc:
            raise httpcore.ConnectError(f"cannot resolve {host}: {exc}") from exc
        error: Exception | None = None
        for address in _checked(self._policy, host, found):
            try:
                return await self._inner.connect_tcp(address, port, timeout=timeout, local_address=local_address,
                                                     socket_options=socket_options)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                error = exc
        assert error is not None
        raise error

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Iterable[Any] | None = None) -> httpcore.AsyncNetworkStream:
        raise httpcore.ConnectError("unix sockets are not an outbound destination")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


class _GuardedSyncBackend(httpcore.NetworkBackend):
    """The synchronous twin of `_GuardedAsyncBackend` (model downloads run in worker threads)."""

    def __init__(self, policy: OutboundPolicy, resolver: Resolver) -> None:
        self._policy, self._resolver = policy, resolver
        self._inner = httpcore.SyncBackend()

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options: Iterable[Any] | None = None) -> httpcore.NetworkStream:
        try:
            found = self._resolver(host, port)
        except OSError as exc:
            raise httpcore.ConnectError(f"cannot resolve {host}: {exc}") from exc
        error: Exception | None = None
        for address in _checked(self._policy, host, found):
            try:
                return self._inner.connect_tcp(address, port, timeout=timeout, local_address=local_address,
                                               socket_options=socket_options)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                error = exc
        assert error is not None
        raise error

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: Iterable[Any] | None = None) -> httpcore.NetworkStream:
        raise httpcore.ConnectError("unix sockets are not an outbound destination")

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


_LIMITS = httpx.Limits(max_connections=100, max_keepalive_connections=20, keepalive_expiry=5.0)


def _require_pool(transport: httpx.HTTPTransport | httpx.AsyncHTTPTransport, kind: type) -> None:
    """httpx keeps its httpcore pool in `_pool`; the guard replaces it. Should a release rename it,
    refuse to build the transport rather than hand out one that would connect unchecked."""
    if not isinstance(getattr(transport, "_pool", None), kind):
        raise RuntimeError(f"httpx {httpx.__version__} keeps no {kind.__name__} in _pool: the outbound guard "
                           "cannot be installed")


class GuardedAsyncTransport(httpx.AsyncHTTPTransport):
    """An `httpx.AsyncHTTPTransport` whose every connection is checked against `policy`."""

    def __init__(self, policy: OutboundPolicy, *, resolver: Resolver = resolve, verify: bool = True) -> None:
        super().__init__(verify=verify, limits=_LIMITS)
        _require_pool(self, httpcore.AsyncConnectionPool)
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=httpx.create_ssl_context(verify=verify), max_connections=_LIMITS.max_connections,
            max_keepalive_connections=_LIMITS.max_keepalive_connections, keepalive_expiry=_LIMITS.keepalive_expiry,
            network_backend=_GuardedAsyncBackend(policy, resolver))


class GuardedTransport(httpx.HTTPTransport):
    """An `httpx.HTTPTransport` whose every connection is checked against `policy`."""

    def __init__(self, policy: OutboundPolicy, *, resolver: Resolver = resolve, verify: bool = True) -> None:
        super().__init__(verify=verify, limits=_LIMITS)
        _require_pool(self, httpcore.ConnectionPool)
        self._pool = httpcore.ConnectionPool(
            ssl_context=httpx.create_ssl_context(verify=verify), max_connections=_LIMITS.max_connections,
            max_keepalive_connections=_LIMITS.max_keepalive_connections, keepalive_expiry=_LIMITS.keepalive_expiry,
            network_backend=_GuardedSyncBackend(policy, resolver))
