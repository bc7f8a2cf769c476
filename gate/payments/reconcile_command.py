"""`gate reconcile`: one pass or a loop of passes of the provider reconciliation
(gate/payments/reconcile.py) from the command line.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys
from dataclasses import replace
from typing import Any

import orjson

from gate.payments.machine import PaymentMachine
from gate.payments.reconcile import CLI_LOCK_WAIT_SECONDS, Reconciler
from gate.payments.reconcile_report import render
from gate.payments.workers import PaymentWorker


def add_command(sub: argparse._SubParsersAction[Any]) -> None:
    s = sub.add_parser(
        "reconcile",
        help="compare the payment provider's transactions with the gate's and repair"
        " (exit 0 ok, 1 flagged for an operator, 2 could not reconcile)",
    )
    s.add_argument("--once", action="store_true", help="one pass (the default)")
    s.add_argument(
        "--loop", action="store_true", help="a pass every GATE_RECONCILE_INTERVAL_SECONDS"
    )
    s.add_argument("--json", action="store_true")
    s.add_argument("--window-seconds", type=float, help="override GATE_RECONCILE_WINDOW_SECONDS")
    s.set_defaults(fn=command)


def command(args: argparse.Namespace) -> int:
    from gate.base.logs import configure, configure_command
    from gate.base.settings import SettingsError, load_settings
    from gate.payments.adapters import load_adapter
    from gate.payments.config import load_payment_settings, load_reconcile_settings

    try:
        settings = load_settings()
        payment = load_payment_settings(settings.environ)
        recon = load_reconcile_settings(settings.environ)
        adapter = load_adapter(
            settings.environ,
            payment,
            is_dev=settings.is_dev,
            webhook_secrets=settings.webhook_secrets,
        )
    except SettingsError as exc:
        print(f"gate reconcile: configuration error: {exc}", file=sys.stderr)
        return 2
    if args.window_seconds is not None:
        if not 60 <= args.window_seconds <= 90 * 86_400:
            print("gate reconcile: --window-seconds must be within 60..7776000", file=sys.stderr)
            return 2
        recon = replace(recon, window_seconds=args.window_seconds)
    if args.loop and recon.interval_seconds == 0:
        print("gate reconcile: --loop needs GATE_RECONCILE_INTERVAL_SECONDS > 0", file=sys.stderr)
        return 2
    provider = adapter.provider
    if provider is None:
        print("gate reconcile: no provider configured (GATE_PAYMENT_PROVIDER_URL)", file=sys.stderr)
        return 2
    # One pass prints its report; --loop logs as `gate serve` does.
    (configure if args.loop else configure_command)(settings.log_level)

    async def go() -> int:
        from gate.runtime import Gate

        gate = Gate(settings)
        try:
            await gate.db.start()
            await gate.runner.load()
            actor = f"reconcile@{socket.gethostname()[:40]}:{os.getpid()}"
            machine = PaymentMachine(gate.db, gate.mirror, actor)
            worker = PaymentWorker(gate.db, gate.mirror, machine, provider, payment, actor)
            rec = Reconciler(gate.db, machine, worker, provider, recon, settings.mysql.database)
            if args.loop:
                stop = asyncio.Event()
                loop = asyncio.get_running_loop()
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.add_signal_handler(sig, stop.set)
                await rec.run(stop)
                return 0
            report = await rec.run_once(CLI_LOCK_WAIT_SECONDS)
        finally:
            await provider.close()
            await gate.stop()
        if report is None:
            print("gate reconcile: another reconciliation pass is running", file=sys.stderr)
            return 2
        if args.json:
            sys.stdout.write(orjson.dumps(report.as_dict(), option=orjson.OPT_INDENT_2).decode())
            sys.stdout.write("\n")
        else:
            print(render(report))
        return report.exit_code

    try:
        return asyncio.run(go())
    except Exception as exc:
        print(f"gate reconcile: could not reconcile: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
