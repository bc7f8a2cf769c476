"""One bounded HTTP exchange with a payment provider, held by every adapter.

    adapter builds the request ──> ProviderHttp.request(method, url, body, headers)
        attempt 1..retry_max, each with a connect and a total timeout
          no answer, 5xx, a transient status (429; Stripe's 409), or what the
          adapter calls transient (Alipay's code 20000 with HTTP 200)
            ──> wait (gate/base/backoff.py: 0.2 s · 2^(n-1), at most 1 s, jittered;
                a 429's or 503's Retry-After instead, up to RETRY_AFTER_MAX_SECONDS;
                asked to wait longer: no further attempt now) ──> next attempt
        ──> Answer(status, headers, raw) ──> the adapter verifies and reads it
            (json_object: an unreadable body is ProviderUnavailable)
        no answer after the last attempt ──> ProviderUnavailable naming the last failure

The caller makes every retried request carry the same idempotency key (or be a
read), so a retry of a call that did happen returns the original result. One
aiohttp session per adapter, opened on first use and closed by `close`; with traces
on, each attempt is a client span and sends `traceparent` (gate/base/tracing.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from gate.base import tracing
from gate.base.backoff import Backoff, parse_retry_after
from gate.payments.config import PaymentSettings
from gate.payments.provider import ProviderUnavailable

CONNECTIONS_MAX = 64
RESPONSE_MAX_BYTES = 1_048_576
# The capture margin (gate/payments/config.py) counts one second of backoff per
# attempt: a provider's Retry-After is honoured up to that, and a longer one ends
# the attempts (the caller's own retry comes later).
RETRY_AFTER_MAX_SECONDS = 1.0
BACKOFF = Backoff(
    base_seconds=0.2,
    cap_seconds=1.0,
    jitter=0.5,
    retry_after_max_seconds=RETRY_AFTER_MAX_SECONDS,
)
RETRY_AFTER_STATUSES = frozenset({429, 503})

Headers = Mapping[str, str] | Callable[[], Mapping[str, str]]


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    headers: dict[str, str]  # names in lower case
    raw: bytes


class ProviderHttp:
    """The session and the bounds of one adapter's calls (see the module's docstring).
    `transient_statuses`: the 4xx answers retried as well as no answer and 5xx."""

    def __init__(
        self,
        settings: PaymentSettings,
        who: str,
        transient_statuses: frozenset[int] = frozenset({429}),
    ) -> None:
        self.settings = settings
        self.who = who  # names the provider in errors: "stripe", "alipay", …
        self.transient_statuses = transient_statuses
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=CONNECTIONS_MAX),
                timeout=aiohttp.ClientTimeout(
                    total=self.settings.timeout_seconds,
                    sock_connect=self.settings.connect_timeout_seconds,
                ),
                # Traced: each call a client span, traceparent sent (gate/base/tracing.py).
                trace_configs=tracing.client_trace_configs(),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(
        self,
        method: str,
        url: str,
        body: bytes | str | None,
        headers: Headers,
        *,
        transient: Callable[[int, bytes], bool] | None = None,
        attempts: int | None = None,
        what: str | None = None,
    ) -> Answer:
        """The first answer that is not transient. `headers` may be a function, called
        per attempt (WeChat's signature carries a fresh timestamp and nonce);
        `transient(status, raw)` marks more answers as worth another attempt; `what`
        names the call in errors (default: method and URL)."""
        tries = attempts or self.settings.retry_max
        last = ""
        made = 0
        retry_after: float | None = None
        for attempt in range(tries):
            if attempt:
                await asyncio.sleep(BACKOFF.delay_seconds(attempt, retry_after))
            retry_after = None
            made += 1
            sent = dict(headers() if callable(headers) else headers)
            try:
                async with self._client().request(method, url, data=body, headers=sent) as resp:
                    raw = await resp.content.read(RESPONSE_MAX_BYTES + 1)
                    status = resp.status
                    got = {k.lower(): v for k, v in resp.headers.items()}
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                last = f"{type(exc).__name__}: {exc}"
                continue
            if (
                status >= 500
                or status in self.transient_statuses
                or (transient is not None and transient(status, raw))
            ):
                last = f"HTTP {status}"
                if status in RETRY_AFTER_STATUSES:
                    retry_after = parse_retry_after(got.get("retry-after"), time.time())
                    if retry_after is not None and retry_after > RETRY_AFTER_MAX_SECONDS:
                        last += f", asked to retry after {retry_after:g} s"
                        break
                continue
            if len(raw) > RESPONSE_MAX_BYTES:
                raise ProviderUnavailable(f"{self.who} answer too large")
            return Answer(status, got, raw)
        call = what or f"{method} {url}"
        raise ProviderUnavailable(f"{self.who} {call}: no answer after {made} attempt(s): {last}")

    def json_object(self, answer: Answer, what: str = "") -> dict[str, Any]:
        """The answer's JSON object ({} for an empty body); ProviderUnavailable for
        anything else."""
        if not answer.raw:
            return {}
        label = f"{self.who} {what}".rstrip()
        try:
            doc = orjson.loads(answer.raw)
        except orjson.JSONDecodeError:
            raise ProviderUnavailable(f"{label}: {answer.status} with a non-JSON answer") from None
        if not isinstance(doc, dict):
            raise ProviderUnavailable(f"{label}: the answer is not an object")
        return doc
