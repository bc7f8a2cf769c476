"""The webhooks' panel of the live console (docs/console.md, "Webhooks").

console snapshot (at most once a second per process)
    --> WebhooksPanel.gate_fields(), kept FIELDS_KEEP_SECONDS (the counts read
        deliveries' indexes; a second's freshness is not worth that every second)
          endpoints  each endpoint: status (and why disabled), success rate of the
                     last 24 hours, deliveries pending and failed, failing since
          failed     the latest failed deliveries of each endpoint (FAILED_SHOWN each)
    --> snapshot["panels"]["webhooks"]

POST /console/api/panels/webhooks/retry {"endpoint_id", "delivery_id"}
    --> the delivery sent again now (as `gate webhooks retry` and the admin API's
        retry), logged with the operator's session
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from gate.base.errors import invalid
from gate.base.validate import MAX_ID
from gate.extensions import ConsoleGateAction
from gate.webhooks.service import WebhookService

log = logging.getLogger("gate.webhooks")

FIELDS_KEEP_SECONDS = 5.0
FAILED_SHOWN = 5


class WebhooksPanel:
    def __init__(self, service: WebhookService) -> None:
        self.service = service
        self._kept: tuple[float, dict[str, Any]] | None = None

    @property
    def name(self) -> str:
        return "webhooks"

    @property
    def actions(self) -> Mapping[str, ConsoleGateAction]:
        return {"retry": self.retry}

    async def gate_fields(self) -> dict[str, Any]:
        now = time.monotonic()
        if self._kept is not None and now - self._kept[0] < FIELDS_KEEP_SECONDS:
            return self._kept[1]
        store = self.service.store
        endpoints = await store.endpoints()
        stats = await store.stats([e.id for e in endpoints])
        rows = []
        for e in endpoints:
            s = stats[e.id]
            attempts = s["attempts_24h"]
            rows.append(
                {
                    "id": e.id,
                    "url": e.url,
                    "description": e.description,
                    "status": e.status,
                    "disabled_reason": e.disabled_reason,
                    "success_rate_24h": round(s["delivered_24h"] / attempts, 4)
                    if attempts
                    else None,
                    "attempts_24h": attempts,
                    "pending": s["pending"],
                    "failed": s["failed"],
                    "failing_since": None
                    if e.failing_since is None
                    else e.failing_since.isoformat() + "Z",
                }
            )
        failed = await store.failed([e.id for e in endpoints], FAILED_SHOWN)
        fields = {"endpoints": rows, "failed": failed}
        self._kept = (now, fields)
        return fields

    async def retry(self, body: Any, actor: str) -> dict[str, Any]:
        """Send one failed delivery again (the body: {"endpoint_id", "delivery_id"})."""
        if not isinstance(body, dict) or set(body) != {"endpoint_id", "delivery_id"}:
            raise invalid('The body must be {"endpoint_id": "...", "delivery_id": N}.')
        delivery_id = body["delivery_id"]
        if isinstance(delivery_id, bool) or not isinstance(delivery_id, int):
            raise invalid("'delivery_id' must be an integer.")
        if not 1 <= delivery_id <= MAX_ID:
            raise invalid(f"'delivery_id' must be between 1 and {MAX_ID}.")
        endpoint_id = body["endpoint_id"]
        if not isinstance(endpoint_id, str):
            raise invalid("'endpoint_id' must be a string.")
        answer = await self.service.retry(endpoint_id, delivery_id)
        self._kept = None
        log.info(
            "webhooks: delivery %s of endpoint %s retried from the console",
            delivery_id,
            endpoint_id[:26],
            extra={"actor": actor},
        )
        return answer
