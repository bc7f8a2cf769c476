"""What the admin API, `gate webhooks` and the console do with endpoints: one set of
checks and answers for all three (gate/webhooks/api.py, cli.py, console_panel.py).

    create  body checked ──> URL checked (form, then every address its host resolves
            to) ──> a new secret, sealed ──> row (the count bounded) ──> view + secret
    update  the same checks for what is given; enabling resets the failure clock
    rotate  a new secret signs from now, the old one beside it for the overlap
    test    a webhook.test event for this endpoint alone, sent by the dispatcher
Bad input raises a Problem (400 INVALID_REQUEST, 400 WEBHOOK_URL_REFUSED, 404
WEBHOOK_ENDPOINT_NOT_FOUND, 409 CONFLICT); nothing is written then.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from gate.base.clock import iso
from gate.base.errors import Problem, invalid
from gate.base.ids import new_id
from gate.base.validate import MAX_ID, digits
from gate.webhooks import events as ev
from gate.webhooks.config import WebhookSettings
from gate.webhooks.model import Endpoint, TooManyEndpoints
from gate.webhooks.ssrf import UrlRefused, check_resolved, check_url
from gate.webhooks.store import WebhookStore
from gate.webhooks.vault import Vault

DESCRIPTION_MAX_CHARS = 500
DELIVERIES_LIMIT_MAX = 100
DELIVERIES_LIMIT_DEFAULT = 20
DELIVERY_STATUSES = ("pending", "delivered", "failed")
ENDPOINT_STATUSES = ("enabled", "disabled")
ENDPOINT_ID_RE = re.compile(r"[0-9A-HJKMNP-TV-Z]{26}")
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")


def endpoint_not_found() -> Problem:
    return Problem("WEBHOOK_ENDPOINT_NOT_FOUND", "No such webhook endpoint.")


def view(endpoint: Endpoint, stats: dict[str, int] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": endpoint.id,
        "url": endpoint.url,
        "events": endpoint.events,
        "description": endpoint.description,
        "status": endpoint.status,
        "disabled_reason": endpoint.disabled_reason,
        "failing_since": iso(endpoint.failing_since),
        "last_success_at": iso(endpoint.last_success_at),
        "created_at": iso(endpoint.created_at),
        "updated_at": iso(endpoint.updated_at),
    }
    if stats is not None:
        out["stats"] = stats
    return out


class WebhookService:
    def __init__(
        self,
        store: WebhookStore,
        vault: Vault,
        settings: WebhookSettings,
        kick: Callable[[], None] = lambda: None,
    ) -> None:
        self.store = store
        self.vault = vault
        self.settings = settings
        self.kick = kick

    # -- input -------------------------------------------------------------------------

    async def _url(self, raw: Any) -> str:
        if not isinstance(raw, str):
            raise invalid("'url' must be a string.")
        try:
            target = check_url(raw, self.settings.allowed, self.settings.dev)
            await check_resolved(target, self.settings.allowed, self.settings.dev)
        except UrlRefused as exc:
            raise Problem("WEBHOOK_URL_REFUSED", f"The URL is refused: {exc}.") from None
        return raw

    @staticmethod
    def _events(raw: Any) -> list[str]:
        if not isinstance(raw, list) or not raw:
            raise invalid("'events' must be a non-empty list of event types, or [\"*\"].")
        if len(raw) > ev.EVENTS_MAX:
            raise invalid(f"'events' lists at most {ev.EVENTS_MAX} entries.")
        if not all(isinstance(e, str) for e in raw):
            raise invalid("'events' must list strings.")
        if len(set(raw)) != len(raw):
            raise invalid("'events' lists an event type twice.")
        if ev.ALL in raw and len(raw) > 1:
            raise invalid("'events': \"*\" (every event) stands alone.")
        unknown = [e for e in raw if e != ev.ALL and e not in ev.TYPES]
        if unknown:
            raise invalid(
                f"'events': unknown event type {unknown[0][:64]!r}; one of"
                f' {", ".join(ev.TYPES)}, or "*".'
            )
        return list(raw)

    @staticmethod
    def _description(raw: Any) -> str:
        if not isinstance(raw, str):
            raise invalid("'description' must be a string.")
        if len(raw) > DESCRIPTION_MAX_CHARS:
            raise invalid(f"'description' must be at most {DESCRIPTION_MAX_CHARS} characters.")
        if _CONTROL_RE.search(raw):
            raise invalid("'description' must not contain control characters.")
        return raw.strip()

    def _sealing(self) -> None:
        if not self.vault.ready:
            raise Problem(
                "CONFLICT",
                "Webhooks need GATE_WEBHOOK_ENCRYPTION_KEY (the key their signing secrets are"
                " kept sealed with); set it and restart the gate.",
            )

    # -- endpoints ---------------------------------------------------------------------

    async def create(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise invalid("The body must be a JSON object.")
        unknown = sorted(set(body) - {"url", "events", "description"})
        if unknown:
            raise invalid(f"Unknown field(s): {', '.join(unknown)}.")
        if "url" not in body or "events" not in body:
            raise invalid("'url' and 'events' are required.")
        events = self._events(body["events"])
        description = self._description(body.get("description", ""))
        self._sealing()
        url = await self._url(body["url"])
        endpoint_id = new_id()
        secret = self.vault.new_secret()
        try:
            endpoint = await self.store.create_endpoint(
                endpoint_id,
                url,
                events,
                description,
                self.vault.seal(endpoint_id, secret),
                self.settings.endpoints_max,
            )
        except TooManyEndpoints:
            raise Problem(
                "CONFLICT",
                f"The gate has {self.settings.endpoints_max} webhook endpoints already"
                " (GATE_WEBHOOK_MAX_ENDPOINTS); delete one first.",
            ) from None
        return {**view(endpoint), "secret": secret}

    async def get(self, endpoint_id: str) -> Endpoint:
        endpoint = await self.store.endpoint(endpoint_id) if _id_ok(endpoint_id) else None
        if endpoint is None:
            raise endpoint_not_found()
        return endpoint

    async def show(self, endpoint_id: str) -> dict[str, Any]:
        endpoint = await self.get(endpoint_id)
        stats = await self.store.stats([endpoint.id])
        return view(endpoint, stats[endpoint.id])

    async def list(self) -> list[dict[str, Any]]:
        endpoints = await self.store.endpoints()
        stats = await self.store.stats([e.id for e in endpoints])
        return [view(e, stats[e.id]) for e in endpoints]

    async def update(self, endpoint_id: str, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise invalid("The body must be a JSON object.")
        unknown = sorted(set(body) - {"url", "events", "description", "status"})
        if unknown:
            raise invalid(f"Unknown field(s): {', '.join(unknown)}.")
        if not body:
            raise invalid("Give at least one of 'url', 'events', 'description', 'status'.")
        await self.get(endpoint_id)  # 404 before anything else is judged
        changes: dict[str, Any] = {}
        if "events" in body:
            changes["events"] = self._events(body["events"])
        if "description" in body:
            changes["description"] = self._description(body["description"])
        if "status" in body:
            if body["status"] not in ENDPOINT_STATUSES:
                raise invalid("'status' must be 'enabled' or 'disabled'.")
            changes["status"] = body["status"]
        if "url" in body:
            changes["url"] = await self._url(body["url"])
        endpoint = await self.store.update_endpoint(endpoint_id, changes)
        if endpoint is None:
            raise endpoint_not_found()
        if changes.get("status") == "enabled":
            self.kick()
        return view(endpoint)

    async def delete(self, endpoint_id: str) -> None:
        if not (_id_ok(endpoint_id) and await self.store.delete_endpoint(endpoint_id)):
            raise endpoint_not_found()

    async def rotate(self, endpoint_id: str) -> dict[str, Any]:
        await self.get(endpoint_id)
        self._sealing()
        secret = self.vault.new_secret()
        sealed = self.vault.seal(endpoint_id, secret)
        if not await self.store.rotate(endpoint_id, sealed, self.settings.rotation_overlap_seconds):
            raise endpoint_not_found()
        return {"secret": secret}

    async def send_test(self, endpoint_id: str) -> dict[str, Any]:
        endpoint = await self.get(endpoint_id)
        event_id = "test_" + new_id()
        body = ev.body(ev.TEST_TYPE, iso_now(), ev.test_data(endpoint.id))
        delivery_id = await self.store.add_test_event(endpoint.id, event_id, body)
        self.kick()
        return {"event_id": event_id, "delivery_id": delivery_id, "status": "pending"}

    # -- deliveries --------------------------------------------------------------------

    async def deliveries(self, endpoint_id: str, query: dict[str, str]) -> dict[str, Any]:
        unknown = sorted(set(query) - {"status", "limit", "after"})
        if unknown:
            raise invalid(f"Unknown query parameter(s): {', '.join(u[:40] for u in unknown)}.")
        status = query.get("status")
        if status is not None and status not in DELIVERY_STATUSES:
            raise invalid("'status' must be one of pending, delivered, failed.")
        limit = _bounded(query.get("limit"), "limit", 1, DELIVERIES_LIMIT_MAX)
        after = _bounded(query.get("after"), "after", 1, MAX_ID)
        endpoint = await self.get(endpoint_id)
        found = await self.store.deliveries(
            endpoint.id, status, limit or DELIVERIES_LIMIT_DEFAULT, after
        )
        more = len(found) == (limit or DELIVERIES_LIMIT_DEFAULT)
        return {"deliveries": found, "next_after": found[-1]["id"] if found and more else None}

    async def retry(self, endpoint_id: str, delivery_id: int) -> dict[str, Any]:
        endpoint = await self.get(endpoint_id)
        if not 1 <= delivery_id <= MAX_ID or not await self.store.retry(endpoint.id, delivery_id):
            raise Problem("NOT_FOUND", "No such delivery of this webhook endpoint.")
        self.kick()
        return {"id": delivery_id, "status": "pending"}


def _id_ok(endpoint_id: str) -> bool:
    return isinstance(endpoint_id, str) and bool(ENDPOINT_ID_RE.fullmatch(endpoint_id))


def _bounded(raw: str | None, name: str, lo: int, hi: int) -> int | None:
    if raw is None:
        return None
    value = digits(raw, hi)
    if value is None or value < lo:
        raise invalid(f"'{name}' must be an integer between {lo} and {hi}.")
    return value


def iso_now() -> str:
    from datetime import UTC, datetime

    return iso(datetime.now(UTC).replace(tzinfo=None)) or ""
