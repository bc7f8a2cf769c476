"""Operations: the request middleware installed outermost (request ids, one log
line and metrics per request: gate/web/recorder.py), the access log
(GATE_ACCESS_LOG, gate/base/access_log.py), traces (OTEL_*, gate/base/tracing.py),
pool sampling, /openapi.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gate import __version__
from gate.base import logs, tracing
from gate.base.access_log import AccessLog
from gate.base.metrics import (
    METRICS,
    TALLY_FLUSH_SECONDS,
    forget_dead_processes,
    process_stopping,
)
from gate.base.redis_url import parse_redis_url
from gate.base.settings import SECRET_NAMES, SettingsError, env_bool, env_float
from gate.extensions import Extension
from gate.web import docs_page, openapi
from gate.web.recorder import REQUEST_LOG_MODES, RequestObserver, RequestRecorder

if TYPE_CHECKING:
    from gate.base.settings import Settings
    from gate.runtime import Gate

ops_log = logging.getLogger("gate.ops")


class PoolSampler:
    """Copies the database pool's occupancy into gauges, in every process.

    prometheus-client cannot call a function at scrape time in multi-process mode (the
    scrape may be answered by another worker), so each process samples its own pool
    on a short interval.
    """

    def __init__(self, gate: Gate, interval_seconds: float) -> None:
        self.gate = gate
        self.interval_seconds = interval_seconds

    def run_once(self) -> None:
        pool = self.gate.db.pool
        if pool is None:
            return
        METRICS.db_pool_in_use.set(pool.size - pool.freesize)
        # aiomysql keeps the waiters of `acquire()` on its condition; there is no
        # public count. Read defensively so an aiomysql upgrade cannot break serving.
        cond = getattr(pool, "_cond", None)
        waiters = getattr(cond, "_waiters", None)
        if waiters is not None:
            METRICS.db_pool_waiting.set(len(waiters))

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                self.run_once()
            except Exception:
                ops_log.exception("sampling the database pool failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval_seconds)


async def flush_tallies(stop: asyncio.Event, interval_seconds: float = TALLY_FLUSH_SECONDS) -> None:
    """Adds this process's metric tallies (gate/base/metrics.py) to the metrics every
    interval, so that under several workers a scrape, which reads the shared files,
    is at most that late."""
    while not stop.is_set():
        try:
            METRICS.flush()
        except Exception:
            ops_log.exception("flushing the metric tallies failed")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_seconds)


def _secrets(settings: Settings) -> list[str]:
    found = [
        settings.jwt_secret.reveal(),
        settings.admin_token.reveal(),
        settings.admission_secret.reveal(),
    ]
    for secret in settings.webhook_secrets:
        found.append(secret.reveal())
        found.append(secret.reveal().removeprefix("whsec_"))
    found.append(settings.mysql.password.reveal())
    raw_password = urlsplit(settings.redis_url).password
    if raw_password:
        # As written in the URL (percent-encoded) …
        found.append(raw_password)
    redis_password = parse_redis_url(settings.redis_url).password
    if redis_password:
        # … and as redis-py uses it (decoded; also when given as ?password=).
        found.append(redis_password)
    # Every other secret as configured (from NAME or NAME_FILE), each entry of a
    # rotation list too; the URLs' passwords are above (a URL whole is no secret).
    for name in SECRET_NAMES:
        if not name.endswith("_URL"):
            found.extend(settings.environ.get(name, "").split())
    return found


def request_log_mode(env: Any) -> str:
    mode = str(env.get("GATE_REQUEST_LOG", "all") or "all").strip().lower()
    if mode not in REQUEST_LOG_MODES:
        raise SettingsError(f"GATE_REQUEST_LOG must be one of {', '.join(REQUEST_LOG_MODES)}")
    return mode


def install(gate: Gate) -> Extension:
    # Checked when the gate is built, so that `gate serve` refuses to start (exit 2).
    if gate.settings.docs and not docs_page.available():
        raise SettingsError(
            "GATE_DOCS is on but Swagger UI's files (the swagger-ui-py package) are missing"
        )
    env = gate.settings.environ
    log_mode = request_log_mode(env)
    # OTEL_* values the gate cannot honour stop `gate serve` here (exit 2), like every
    # other setting; the SDK starts with the serving process (`start`).
    tracing.check(env)
    access = AccessLog() if env_bool(env, "GATE_ACCESS_LOG", False) else None
    sample_seconds = env_float(env, "GATE_METRICS_SAMPLE_SECONDS", 1.0, 0.05, 60.0)
    logs.redact_secrets(_secrets(gate.settings))
    rendered: list[bytes] = []

    async def openapi_json(request: Request) -> Response:
        # Rendered on first use, once every area has installed (and described its
        # own endpoints with openapi.add_operation), whatever the installation order.
        if not rendered:
            rendered.append(openapi.render())
        return Response(rendered[0], media_type="application/json")

    sampler = PoolSampler(gate, sample_seconds)
    stop = asyncio.Event()
    tasks: list[asyncio.Task[None]] = []

    async def start() -> None:
        dead = forget_dead_processes()
        if dead:
            ops_log.info("dropped live gauges of ended workers", extra={"pids": dead})
        stop.clear()
        loop = asyncio.get_running_loop()
        tasks.append(loop.create_task(sampler.run(stop)))
        tasks.append(loop.create_task(flush_tallies(stop)))
        tracing.configure(env, service_version=__version__)  # once per process
        if access is not None:
            access.start()

    async def finish() -> None:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        tasks.clear()
        if access is not None:
            await asyncio.to_thread(access.stop)
        if tracing.ENABLED:
            await asyncio.to_thread(tracing.flush)
        process_stopping()

    recorder = RequestRecorder(log_mode, access)
    return Extension(
        name="ops",
        routes=[Route("/openapi.json", openapi_json, methods=["GET"])],
        middleware=[Middleware(RequestObserver, recorder=recorder)],
        recorder=recorder,
        on_start=[start],
        on_stop=[finish],
    )


def cmd_openapi(args: argparse.Namespace) -> int:
    sys.stdout.write(openapi.render(indent=True).decode() + "\n")
    return 0


def add_commands(sub: argparse._SubParsersAction[Any]) -> None:
    """Add this area's `gate` subcommands."""
    s = sub.add_parser("openapi", help="print the OpenAPI document of the HTTP API")
    s.set_defaults(fn=cmd_openapi)
