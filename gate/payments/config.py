"""Payment settings, read once from the environment the gate started with."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from gate.base.settings import (
    DEV_SANDBOX_API_KEY,
    Secret,
    SettingsError,
    env_bool,
    env_float,
    env_int,
    refuse_dev_value,
)

PROVIDER_NAME_MAX = 32
# The providers an adapter exists for (gate/payments/adapters.py names their modules).
PROVIDER_NAMES = ("sandbox", "stripe", "alipay", "wechatpay")
# `sandbox-<label>`: the sandbox under a name of its own, so that a test suite's rows
# stay apart from other suites' in a shared database (tests/payments/test_reconcile.py).
SANDBOX_LABEL_RE = re.compile(r"sandbox-[a-z0-9]{1,24}")


def provider_name(env: Mapping[str, str]) -> str:
    """GATE_PAYMENT_PROVIDER: `sandbox` by default with GATE_ENV=dev, required otherwise
    (a production gate names the provider that takes its money)."""
    name = env.get("GATE_PAYMENT_PROVIDER", "").strip()
    if not name:
        if env.get("GATE_ENV", "production").strip().lower() == "dev":
            return "sandbox"
        raise SettingsError(
            "GATE_PAYMENT_PROVIDER is required outside GATE_ENV=dev"
            f" (one of {', '.join(PROVIDER_NAMES)})"
        )
    if name not in PROVIDER_NAMES and not SANDBOX_LABEL_RE.fullmatch(name):
        raise SettingsError(
            f"GATE_PAYMENT_PROVIDER must be one of {', '.join(PROVIDER_NAMES)}, got {name[:40]!r}"
        )
    return name


def is_loopback_host(host: str | None) -> bool:
    """Whether `host` is a loopback IP literal (names are not trusted: they resolve).
    Only the real providers' API bases (GATE_STRIPE_API_BASE, GATE_ALIPAY_GATEWAY_URL,
    GATE_WECHATPAY_API_BASE) may be plain http to one outside dev: the tests' local
    fakes of those providers; GATE_PAYMENT_PROVIDER_URL may not."""
    if not host:
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _url(env: Mapping[str, str], name: str) -> str | None:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    parts = urlsplit(raw)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise SettingsError(f"{name} must be an http(s) URL, got {raw!r}")
    return raw.rstrip("/")


def _check_provider_security(env: Mapping[str, str], url: str | None, api_key: str) -> None:
    """Outside GATE_ENV=dev the gate talks to its provider over TLS and with a key of
    its own: https without exception (a loopback address too: what listens there is
    not necessarily the provider), and never the sandbox's published dev key."""
    dev = env.get("GATE_ENV", "production").strip().lower() == "dev"
    refuse_dev_value("GATE_PAYMENT_API_KEY", api_key, frozenset((DEV_SANDBOX_API_KEY,)), dev)
    if url is None or dev:
        return
    if urlsplit(url).scheme != "https":
        raise SettingsError("GATE_PAYMENT_PROVIDER_URL must be https:// outside GATE_ENV=dev")
    if not api_key:
        raise SettingsError(
            "GATE_PAYMENT_API_KEY is required when GATE_PAYMENT_PROVIDER_URL is set"
            " (outside GATE_ENV=dev)"
        )


@dataclass(frozen=True)
class PaymentSettings:
    # The provider the gate calls. Without a URL the gate runs (nobody pays):
    # POST /v1/orders/{id}/payment answers 503 and the workers leave work queued.
    provider: str = "sandbox"
    provider_url: str | None = None
    provider_api_key: Secret | None = None
    # Passed to the provider with each session: where it delivers the callbacks.
    callback_url: str | None = None
    # Where the provider sends the buyer back after paying.
    return_url: str | None = None
    connect_timeout_seconds: float = 1.0
    timeout_seconds: float = 5.0
    retry_max: int = 3
    # A capture starts only while the hold has at least this long to run, so that it
    # finishes (timeouts and retries included) before the hold can expire.
    capture_margin_seconds: float = 30.0
    webhook_body_max_bytes: int = 65_536
    worker_batch_max: int = 100
    worker_interval_seconds: float = 1.0
    # A provider call claimed by a worker is not tried again for this long.
    action_lease_seconds: float = 30.0
    backoff_max_seconds: float = 300.0
    # Events recorded as late or waiting are retried by the recovery loop after this.
    recovery_after_seconds: float = 5.0
    outbox_stream: str = "gate:events"
    outbox_stream_maxlen: int = 1_000_000
    outbox_batch_max: int = 500
    outbox_interval_seconds: float = 0.2
    dedup_cache_max: int = 100_000
    background_tasks_max: int = 256
    run_workers: bool = True

    @property
    def payments_enabled(self) -> bool:
        # The sandbox is called only at GATE_PAYMENT_PROVIDER_URL; a real provider's
        # API always has an address (its adapter's default).
        return self.provider_url is not None or not self.provider.startswith("sandbox")


def load_payment_settings(env: Mapping[str, str]) -> PaymentSettings:
    provider = provider_name(env)
    api_key = env.get("GATE_PAYMENT_API_KEY", "").strip()
    stream = env.get("GATE_OUTBOX_STREAM", "gate:events").strip() or "gate:events"
    if len(stream) > 200:
        raise SettingsError("GATE_OUTBOX_STREAM must be at most 200 characters")
    provider_url = _url(env, "GATE_PAYMENT_PROVIDER_URL")
    _check_provider_security(env, provider_url, api_key)
    settings = PaymentSettings(
        provider=provider,
        provider_url=provider_url,
        provider_api_key=Secret(api_key) if api_key else None,
        callback_url=_url(env, "GATE_PAYMENT_CALLBACK_URL"),
        return_url=_url(env, "GATE_PAYMENT_RETURN_URL"),
        connect_timeout_seconds=env_float(
            env, "GATE_PAYMENT_CONNECT_TIMEOUT_SECONDS", 1.0, 0.05, 30
        ),
        timeout_seconds=env_float(env, "GATE_PAYMENT_TIMEOUT_SECONDS", 5.0, 0.1, 60),
        retry_max=env_int(env, "GATE_PAYMENT_RETRY_MAX", 3, 1, 10),
        capture_margin_seconds=env_float(
            env, "GATE_PAYMENT_CAPTURE_MARGIN_SECONDS", 30.0, 0.0, 3600
        ),
        webhook_body_max_bytes=env_int(env, "GATE_WEBHOOK_BODY_MAX_BYTES", 65_536, 1024, 1_048_576),
        worker_batch_max=env_int(env, "GATE_PAYMENT_WORKER_BATCH_MAX", 100, 1, 10_000),
        worker_interval_seconds=env_float(
            env, "GATE_PAYMENT_WORKER_INTERVAL_SECONDS", 1.0, 0.05, 60
        ),
        action_lease_seconds=env_float(env, "GATE_PAYMENT_ACTION_LEASE_SECONDS", 30.0, 1, 3600),
        backoff_max_seconds=env_float(env, "GATE_PAYMENT_BACKOFF_MAX_SECONDS", 300.0, 1, 86_400),
        recovery_after_seconds=env_float(
            env, "GATE_PAYMENT_RECOVERY_AFTER_SECONDS", 5.0, 0.1, 3600
        ),
        outbox_stream=stream,
        outbox_stream_maxlen=env_int(
            env, "GATE_OUTBOX_STREAM_MAXLEN", 1_000_000, 1000, 1_000_000_000
        ),
        outbox_batch_max=env_int(env, "GATE_OUTBOX_BATCH_MAX", 500, 1, 10_000),
        outbox_interval_seconds=env_float(env, "GATE_OUTBOX_INTERVAL_SECONDS", 0.2, 0.01, 60),
        dedup_cache_max=env_int(env, "GATE_WEBHOOK_DEDUP_CACHE_MAX", 100_000, 0, 10_000_000),
        background_tasks_max=256,
        run_workers=env_bool(env, "GATE_PAYMENT_WORKERS", True),
    )
    # The capture must be over before the hold can end: a capture attempt may take
    # every retry's timeout plus the backoff between them.
    budget = settings.retry_max * (settings.timeout_seconds + 1.0)
    if settings.payments_enabled and settings.capture_margin_seconds < budget:
        raise SettingsError(
            f"GATE_PAYMENT_CAPTURE_MARGIN_SECONDS must be at least {budget:g}: the retries"
            " times (GATE_PAYMENT_TIMEOUT_SECONDS + 1 s of backoff)"
        )
    return settings


@dataclass(frozen=True)
class ReconcileSettings:
    # Pause between passes inside `gate serve`; 0 turns the periodic pass off (the
    # `gate reconcile` command still works).
    interval_seconds: float = 300.0
    # How far back the provider's transactions and the gate's payment events are
    # compared. Older divergences are out of sight: keep it above the longest time a
    # callback, a refund or an operator may take.
    window_seconds: float = 86_400.0
    # Transactions and events younger than this are left to their callbacks, which
    # may still be on their way.
    grace_seconds: float = 120.0
    # A refund the gate asked for and that has not settled after this long is stuck.
    refund_stuck_seconds: float = 900.0
    page_size: int = 500
    # Pages read per pass: the listing of one window must fit, or the pass reports
    # itself incomplete (exit status 2).
    pages_max: int = 200
    # Repairs (events applied, refunds retried, provider look-ups) per pass; what is
    # left over waits for the next pass.
    actions_max: int = 500


def load_reconcile_settings(env: Mapping[str, str]) -> ReconcileSettings:
    interval = env_float(env, "GATE_RECONCILE_INTERVAL_SECONDS", 300.0, 0.0, 86_400)
    if 0 < interval < 0.1:
        raise SettingsError("GATE_RECONCILE_INTERVAL_SECONDS must be 0 (off) or at least 0.1")
    return ReconcileSettings(
        interval_seconds=interval,
        window_seconds=env_float(env, "GATE_RECONCILE_WINDOW_SECONDS", 86_400.0, 60, 90 * 86_400),
        grace_seconds=env_float(env, "GATE_RECONCILE_GRACE_SECONDS", 120.0, 0, 86_400),
        refund_stuck_seconds=env_float(
            env, "GATE_RECONCILE_REFUND_STUCK_SECONDS", 900.0, 0, 30 * 86_400
        ),
        page_size=env_int(env, "GATE_RECONCILE_PAGE_SIZE", 500, 1, 1000),
        pages_max=env_int(env, "GATE_RECONCILE_PAGES_MAX", 200, 1, 100_000),
        actions_max=env_int(env, "GATE_RECONCILE_ACTIONS_MAX", 500, 1, 100_000),
    )
