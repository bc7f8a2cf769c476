"""The webhooks' settings, read once from the environment the gate started with
(docs/configuration.md, "Webhooks")."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from gate.base.backoff import Schedule
from gate.base.settings import (
    DEV_ONLY,
    Secret,
    SettingsError,
    env_bool,
    env_float,
    env_int,
)

DEFAULT_RETRY_SCHEDULE = "5,300,1800,7200,18000,36000,36000"
# The steps' jitter: each wait is drawn from [80 %, 100 %] of its step.
RETRY_JITTER = 0.2
RETRY_STEPS_MAX = 20
# Public, for development only: `gate serve` with GATE_ENV=dev and no key of its own.
DEV_ENCRYPTION_KEY = "gate-dev-webhook-encryption-key-not-for-production"
ENCRYPTION_KEY_MIN_CHARS = 32
ENCRYPTION_KEYS_MAX = 4
ALLOWED_HOSTS_MAX = 64
_HOST_NAME_RE = re.compile(
    r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*"
)

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class AllowedHosts:
    """GATE_WEBHOOK_ALLOWED_HOSTS: host names (matched exactly, case-insensitive) and
    networks (an address inside one is allowed) that lift the address rules and
    allow http:// too (an internal receiver)."""

    names: frozenset[str] = frozenset()
    networks: tuple[Network, ...] = ()

    def name_listed(self, host: str) -> bool:
        return host.lower().rstrip(".") in self.names

    def address_listed(self, address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
        return any(address.version == n.version and address in n for n in self.networks)


def parse_allowed_hosts(raw: str) -> AllowedHosts:
    names: set[str] = set()
    networks: list[Network] = []
    entries = [e.strip() for e in raw.split(",") if e.strip()]
    if len(entries) > ALLOWED_HOSTS_MAX:
        raise SettingsError(f"GATE_WEBHOOK_ALLOWED_HOSTS lists at most {ALLOWED_HOSTS_MAX} entries")
    for entry in entries:
        text = entry.replace("[", "").replace("]", "")
        try:
            networks.append(ipaddress.ip_network(text, strict=False))
            continue
        except ValueError:
            pass
        name = entry.lower().rstrip(".")
        if len(name) > 253 or not _HOST_NAME_RE.fullmatch(name):
            raise SettingsError(
                f"GATE_WEBHOOK_ALLOWED_HOSTS: {entry[:80]!r} is neither a host name nor a CIDR"
            )
        names.add(name)
    return AllowedHosts(frozenset(names), tuple(networks))


def _encryption_keys(env: Mapping[str, str], dev: bool) -> tuple[Secret, ...]:
    raw = env.get("GATE_WEBHOOK_ENCRYPTION_KEY", "").strip()
    if not raw:
        # Without a key of its own a production gate cannot keep signing secrets
        # sealed: its endpoints' admin calls answer 409 saying so (gate/webhooks/api.py).
        return (Secret(DEV_ENCRYPTION_KEY),) if dev else ()
    keys = [k.strip() for k in raw.split(",") if k.strip()]
    if len(keys) > ENCRYPTION_KEYS_MAX:
        raise SettingsError(
            f"GATE_WEBHOOK_ENCRYPTION_KEY lists at most {ENCRYPTION_KEYS_MAX} keys (newest first)"
        )
    for key in keys:
        if len(key) < ENCRYPTION_KEY_MIN_CHARS:
            raise SettingsError(
                f"GATE_WEBHOOK_ENCRYPTION_KEY: each key must be at least"
                f" {ENCRYPTION_KEY_MIN_CHARS} characters"
            )
        if key == DEV_ENCRYPTION_KEY and not dev:
            raise SettingsError(f"GATE_WEBHOOK_ENCRYPTION_KEY is {DEV_ONLY}")
    return tuple(Secret(k) for k in keys)


def parse_schedule(raw: str) -> Schedule:
    try:
        return Schedule.parse(raw, RETRY_JITTER, RETRY_STEPS_MAX)
    except ValueError as exc:
        raise SettingsError(f"GATE_WEBHOOK_RETRY_SCHEDULE: {exc}") from None


@dataclass(frozen=True)
class WebhookSettings:
    dev: bool = False
    # Newest first: the first seals, any opens (GATE_WEBHOOK_ENCRYPTION_KEY).
    encryption_keys: tuple[Secret, ...] = ()
    timeout_seconds: float = 10.0
    schedule: Schedule = field(default_factory=lambda: parse_schedule(DEFAULT_RETRY_SCHEDULE))
    rotation_overlap_seconds: int = 86_400
    endpoints_max: int = 20
    allowed: AllowedHosts = AllowedHosts()
    # Attempts in flight per process, in total and per endpoint (each endpoint's
    # share is at most concurrency // endpoints with work, at least 1).
    concurrency: int = 64
    endpoint_concurrency: int = 16
    batch_max: int = 500
    interval_seconds: float = 0.2
    retention_days: int = 30
    run_workers: bool = True

    @property
    def claim_seconds(self) -> float:
        """How long a claimed attempt is its sender's: the timeout and a margin for
        recording its outcome. A sender that died is replaced after this."""
        return self.timeout_seconds + 5.0


def load_webhook_settings(env: Mapping[str, str], dev: bool) -> WebhookSettings:
    return WebhookSettings(
        dev=dev,
        encryption_keys=_encryption_keys(env, dev),
        timeout_seconds=env_float(env, "GATE_WEBHOOK_TIMEOUT_SECONDS", 10.0, 0.1, 60),
        schedule=parse_schedule(
            env.get("GATE_WEBHOOK_RETRY_SCHEDULE", "").strip() or DEFAULT_RETRY_SCHEDULE
        ),
        rotation_overlap_seconds=env_int(
            env, "GATE_WEBHOOK_ROTATION_OVERLAP_SECONDS", 86_400, 0, 30 * 86_400
        ),
        endpoints_max=env_int(env, "GATE_WEBHOOK_MAX_ENDPOINTS", 20, 1, 1000),
        allowed=parse_allowed_hosts(env.get("GATE_WEBHOOK_ALLOWED_HOSTS", "")),
        concurrency=env_int(env, "GATE_WEBHOOK_CONCURRENCY", 64, 1, 1024),
        endpoint_concurrency=env_int(env, "GATE_WEBHOOK_ENDPOINT_CONCURRENCY", 16, 1, 256),
        batch_max=env_int(env, "GATE_WEBHOOK_BATCH_MAX", 500, 1, 5000),
        interval_seconds=env_float(env, "GATE_WEBHOOK_INTERVAL_SECONDS", 0.2, 0.01, 60),
        retention_days=env_int(env, "GATE_WEBHOOK_RETENTION_DAYS", 30, 1, 3650),
        run_workers=env_bool(env, "GATE_WEBHOOK_WORKERS", True),
    )
