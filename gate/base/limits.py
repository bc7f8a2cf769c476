"""Rate limits: configuration, scopes, client identity and the 429 answer.

Every limiter is a GCRA (generic cell rate algorithm) kept in Redis and judged by
Redis `TIME`, so it is exact across any number of gate processes and immune to
their clock skew. A limit `<count>/<s|m|h> [burst <n>]` lets `burst` requests
through at once (default: `count`) and then one every `period / count`.

Scopes and where they run:
  deal, user, ip, device  keys in the deal's hash slot ({d:ID}): checked inside the
                          admission script, after the cheap answers (sold out, sale
                          window, replay), all-or-nothing
  global                  its own key: a separate script sent in the same pipeline
                          as the admission (one round trip on a standalone Redis)
The user, ip and device limits therefore count per deal; the global limit bounds
the whole reservation endpoint.
"""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

from gate.base.errors import Problem, invalid

SCOPES = ("deal", "user", "ip", "device", "global")
_PERIOD_SECONDS = {"s": 1, "m": 60, "h": 3600}
_SPEC_RE = re.compile(r"\s*(\d+)\s*/\s*([smh])\s*(?:burst\s+(\d+)\s*)?", re.IGNORECASE)
DEVICE_ID_RE = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
MAX_COUNT = 1_000_000


class LimitError(ValueError):
    pass


@dataclass(frozen=True)
class LimitSpec:
    count: int
    period_seconds: int
    burst: int

    @property
    def emission_ms(self) -> int:
        """Milliseconds between two requests at the sustained rate (at least 1)."""
        return max(1, (self.period_seconds * 1000) // self.count)

    def policy(self, scope: str) -> str:
        return f'"{scope}";q={self.count};w={self.period_seconds}'

    def describe(self) -> str:
        return f"{self.count}/{self.period_seconds}s burst {self.burst}"


def parse_limit(name: str, raw: str | None, default: str) -> LimitSpec | None:
    text = (raw if raw is not None and raw.strip() else default).strip()
    if text.lower() == "off":
        return None
    match = _SPEC_RE.fullmatch(text)
    if not match:
        raise LimitError(
            f"{name} must be '<count>/<s|m|h>' with an optional ' burst <n>', or 'off'"
            f" (e.g. '20/s burst 40'); got {text!r}"
        )
    count = int(match[1])
    burst = int(match[3]) if match[3] else count
    if not 1 <= count <= MAX_COUNT or not 1 <= burst <= MAX_COUNT:
        raise LimitError(f"{name}: count and burst must be between 1 and {MAX_COUNT}")
    return LimitSpec(count, _PERIOD_SECONDS[match[2].lower()], burst)


Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_networks(name: str, raw: str | None) -> tuple[Network, ...]:
    nets: list[Network] = []
    for part in re.split(r"[\s,]+", (raw or "").strip()):
        if not part:
            continue
        try:
            nets.append(ipaddress.ip_network(part, strict=False))
        except ValueError:
            raise LimitError(f"{name}: {part!r} is not an IP address or network") from None
    return tuple(nets)


def _trusted(address: str, trusted: Iterable[Network]) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return any(ip in net for net in trusted)


def client_ip(
    peer: str | None,
    forwarded_for: str | None,
    trusted: tuple[Network, ...],
    v6_prefix: int = 128,
) -> str:
    """The client address the IP limiter counts: the socket peer, unless the peer is
    a trusted proxy: then the right-most address in X-Forwarded-For that is not
    itself a trusted proxy. An IPv6 client counts as its /v6_prefix network
    (`limit_address`)."""
    return limit_address(_client_address(peer, forwarded_for, trusted), v6_prefix)


def _client_address(
    peer: str | None, forwarded_for: str | None, trusted: tuple[Network, ...]
) -> str:
    address = peer or "unknown"
    if not trusted or not forwarded_for or not _trusted(address, trusted):
        return address
    hops = [h.strip() for h in forwarded_for.split(",") if h.strip()][-32:]
    for hop in reversed(hops):
        if not _trusted(hop, trusted):
            try:
                ip = ipaddress.ip_address(hop)
            except ValueError:
                return address
            if isinstance(ip, ipaddress.IPv6Address) and ip.scope_id is not None:
                # A scope id ("fe80::1%eth0") is free text, any bytes: one client
                # spelling it many ways would count as many addresses.
                return address
            return str(ip)
    return hops[0] if hops else address


def limit_address(address: str, v6_prefix: int) -> str:
    """An IPv6 address as its /v6_prefix network ("2001:db8:1:2::/64"): one
    subscriber is usually given a whole /64 and may use any address in it, so per
    address an IPv6 client could have as many IP limits as it likes. IPv4 (and an
    IPv4-mapped IPv6 address, as IPv4) is counted as is."""
    if ":" not in address:
        return address  # IPv4, or "unknown": no parsing on the common path
    try:
        ip = ipaddress.IPv6Address(address)
    except ValueError:
        return address
    if ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    if v6_prefix >= 128:
        return str(ip)
    return str(ipaddress.IPv6Network((int(ip), v6_prefix), strict=False))


def device_id(header: str | None) -> str | None:
    if header is None:
        return None
    if not DEVICE_ID_RE.fullmatch(header):
        raise invalid("X-Device-Id must be 1-128 characters of [A-Za-z0-9_.:-].")
    return header


def rate_limited(scope: str, spec: LimitSpec, retry_ms: int) -> Problem:
    """The 429 answer: Retry-After in whole seconds (at least 1) and the IETF
    RateLimit / RateLimit-Policy fields naming the scope that refused."""
    retry_seconds = max(1, math.ceil(retry_ms / 1000))
    return Problem(
        "RATE_LIMITED",
        f"Too many requests for the {scope} limit ({spec.describe()}); retry in {retry_seconds} s.",
        retry_after_seconds=retry_seconds,
        headers={
            "RateLimit-Policy": spec.policy(scope),
            "RateLimit": f'"{scope}";r=0;t={retry_seconds}',
        },
        extra={"scope": scope},
    )
