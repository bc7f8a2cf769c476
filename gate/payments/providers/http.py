"""The sandbox provider's HTTP API as seen by the gate (gate.payments.sandbox serves it).

The exchange is gate/payments/providers/provider_http.py's (`ProviderHttp`: timeouts,
bounded attempts with backoff and Retry-After, only for answers that may be
transient: no answer, 429, 5xx). Every changing call sends `Idempotency-Key`, so a
retry of a call that did happen returns the original result.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import orjson

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
from gate.payments.providers.provider_http import ProviderHttp

log = logging.getLogger("gate.payments.provider")


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
        self.http = ProviderHttp(settings, "provider")
        self._headers = {"Content-Type": "application/json"}
        if settings.provider_api_key is not None:
            self._headers["Authorization"] = f"Bearer {settings.provider_api_key.reveal()}"

    async def close(self) -> None:
        await self.http.close()

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
        answer = await self.http.request(
            method, self.base_url + path, data, headers, attempts=attempts, what=f"{method} {path}"
        )
        doc = self.http.json_object(answer, f"{method} {path}")
        if answer.status >= 400 and answer.status != 404:
            raise ProviderRejected(
                answer.status, str(doc.get("code", "error")), str(doc.get("detail", "")), doc
            )
        return answer.status, doc

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
