"""The sandbox provider's HTTP API as seen by the gate (gate.payments.sandbox serves it).

Bounded everywhere: a connect timeout and a total timeout per attempt, at most
`retry_max` attempts with jittered backoff, and only for answers that may be
transient (no answer, 429, 5xx). Every changing call sends `Idempotency-Key`, so a
retry of a call that did happen returns the original result.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Sequence
from typing import Any

import aiohttp
import orjson

from gate.base import tracing
from gate.payments.config import PaymentSettings
from gate.payments.provider import (
    PROVIDER_ID_RE,
    Payment,
    ProviderRejected,
    ProviderUnavailable,
    Refund,
    Session,
    SessionRequest,
    Transaction,
    TransactionPage,
    answer_id,
    order_id_or_none,
)

log = logging.getLogger("gate.payments.provider")

CONNECTIONS_MAX = 64
RESPONSE_MAX_BYTES = 1_048_576


def _payment(doc: dict[str, Any]) -> Payment:
    return Payment(
        payment_id=answer_id(doc.get("id"), PROVIDER_ID_RE, "payment id"),
        order_id=order_id_or_none(doc.get("order_id")),
        amount=int(doc["amount"]),
        currency=str(doc["currency"]),
        status=str(doc["status"]),
        refunded_amount=int(doc.get("refunded_amount", 0)),
    )


def _refund(doc: dict[str, Any]) -> Refund:
    return Refund(
        refund_id=answer_id(doc.get("id"), PROVIDER_ID_RE, "refund id"),
        payment_id=answer_id(doc.get("payment_id"), PROVIDER_ID_RE, "payment id"),
        order_id=order_id_or_none(doc.get("order_id")),
        amount=int(doc["amount"]),
        currency=str(doc["currency"]),
        status=str(doc["status"]),
    )


def _session(doc: dict[str, Any]) -> Session:
    return Session(
        session_id=answer_id(doc.get("id"), PROVIDER_ID_RE, "session id"),
        order_id=str(doc["order_id"]),
        redirect_url=str(doc["url"]),
        expires_at=int(doc["expires_at"]) if doc.get("expires_at") is not None else None,
        status=str(doc.get("status", "open")),
    )


class SandboxProvider:
    def __init__(self, settings: PaymentSettings, webhook_keys: Sequence[bytes]) -> None:
        assert settings.provider_url is not None
        self.name = settings.provider
        self.base_url = settings.provider_url
        self.settings = settings
        self.webhook_keys = tuple(webhook_keys)
        self._session: aiohttp.ClientSession | None = None
        self._headers = {"Content-Type": "application/json"}
        if settings.provider_api_key is not None:
            self._headers["Authorization"] = f"Bearer {settings.provider_api_key.reveal()}"

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

    async def _call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        key: str | None = None,
        *,
        attempts: int | None = None,
    ) -> tuple[int, dict[str, Any]]:
        headers = dict(self._headers)
        if key is not None:
            headers["Idempotency-Key"] = key
        data = orjson.dumps(body) if body is not None else None
        tries = attempts or self.settings.retry_max
        last: str = ""
        for i in range(tries):
            if i:
                await asyncio.sleep(min(1.0, 0.1 * 2**i) * random.uniform(0.5, 1.0))
            try:
                async with self._client().request(
                    method, self.base_url + path, data=data, headers=headers
                ) as resp:
                    raw = await resp.content.read(RESPONSE_MAX_BYTES + 1)
                    status = resp.status
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                last = f"{type(exc).__name__}: {exc}"
                continue
            if status == 429 or status >= 500:
                last = f"HTTP {status}"
                continue
            if len(raw) > RESPONSE_MAX_BYTES:
                raise ProviderUnavailable("provider answer too large")
            try:
                doc = orjson.loads(raw) if raw else {}
            except orjson.JSONDecodeError:
                raise ProviderUnavailable(f"provider answered {status} with non-JSON") from None
            if not isinstance(doc, dict):
                raise ProviderUnavailable("provider answer is not an object")
            if status >= 400 and status != 404:
                raise ProviderRejected(
                    status, str(doc.get("code", "error")), str(doc.get("detail", "")), doc
                )
            return status, doc
        raise ProviderUnavailable(f"{method} {path}: no answer after {tries} attempt(s): {last}")

    async def create_session(self, request: SessionRequest, key: str) -> Session:
        body = {
            "order_id": request.order_id,
            "amount": request.amount,
            "currency": request.currency,
            "capture_method": request.capture_mode,
            "expires_at": request.expires_at,
            "description": request.description,
            "notify_url": request.notify_url,
            "return_url": request.return_url,
        }
        try:
            status, doc = await self._call("POST", "/v1/sessions", body, key)
        except ProviderUnavailable:
            # The creation may have happened: ask for it by order before giving up.
            found = await self.find_session(request.order_id)
            if found is not None:
                return found
            raise
        if status == 404:
            raise ProviderRejected(404, "not_found", "sessions endpoint not found")
        return _session(doc)

    async def find_session(self, order_id: str) -> Session | None:
        status, doc = await self._call("GET", f"/v1/sessions?order_id={order_id}")
        items = doc.get("data") or []
        return _session(items[0]) if status == 200 and items else None

    async def payments_for_order(self, order_id: str) -> list[Payment]:
        status, doc = await self._call("GET", f"/v1/payments?order_id={order_id}")
        return [_payment(p) for p in doc.get("data") or []] if status == 200 else []

    async def get_payment(self, payment_id: str) -> Payment | None:
        status, doc = await self._call("GET", f"/v1/payments/{payment_id}")
        return _payment(doc) if status == 200 else None

    async def capture(self, payment_id: str, amount: int, key: str) -> Payment:
        status, doc = await self._call(
            "POST", f"/v1/payments/{payment_id}/capture", {"amount": amount}, key
        )
        if status == 404:
            raise ProviderRejected(404, "not_found", f"payment {payment_id} not found")
        return _payment(doc)

    async def void(self, payment_id: str, key: str) -> Payment:
        status, doc = await self._call("POST", f"/v1/payments/{payment_id}/void", {}, key)
        if status == 404:
            raise ProviderRejected(404, "not_found", f"payment {payment_id} not found")
        return _payment(doc)

    async def refund(self, payment_id: str, amount: int, key: str) -> Refund:
        status, doc = await self._call(
            "POST", "/v1/refunds", {"payment_id": payment_id, "amount": amount}, key
        )
        if status == 404:
            raise ProviderRejected(404, "not_found", f"payment {payment_id} not found")
        return _refund(doc)

    async def transactions(
        self, cursor: str | None, limit: int, since: int | None = None
    ) -> TransactionPage:
        query = f"?limit={int(limit)}" + (f"&after={cursor}" if cursor else "")
        if since is not None:
            query += f"&created_gte={int(since)}"
        _, doc = await self._call("GET", "/v1/transactions" + query)
        items = [
            Transaction(
                kind=str(t["kind"]),
                id=answer_id(t.get("id"), PROVIDER_ID_RE, "transaction id"),
                payment_id=answer_id(t.get("payment_id"), PROVIDER_ID_RE, "payment id"),
                order_id=order_id_or_none(t.get("order_id")),
                amount=int(t["amount"]),
                currency=str(t["currency"]),
                status=str(t["status"]),
                created=int(t["created"]),
            )
            for t in doc.get("data") or []
        ]
        return TransactionPage(items=items, next_cursor=doc.get("next"))
