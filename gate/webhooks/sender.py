"""One delivery attempt over HTTP: the only place a webhook leaves the gate.

    Sender.deliver(url, webhook-id, body, keys)
      ├─ check_url (gate/webhooks/ssrf.py): the URL's form under today's settings
      ├─ headers: Content-Type, webhook-id, webhook-timestamp (now), webhook-signature
      │  (one v1 entry per key, the newest first), User-Agent
      ├─ POST through the shared session: its connector resolves through
      │  CheckingResolver (each address checked, only checked ones connected to),
      │  never follows a redirect, trusts no proxy variable
      ├─ the answer read up to ANSWER_MAX_BYTES (then the connection is dropped)
      └─ Outcome: status or error, duration, Retry-After; never raises

A tracing client span, and the `traceparent` header it propagates, belong in
`deliver` around the POST: every attempt passes there.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

import aiohttp

from gate import __version__
from gate.base import tracing
from gate.base.backoff import parse_retry_after
from gate.base.standard_webhooks import sign_headers
from gate.base.timeouts import deadline_in
from gate.webhooks.config import WebhookSettings
from gate.webhooks.ssrf import CheckingResolver, UrlRefused, check_url

ANSWER_MAX_BYTES = 65_536
EXCERPT_MAX_CHARS = 120
USER_AGENT = f"Gate-Webhooks/{__version__}"
_UNPRINTABLE = re.compile(r"[^\x20-\x7e]+")


@dataclass(frozen=True)
class Outcome:
    started_at: datetime
    duration_ms: int
    http_status: int | None
    error: str | None
    retry_after_seconds: float | None = None
    # What the gate made of it, for the metric: delivered, http_error, gone, redirect,
    # timeout, refused, connect_error, error.
    kind: str = "delivered"

    @property
    def delivered(self) -> bool:
        return self.kind == "delivered"


class Sender:
    def __init__(self, settings: WebhookSettings) -> None:
        self.settings = settings
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(
                resolver=CheckingResolver(self.settings.allowed, self.settings.dev),
                # Concurrency is bounded by the dispatcher (per endpoint and in total);
                # the pool holds at most that many connections.
                limit=self.settings.concurrency,
                limit_per_host=0,
                ttl_dns_cache=10,
                enable_cleanup_closed=True,
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=aiohttp.ClientTimeout(total=self.settings.timeout_seconds),
                trust_env=False,
                auto_decompress=False,
                headers={"User-Agent": USER_AGENT},
                # The answer is barely read: no compressed one is asked for.
                skip_auto_headers=("Accept-Encoding",),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def deliver(self, url: str, msg_id: str, body: bytes, keys: Sequence[bytes]) -> Outcome:
        started = datetime.now(UTC).replace(tzinfo=None)
        clock = time.monotonic()

        def outcome(
            kind: str, status: int | None, error: str | None, retry_after: float | None = None
        ) -> Outcome:
            ms = int((time.monotonic() - clock) * 1000)
            return Outcome(started, ms, status, error, retry_after, kind)

        try:
            check_url(url, self.settings.allowed, self.settings.dev)
        except UrlRefused as exc:
            return outcome("refused", None, f"refused: {exc}")
        headers = {
            "Content-Type": "application/json",
            **sign_headers(keys, msg_id, int(time.time()), body),
        }
        try:
            # A delivery is a trace of its own (the loop serves no request); the
            # receiver gets its `traceparent` when it is traced.
            with tracing.outbound("POST", url, headers, root=True) as live:
                async with deadline_in(self.settings.timeout_seconds):
                    async with self._client().post(
                        url, data=body, headers=headers, allow_redirects=False
                    ) as resp:
                        status = resp.status
                        answer = await _read_bounded(resp)
                        retry_after = parse_retry_after(
                            resp.headers.get("Retry-After"), time.time()
                        )
                if live is not None:
                    tracing.note_status(live, status)
        except UrlRefused as exc:
            return outcome("refused", None, f"refused: {exc}")
        except TimeoutError:
            return outcome("timeout", None, f"timeout after {self.settings.timeout_seconds:g} s")
        except aiohttp.ClientConnectorCertificateError as exc:
            return outcome("connect_error", None, f"TLS certificate: {exc.certificate_error}")
        except aiohttp.ClientConnectorError as exc:
            return outcome("connect_error", None, f"connect: {exc.strerror or exc.os_error}")
        except (aiohttp.ClientError, OSError) as exc:
            return outcome("error", None, f"{type(exc).__name__}: {exc}")
        if 200 <= status <= 299:
            return outcome("delivered", status, None)
        excerpt = _UNPRINTABLE.sub(" ", answer[:EXCERPT_MAX_CHARS].decode("utf-8", "replace"))
        detail = f"HTTP {status}" + (f": {excerpt.strip()}" if excerpt.strip() else "")
        if status == 410:
            return outcome("gone", status, detail)
        if 300 <= status <= 399:
            return outcome("redirect", status, f"HTTP {status}: redirects are not followed")
        return outcome("http_error", status, detail, retry_after)


async def _read_bounded(resp: aiohttp.ClientResponse) -> bytes:
    """At most ANSWER_MAX_BYTES of the answer; a longer one is cut and its connection
    closed rather than read on."""
    chunks: list[bytes] = []
    left = ANSWER_MAX_BYTES
    while left > 0:
        chunk = await resp.content.read(left)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        left -= len(chunk)
    if not resp.content.at_eof():
        resp.close()
    return b"".join(chunks)
