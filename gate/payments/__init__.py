"""Payments: provider interface, sandbox provider, signed callbacks, order state machine,
refunds, outbox. See docs/payments.md."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gate.base.settings import SettingsError, env_bool, with_secret_files
from gate.extensions import Extension, Worker
from gate.payments.adapters import load_adapter
from gate.payments.config import load_payment_settings, load_reconcile_settings
from gate.payments.machine import PaymentMachine
from gate.payments.outbox import OutboxRelay
from gate.payments.reconcile import Reconciler
from gate.payments.reconcile_command import add_command as add_reconcile_command
from gate.payments.sessions import PaymentSessions
from gate.payments.webhook import WebhookEndpoint
from gate.payments.workers import PaymentWorker
from gate.web.http_io import json_response

if TYPE_CHECKING:
    from gate.runtime import Gate


def _actor() -> str:
    return f"payments@{socket.gethostname()[:40]}:{os.getpid()}"


def install(gate: Gate) -> Extension:
    env = gate.settings.environ
    settings = load_payment_settings(env)
    adapter = load_adapter(
        env,
        settings,
        is_dev=gate.settings.is_dev,
        webhook_secrets=gate.settings.webhook_secrets,
    )
    provider = adapter.provider
    actor = _actor()
    machine = PaymentMachine(gate.db, gate.mirror, actor)
    worker = PaymentWorker(gate.db, gate.mirror, machine, provider, settings, actor)
    relay = OutboxRelay(
        gate.db,
        gate.redis,
        settings.outbox_stream,
        settings.outbox_stream_maxlen,
        settings.outbox_batch_max,
        settings.outbox_interval_seconds,
    )
    sessions = PaymentSessions(gate.db, provider, settings)
    webhook = WebhookEndpoint(
        adapter.name,
        adapter.webhook,
        machine,
        settings.webhook_body_max_bytes,
        settings.dedup_cache_max,
        worker.kick,
    )

    async def create_payment(request: Request) -> Response:
        user_id = gate.buyer_auth.user_id(request.headers.get("authorization"))
        body, created = await sessions.get_or_create(request.path_params["order_id"], user_id)
        return json_response(body, 201 if created else 200)

    workers: list[Worker] = []
    if settings.run_workers:
        workers.append(worker.run)
    if env_bool(env, "GATE_OUTBOX_RELAY", True):
        workers.append(relay.run)
    reconcile = load_reconcile_settings(env)
    if provider is not None and reconcile.interval_seconds > 0:
        reconciler = Reconciler(
            gate.db, machine, worker, provider, reconcile, gate.settings.mysql.database
        )
        workers.append(reconciler.run)
    on_stop: list[Callable[[], Awaitable[None]]] = []
    if provider is not None:
        on_stop.append(provider.close)
    return Extension(
        name="payments",
        routes=[
            Route("/v1/orders/{order_id:str}/payment", create_payment, methods=["POST"]),
            Route("/v1/payments/{provider:str}/webhook", webhook, methods=["POST"], name="webhook"),
        ],
        workers=workers,
        on_stop=on_stop,
    )


def _cmd_sandbox(args: argparse.Namespace) -> int:
    import uvicorn

    from gate.base.logs import configure
    from gate.payments.sandbox.server import load_config

    try:
        env = with_secret_files(os.environ)
        load_config(env, args.host, args.port)
    except SettingsError as exc:
        print(f"gate sandbox: configuration error: {exc}", file=sys.stderr)
        return 2
    configure(os.environ.get("GATE_LOG_LEVEL", "INFO").upper())
    if not env.get("GATE_SANDBOX_WEBHOOK_SECRET", "").strip():
        # Said out loud: the gate verifies with GATE_WEBHOOK_SECRET, which the sandbox
        # never borrows; a gate that should trust this sandbox must be given this one.
        logging.getLogger("gate.sandbox").warning(
            "GATE_SANDBOX_WEBHOOK_SECRET is unset: signing callbacks with the built-in"
            " development secret (GATE_WEBHOOK_SECRET is never used by the sandbox)"
        )
    os.environ["GATE_SANDBOX_HOST"] = args.host
    os.environ["GATE_SANDBOX_PORT"] = str(args.port)
    uvicorn.run(
        "gate.payments.sandbox.server:create_sandbox_app",
        factory=True,
        host=args.host,
        port=args.port,
        workers=1,
        loop="uvloop",
        http="httptools",
        access_log=False,
        log_config=None,
        lifespan="on",
        backlog=4096,
    )
    return 0


def _cmd_relay(args: argparse.Namespace) -> int:
    from gate.base.logs import configure
    from gate.base.settings import load_settings
    from gate.store.db import Database
    from gate.store.redis_mode import RedisModeError, detect_mode, make_redis

    try:
        settings = load_settings()
        payment = load_payment_settings(settings.environ)
    except SettingsError as exc:
        print(f"gate relay: configuration error: {exc}", file=sys.stderr)
        return 2
    configure(settings.log_level)
    try:
        mode = detect_mode(
            settings.redis_url,
            settings.redis_mode,
            settings.redis_timeout_seconds,
            settings.redis_cluster_nodes,
        )
    except RedisModeError as exc:
        print(f"gate relay: configuration error: {exc}", file=sys.stderr)
        return 2

    async def go() -> int:
        db = Database(settings, pool_max=4)
        await db.start()
        # As `gate serve` makes it: a cluster client on Redis Cluster (a plain one would
        # be told MOVED whenever the stream's slot is not on the URL's node).
        client = make_redis(
            settings.redis_url,
            4,
            settings.redis_timeout_seconds,
            mode,
            settings.redis_cluster_nodes,
        )
        relay = OutboxRelay(
            db,
            client,
            payment.outbox_stream,
            payment.outbox_stream_maxlen,
            payment.outbox_batch_max,
            payment.outbox_interval_seconds,
        )
        try:
            if args.once:
                print(f"relay: {await relay.run_once()}")
            else:
                await relay.run(asyncio.Event())
        finally:
            await client.aclose()
            await db.close()
        return 0

    return asyncio.run(go())


def add_commands(sub: argparse._SubParsersAction[Any]) -> None:
    """Add this area's `gate` subcommands."""
    s = sub.add_parser("sandbox", help="run the sandbox payment provider (test mode)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8090)
    s.set_defaults(fn=_cmd_sandbox)

    s = sub.add_parser("relay", help="publish outbox rows to the event stream")
    s.add_argument("--once", action="store_true")
    s.set_defaults(fn=_cmd_relay)

    add_reconcile_command(sub)
