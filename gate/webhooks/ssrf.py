"""No server-side request forgery: where an endpoint URL may point, checked when it
is set and again on the address each delivery connects to.

    POST/PATCH …/webhook-endpoints {"url"}
      └─ check_url: the URL's form (below) ──> resolve the host ──> every address
         permitted ──> stored; else 400 WEBHOOK_URL_REFUSED with the reason
    each delivery (gate/webhooks/sender.py)
      └─ check_url again (settings may have changed) ──> aiohttp connects through
         CheckingResolver: the host resolved here, each address checked, and only
         checked addresses handed to the connector, which connects to them with the
         URL's host name as Host and TLS SNI. A name that answered a public address
         at create and a private one now (DNS rebinding) is refused now.

The form, outside GATE_ENV=dev: https:// (http:// only to a host listed in
GATE_WEBHOOK_ALLOWED_HOSTS by name, or an address literal inside a listed network),
a host name or an address literal (numeric hosts in any other form — 2130706433,
127.1, 0x7f.1 — are refused: resolvers read them as addresses), no credentials, no
fragment, ASCII, at most URL_MAX_CHARS. An address is permitted when the host is
listed by name, the address is inside a listed network, or it is a public unicast
address: not loopback, private, link-local, multicast, unspecified, reserved or
shared (100.64/10), also when wrapped in IPv6 (IPv4-mapped ::ffff:a.b.c.d,
IPv4-compatible, 6to4 2002::/16, NAT64 64:ff9b::/96, Teredo). With GATE_ENV=dev
anything http(s) without credentials goes (a developer's receiver on localhost).
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
from dataclasses import dataclass
from urllib.parse import SplitResult, urlsplit

from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import ThreadedResolver

from gate.webhooks.config import AllowedHosts

URL_MAX_CHARS = 2048
RESOLVE_TIMEOUT_SECONDS = 5.0
# Addresses one name may answer that are looked at (and handed to the connector).
ADDRESSES_MAX = 16

Address = ipaddress.IPv4Address | ipaddress.IPv6Address

_HOST_RE = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,62})(\.[A-Za-z0-9_]([A-Za-z0-9_-]{0,62}))*\.?")
_NUMERIC_LABEL_RE = re.compile(r"(0[xX][0-9A-Fa-f]*|[0-9]+)")
_PRINTABLE_RE = re.compile(r"[\x21-\x7e]+")
# NAT64's well-known prefix: the last 32 bits are an IPv4 address.
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")
_SHARED = ipaddress.ip_network("100.64.0.0/10")


class UrlRefused(Exception):
    """The URL or an address it leads to is not one the gate may call."""


@dataclass(frozen=True)
class Target:
    url: str
    scheme: str
    host: str  # as in the URL, brackets removed, lower-case
    port: int
    literal: Address | None  # the host when it is an address literal
    listed: bool  # the host is listed in GATE_WEBHOOK_ALLOWED_HOSTS by name


def _public_reason(address: Address) -> str | None:
    """Why `address` is not a public unicast address (None when it is)."""
    if isinstance(address, ipaddress.IPv6Address):
        embedded = _embedded_ipv4(address)
        if embedded is None and int(address) >> 32 == 0 and int(address) > 1:
            # IPv4-compatible (::a.b.c.d), deprecated: no public host has one.
            return "an IPv4-compatible IPv6 address"
        if address in _NAT64_LOCAL:
            return "a local-use NAT64 address"
        if embedded is not None:
            reason = _public_reason(embedded)
            return f"{reason} (inside an IPv6 address)" if reason else None
    return _special_reason(address)


def _embedded_ipv4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address `address` wraps (IPv4-mapped, 6to4, Teredo's client, NAT64),
    or None."""
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address.teredo is not None:
        return address.teredo[1]
    if address in _NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def _special_reason(address: Address) -> str | None:
    """The special-purpose range `address` is in, as a phrase (None: public unicast)."""
    if address.is_unspecified:
        return "an unspecified address"
    if address.is_loopback:
        return "a loopback address"
    if address.is_link_local:
        return "a link-local address"
    if address.is_multicast:
        return "a multicast address"
    if isinstance(address, ipaddress.IPv4Address) and address in _SHARED:
        return "a shared (carrier-grade NAT) address"
    if address.is_private:
        return "a private address"
    if address.is_reserved or not address.is_global:
        return "a reserved or non-global address"
    if isinstance(address, ipaddress.IPv6Address) and address.is_site_local:
        return "a site-local address"
    return None


def address_reason(
    address: Address, target: Target, allowed: AllowedHosts, dev: bool
) -> str | None:
    """Why the gate may not connect to `address` for `target`, as a phrase ("a
    loopback address"); None when it may."""
    if dev or target.listed or allowed.address_listed(address):
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        if allowed.address_listed(address.ipv4_mapped):
            return None
    return _public_reason(address)


def check_url(url: str, allowed: AllowedHosts, dev: bool) -> Target:
    """The URL's form (see the module's docstring); UrlRefused saying why."""
    _check_text(url)
    parts, port_given = _split(url)
    scheme = parts.scheme.lower()
    _check_parts(url, parts, scheme, port_given)
    port = port_given or (443 if scheme == "https" else 80)
    host = (parts.hostname or "").lower()
    if parts.netloc.split("@")[-1].startswith("["):
        literal: Address | None = _ipv6_literal(host)
    else:
        literal = _ipv4_literal_or_name(host)
    listed = literal is None and allowed.name_listed(host)
    target = Target(url, scheme, host, port, literal, listed)
    if scheme == "http" and not dev:
        in_network = literal is not None and allowed.address_listed(literal)
        if not (listed or in_network):
            raise UrlRefused(
                "http:// only to a host listed in GATE_WEBHOOK_ALLOWED_HOSTS; use https://"
            )
    if literal is not None:
        reason = address_reason(literal, target, allowed, dev)
        if reason:
            raise UrlRefused(f"{literal} is {reason}")
    return target


def _check_text(url: str) -> None:
    """The URL as text: not empty, not too long, printable ASCII."""
    if not isinstance(url, str) or not url:
        raise UrlRefused("the URL is empty")
    if len(url) > URL_MAX_CHARS:
        raise UrlRefused(f"the URL is longer than {URL_MAX_CHARS} characters")
    if not _PRINTABLE_RE.fullmatch(url):
        raise UrlRefused(
            "the URL must be printable ASCII without spaces (write an international host"
            " name in its xn-- form and percent-encode the path)"
        )


def _split(url: str) -> tuple[SplitResult, int | None]:
    """(the URL's parts, its port if given); UrlRefused when the host or port is
    malformed."""
    try:
        parts = urlsplit(url)
        return parts, parts.port
    except ValueError:
        raise UrlRefused("the URL is malformed (its host or port)") from None


def _check_parts(url: str, parts: SplitResult, scheme: str, port_given: int | None) -> None:
    """The scheme is http(s), no credentials, no fragment, a host, not port 0."""
    if scheme not in ("http", "https"):
        raise UrlRefused("the URL must be https:// (or http:// to a listed internal host)")
    if "@" in parts.netloc or parts.username is not None or parts.password is not None:
        raise UrlRefused("credentials in the URL are refused")
    if parts.fragment or "#" in url:
        raise UrlRefused("the URL must not have a fragment")
    if not parts.hostname:
        raise UrlRefused("the URL has no host")
    if port_given == 0:
        raise UrlRefused("port 0 is not a port")


def _ipv6_literal(host: str) -> ipaddress.IPv6Address:
    """A bracketed host: an IPv6 address, with no zone id."""
    if "%" in host:
        raise UrlRefused("an IPv6 zone id is refused")
    try:
        return ipaddress.IPv6Address(host)
    except ValueError:
        raise UrlRefused("the URL's IPv6 address is malformed") from None


def _ipv4_literal_or_name(host: str) -> ipaddress.IPv4Address | None:
    """A host without brackets: a dotted-quad IPv4 address, or (None) a valid host name;
    any other numeric form is refused."""
    try:
        return ipaddress.IPv4Address(host)
    except ValueError:
        last = host.rstrip(".").rsplit(".", 1)[-1]
        if _NUMERIC_LABEL_RE.fullmatch(last):
            raise UrlRefused(
                "a numeric host must be a dotted-quad IPv4 address (a.b.c.d, no leading zeros)"
            ) from None
        if len(host) > 253 or not _HOST_RE.fullmatch(host):
            raise UrlRefused("the URL's host is not a valid host name") from None
    return None


async def resolve(host: str, port: int) -> list[Address]:
    """Every address `host` has (bounded), or UrlRefused when it has none in time."""
    loop = asyncio.get_running_loop()
    try:
        infos = await asyncio.wait_for(
            loop.getaddrinfo(host, port, type=socket.SOCK_STREAM), RESOLVE_TIMEOUT_SECONDS
        )
    except (OSError, TimeoutError, UnicodeError):
        raise UrlRefused(f"the host {host!r} does not resolve") from None
    found: list[Address] = []
    for _family, _type, _proto, _canon, sockaddr in infos[: ADDRESSES_MAX * 4]:
        address = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
        if address not in found:
            found.append(address)
    if not found:
        raise UrlRefused(f"the host {host!r} does not resolve")
    return found[:ADDRESSES_MAX]


async def check_resolved(target: Target, allowed: AllowedHosts, dev: bool) -> None:
    """At create and update: every address the host resolves to is permitted."""
    if target.literal is not None or dev or target.listed:
        return
    for address in await resolve(target.host, target.port):
        reason = address_reason(address, target, allowed, dev)
        if reason:
            raise UrlRefused(f"{target.host} resolves to {address}, {reason}")


class CheckingResolver(AbstractResolver):
    """aiohttp's resolver for deliveries: each address the name resolves to is
    checked, and a name with any refused address is refused whole (a rebinding
    attacker answers a mix). The connector connects to what this returns."""

    def __init__(self, allowed: AllowedHosts, dev: bool) -> None:
        self.allowed = allowed
        self.dev = dev
        self._inner = ThreadedResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        results = await self._inner.resolve(host, port, family)
        target = Target("", "https", host.lower(), port, None, self.allowed.name_listed(host))
        checked: list[ResolveResult] = []
        for result in results[:ADDRESSES_MAX]:
            address = ipaddress.ip_address(str(result["host"]).split("%", 1)[0])
            reason = address_reason(address, target, self.allowed, self.dev)
            if reason:
                raise UrlRefused(f"{host} resolves to {address}, {reason}")
            checked.append(result)
        if not checked:
            raise UrlRefused(f"the host {host!r} does not resolve")
        return checked

    async def close(self) -> None:
        await self._inner.close()
