"""What the Alipay and WeChat Pay test fakes share: notification delivery with the
providers' retry behaviour (scaled down), a drop switch, and a uvicorn runner.

    fake ──notify(url, build)──> Deliveries ──POST (fresh headers per attempt)──> gate
        acknowledged? (Alipay: body == "success"; WeChat: 200/204) ── no ──> retry
        after schedule[i] seconds, at most len(schedule) + 1 attempts
        `drop` > 0: the next notifications are recorded but never sent (a lost
        notification, for reconciliation tests); `drop_refunds`: the same for the
        next refund notifications only

The fakes live with the tests and are never part of the production image.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

DELIVERIES_MAX = 10_000


@dataclass
class Delivery:
    id: str
    url: str
    kind: str
    subject: str
    # Called per attempt: (body, headers). Alipay's notify_time and WeChat's
    # Wechatpay-Timestamp are per attempt.
    build: Callable[[], tuple[bytes, dict[str, str]]]
    attempts: int = 0
    acknowledged: bool = False
    dropped: bool = False
    answers: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "url": self.url,
            "kind": self.kind,
            "subject": self.subject,
            "attempts": self.attempts,
            "acknowledged": self.acknowledged,
            "dropped": self.dropped,
            "answers": self.answers[-5:],
        }


class Deliveries:
    def __init__(
        self,
        schedule_seconds: list[float],
        acknowledged: Callable[[int, bytes], bool],
    ) -> None:
        self.schedule_seconds = schedule_seconds
        self.acknowledged = acknowledged
        self.items: dict[str, Delivery] = {}
        self.drop = 0
        # Refund notifications only (kind "refund" / "REFUND.*"): a lost refund
        # notification without racing the payment's.
        self.drop_refunds = 0
        self._ids = itertools.count(1)
        self._tasks: set[asyncio.Task[None]] = set()
        self._http: aiohttp.ClientSession | None = None

    def configure(self, doc: dict[str, Any]) -> None:
        """The drop switches of a /_fake/configure body (absent: unchanged)."""
        self.drop = int(doc.get("drop_notifications", self.drop))
        self.drop_refunds = int(doc.get("drop_refund_notifications", self.drop_refunds))

    def new_id(self, prefix: str) -> str:
        return f"{prefix}{next(self._ids):012d}"

    def notify(self, delivery: Delivery) -> None:
        if len(self.items) >= DELIVERIES_MAX:
            self.items.pop(next(iter(self.items)))
        self.items[delivery.id] = delivery
        if self.drop > 0:
            self.drop -= 1
            delivery.dropped = True
            return
        if self.drop_refunds > 0 and delivery.kind.lower().startswith("refund"):
            self.drop_refunds -= 1
            delivery.dropped = True
            return
        self._start(delivery, retries=True)

    def redeliver(self, delivery_id: str) -> bool:
        delivery = self.items.get(delivery_id)
        if delivery is None:
            return False
        self._start(delivery, retries=False)
        return True

    def _start(self, delivery: Delivery, retries: bool) -> None:
        task = asyncio.get_running_loop().create_task(self._deliver(delivery, retries))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _deliver(self, delivery: Delivery, retries: bool) -> None:
        if self._http is None:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
        waits = [0.0, *self.schedule_seconds] if retries else [0.0]
        for wait in waits:
            if wait:
                await asyncio.sleep(wait)
            body, headers = delivery.build()
            delivery.attempts += 1
            try:
                async with self._http.post(delivery.url, data=body, headers=headers) as resp:
                    answer = await resp.content.read(4096)
                    status = resp.status
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                delivery.answers.append(type(exc).__name__)
                continue
            delivery.answers.append(f"{status} {answer[:200]!r}")
            if self.acknowledged(status, answer):
                delivery.acknowledged = True
                return

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._http is not None:
            await self._http.close()


def control_app(routes: list[Route], notes: Deliveries) -> Starlette:
    """A fake's app: its own routes, then what both fakes answer alike: the
    notifications (GET /_fake/notifications?out_trade_no=…, POST
    /_fake/notifications/{id}/redeliver) and /healthz; deliveries stop with the app."""

    async def notifications(request: Request) -> Response:
        subject = request.query_params.get("out_trade_no")
        return JSONResponse(
            [d.as_dict() for d in notes.items.values() if subject in (None, d.subject)]
        )

    async def redeliver(request: Request) -> Response:
        ok = notes.redeliver(request.path_params["id"])
        return JSONResponse({"redelivered": ok}, 200 if ok else 404)

    async def healthz(request: Request) -> Response:
        return JSONResponse({"ok": True})

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await notes.close()

    return Starlette(
        routes=[
            *routes,
            Route("/_fake/notifications", notifications),
            Route("/_fake/notifications/{id}/redeliver", redeliver, methods=["POST"]),
            Route("/healthz", healthz),
        ],
        lifespan=lifespan,
    )


def serve(app: Starlette, description: str) -> None:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", lifespan="on")
