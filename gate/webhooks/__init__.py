"""Outbound webhooks: signed HTTP deliveries of order, payment and deal events to a
shop's endpoints, at least once, nothing lost (docs/webhooks.md).

    state change ──same transaction──> outbox row (MariaDB)
        ──> FanOut (one process at a time: work lease) ──> webhook_events with a
            per-order sequence + one webhook_deliveries row per subscribed endpoint
        ──> Dispatcher (every process, sharing through claims) ──> Sender: POST,
            Standard Webhooks signature ──> webhook_attempts, delivered / retried /
            failed, 410 disables, 5 days of failures disable
    deal_buckets ──> FanOut's deal watch ──> deal.sold_out / deal.available_again

    admin API  /v1/admin/webhook-endpoints… (gate/webhooks/api.py)
    CLI        gate webhooks list|create|show|deliveries|retry|rotate|test|disable|enable
    console    the "Webhooks" panel: status, success rate, failing deliveries, retry

The area's SQL is in store.py, its URL rules in ssrf.py, the secrets' sealing in
vault.py, the one HTTP call in sender.py.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from gate.extensions import Extension, Worker
from gate.store.work_lease import WorkLease
from gate.web import openapi
from gate.webhooks import api_doc
from gate.webhooks.api import routes
from gate.webhooks.config import load_webhook_settings
from gate.webhooks.console_panel import WebhooksPanel
from gate.webhooks.dispatcher import Dispatcher
from gate.webhooks.fanout import FanOut
from gate.webhooks.sender import Sender
from gate.webhooks.service import WebhookService
from gate.webhooks.store import WebhookStore
from gate.webhooks.vault import Vault

if TYPE_CHECKING:
    from gate.runtime import Gate

for (_path, _method), _operation in api_doc.operations().items():
    openapi.add_operation(_path, _method, _operation)
for _name, _schema in api_doc.SCHEMAS.items():
    openapi.add_schema(_name, _schema)

LEASE_KIND = "webhooks"


def install(gate: Gate) -> Extension:
    settings = load_webhook_settings(gate.settings.environ, gate.settings.is_dev)
    store = WebhookStore(gate.db)
    vault = Vault(settings.encryption_keys)
    sender = Sender(settings)
    dispatcher = Dispatcher(store, sender, vault, settings)
    lease = WorkLease(gate.runner, LEASE_KIND, gate.settings.background_lease_seconds)
    fanout = FanOut(store, settings, lease, dispatcher.kick)
    service = WebhookService(store, vault, settings, dispatcher.kick)
    workers: list[Worker] = []
    if settings.run_workers:
        workers = [fanout.run, dispatcher.run]
    return Extension(
        name="webhooks",
        routes=routes(service),
        workers=workers,
        on_stop=[sender.close],
        console_gate_panels=[WebhooksPanel(service)],
    )


def add_commands(sub: argparse._SubParsersAction[Any]) -> None:
    from gate.webhooks.cli import add_commands as add

    add(sub)
