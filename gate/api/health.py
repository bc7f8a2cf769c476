"""Operations' endpoints: liveness, readiness (with a shared database probe), metrics."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gate.api.common import _gate
from gate.base.errors import Problem
from gate.base.metrics import CONTENT_TYPE, METRICS
from gate.store.db import Database
from gate.web.http_io import (
    json_response,
)

READY_TIMEOUT_SECONDS = 1.0


# /readyz answers from a database probe at most this old: a flood of readiness checks
# costs the database one statement a second per process.
READY_DB_PROBE_SECONDS = 1.0


class Draining:
    """Whether this process has been asked to stop (gate/cli/draining.py): from then
    on /readyz answers 503 so that load balancers stop sending here, while the
    requests that still arrive are served until the shutdown delay ends."""

    def __init__(self) -> None:
        self.since: float | None = None  # time.monotonic() of the stop request

    @property
    def active(self) -> bool:
        return self.since is not None

    def begin(self) -> None:
        if self.since is None:
            self.since = time.monotonic()


# One per process: the signal handler of the process's server sets it.
DRAINING = Draining()


async def healthz(request: Request) -> Response:
    return json_response({"status": "ok"})


class DatabaseProbe:
    """The database part of /readyz: one `SELECT 1`, its verdict ("ok" or why not)
    kept for `ttl_seconds` and shared by every readiness check meanwhile (those that
    arrive while it runs wait for it), so that readiness checks cannot put load on
    the database."""

    def __init__(self, db: Database, ttl_seconds: float = READY_DB_PROBE_SECONDS) -> None:
        self.db = db
        self.ttl_seconds = ttl_seconds
        self._verdict: tuple[float, str] | None = None  # (valid until, verdict)
        self._running: asyncio.Task[str] | None = None

    async def verdict(self) -> str:
        kept = self._verdict
        if kept is not None and kept[0] > time.monotonic():
            return kept[1]
        if self._running is None:
            self._running = asyncio.get_running_loop().create_task(self._probe())
        return await asyncio.shield(self._running)

    async def _probe(self) -> str:
        sent = time.monotonic()
        try:
            await asyncio.wait_for(self.db.fetchone("SELECT 1"), READY_TIMEOUT_SECONDS)
            verdict = "ok"
        except Exception as exc:
            verdict = f"unavailable: {type(exc).__name__}"
        finally:
            self._running = None
        self._verdict = (sent + self.ttl_seconds, verdict)
        return verdict


async def readyz(request: Request) -> Response:
    """Ready when Redis and the database answer; the body also reports degraded
    states (an open circuit, a saturated pool) that do not stop the gate serving.
    Redis is pinged on every call; the database verdict is at most a second old
    (DatabaseProbe). A draining process (shutting down) is not ready, whatever its
    dependencies say."""
    if DRAINING.active:
        return Problem(
            "OVERLOADED",
            "Draining: this gate is shutting down; send requests to another.",
            extra={"draining": True},
        ).response()
    gate = _gate(request)
    checks: dict[str, str] = {}
    try:
        await asyncio.wait_for(gate.redis.ping(), READY_TIMEOUT_SECONDS)
        checks["redis"] = "ok"
    except Exception as exc:
        checks["redis"] = f"unavailable: {type(exc).__name__}"
    probe: DatabaseProbe = request.app.state.db_probe
    checks["database"] = await probe.verdict()
    pool = gate.db.pool_stats()
    details: dict[str, Any] = {
        "redis_circuit": gate.reservations.breakers.state,
        "db_pool": pool,
        # The node this process writes to (gate/store/dbwriter.py), and each node's
        # verdict when GATE_MYSQL_URL names several.
        "db_writer": gate.db.node,
        "db_nodes": gate.db.selector.status()
        if gate.settings.mysql.clustered and gate.db.selector is not None
        else {},
    }
    degraded = gate.reservations.breakers.state != "closed" or (
        pool["reservation_in_use"] >= pool["reservation_max"]
    )
    if all(v == "ok" for v in checks.values()):
        status = "degraded" if degraded else "ready"
        return json_response({"status": status, "checks": checks, **details})
    return Problem(
        "OVERLOADED", "A dependency is unavailable.", extra={"checks": checks, **details}
    ).response()


async def metrics(request: Request) -> Response:
    """/metrics on the public port, with GATE_ENV=dev only (elsewhere the metrics
    listener serves it, gate/web/metrics_listener.py). The loop adds its tallies, a
    thread renders: the loop is not held for the whole render."""
    METRICS.flush()
    body = await asyncio.to_thread(METRICS.render, flush=False)
    return Response(body, media_type=CONTENT_TYPE)
