"""Expiry: the hold sweeper and the continuous invariant checks.

Both run inside `gate serve` (one of each per process; any number of processes
may run them at once) unless turned off, and the sweeper also runs on its own as
`gate sweep [--once]`. See docs/expiry.md.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gate.base.settings import SettingsError, env_bool, env_float, env_int
from gate.expiry.invariant_monitor import InvariantMonitor, MonitorConfig
from gate.expiry.sweeper import SweepConfig, Sweeper
from gate.extensions import Extension, Worker
from gate.store.work_lease import WorkLease

if TYPE_CHECKING:
    from gate.base.settings import Settings
    from gate.runtime import Gate

# The longest a sweeper's batch may take by default; shorter when the janitor's
# orphan age leaves less room (see ExpirySettings.from_env).
BATCH_TIMEOUT_DEFAULT_SECONDS = 10.0


@dataclass(frozen=True)
class ExpirySettings:
    sweeper_in_serve: bool
    invariants_in_serve: bool
    sweep: SweepConfig
    monitor: MonitorConfig

    @classmethod
    def from_env(cls, env: Mapping[str, str], settings: Settings) -> ExpirySettings:
        # A batch's intents must be decided before the janitor would treat them as
        # orphaned: the batch deadline plus one lock wait (a statement sent just
        # before the deadline) must stay below the janitor's orphan age.
        room = settings.inflight_max_seconds - settings.db_lock_wait_seconds
        default_timeout = max(1.0, min(BATCH_TIMEOUT_DEFAULT_SECONDS, room / 2))
        timeout = env_float(env, "GATE_SWEEP_BATCH_TIMEOUT_SECONDS", default_timeout, 1.0, 600.0)
        if timeout >= room:
            raise SettingsError(
                "GATE_SWEEP_BATCH_TIMEOUT_SECONDS must stay below GATE_INFLIGHT_MAX_SECONDS"
                f" minus GATE_DB_LOCK_WAIT_SECONDS ({room:g})"
            )
        sweep = SweepConfig(
            batch_max=env_int(env, "GATE_SWEEP_BATCH_MAX", 1000, 1, 5000),
            interval_seconds=env_float(env, "GATE_SWEEP_INTERVAL_SECONDS", 0.5, 0.01, 60.0),
            tasks=env_int(env, "GATE_SWEEP_TASKS", 1, 1, 16),
            batch_timeout_seconds=timeout,
        )
        monitor = MonitorConfig(
            interval_seconds=env_float(env, "GATE_INVARIANT_INTERVAL_SECONDS", 10.0, 0.1, 3600.0),
            deals_per_pass=env_int(env, "GATE_INVARIANT_DEALS_PER_PASS", 20, 1, 10_000),
            duty_max=env_float(env, "GATE_INVARIANT_DUTY_MAX", 0.05, 0.001, 1.0),
            inconsistency_ratio_max=env_float(
                env, "GATE_ALERT_INCONSISTENCY_RATIO", 0.005, 0.0, 1.0
            ),
            inconsistency_for_seconds=env_float(
                env, "GATE_ALERT_INCONSISTENCY_FOR_SECONDS", 600.0, 0.0, 86_400.0
            ),
            release_failure_ratio_max=env_float(
                env, "GATE_ALERT_RELEASE_FAILURE_RATIO", 0.01, 0.0, 1.0
            ),
            release_failure_window_seconds=env_float(
                env, "GATE_ALERT_RELEASE_FAILURE_WINDOW_SECONDS", 600.0, 1.0, 86_400.0
            ),
            release_lag_max_seconds=env_float(
                env, "GATE_ALERT_RELEASE_LAG_SECONDS", 300.0, 1.0, 86_400.0
            ),
            pause_on_breach=env_bool(env, "GATE_PAUSE_ON_BREACH", True),
        )
        return cls(
            sweeper_in_serve=env_bool(env, "GATE_SWEEPER", True),
            invariants_in_serve=env_bool(env, "GATE_INVARIANT_CHECKS", True),
            sweep=sweep,
            monitor=monitor,
        )


def make_sweeper(gate: Gate, config: SweepConfig | None = None) -> Sweeper:
    settings = ExpirySettings.from_env(gate.settings.environ, gate.settings)
    return Sweeper(gate.db, gate.mirror, config or settings.sweep)


def make_monitor(gate: Gate, config: MonitorConfig | None = None) -> InvariantMonitor:
    settings = ExpirySettings.from_env(gate.settings.environ, gate.settings)
    return InvariantMonitor(gate.db, gate.redis, config or settings.monitor, mirror=gate.mirror)


def install(gate: Gate) -> Extension:
    settings = ExpirySettings.from_env(gate.settings.environ, gate.settings)
    workers: list[Worker] = []
    if settings.sweeper_in_serve:
        workers.append(Sweeper(gate.db, gate.mirror, settings.sweep).run)
    if settings.invariants_in_serve:
        monitor = InvariantMonitor(gate.db, gate.redis, settings.monitor, mirror=gate.mirror)
        # One process at a time across hosts checks the invariants (gate/store/work_lease.py).
        monitor.work_lease = WorkLease(
            gate.runner, "invariants", gate.settings.background_lease_seconds
        )
        workers.append(monitor.run)
    return Extension(name="expiry", workers=workers)


def cmd_sweep(args: argparse.Namespace) -> int:
    from gate.base.logs import configure, configure_command
    from gate.base.settings import load_settings
    from gate.runtime import Gate, StartupError

    try:
        settings = load_settings()
        expiry = ExpirySettings.from_env(settings.environ, settings)
    except SettingsError as exc:
        print(f"gate: configuration error: {exc}", file=sys.stderr)
        return 2
    # --once prints a count for people or scripts; the loop logs as `gate serve` does.
    (configure_command if args.once else configure)(settings.log_level)

    async def main() -> int:
        gate = Gate(settings)
        try:
            await gate.start(background=False)
        except StartupError as exc:
            print(f"gate: {exc}", file=sys.stderr)
            await gate.stop()
            return 2
        sweeper = Sweeper(gate.db, gate.mirror, expiry.sweep)
        try:
            if args.once:
                try:
                    released = await sweeper.sweep_due()
                except Exception as exc:
                    print(f"gate sweep: a batch failed: {exc!r}", file=sys.stderr)
                    return 1
                print(f"sweep: released {released}")
                return 0
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            await sweeper.run(stop)
            return 0
        finally:
            await gate.stop()

    return asyncio.run(main())


def add_commands(sub: argparse._SubParsersAction[Any]) -> None:
    """Add this area's `gate` subcommands."""
    s = sub.add_parser("sweep", help="release holds whose deadline has passed")
    s.add_argument(
        "--once", action="store_true", help="release what is due now, then exit (prints a count)"
    )
    s.set_defaults(fn=cmd_sweep)
