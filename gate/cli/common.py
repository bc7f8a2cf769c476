"""What the `gate` command's subcommands share (gate/cli/, and the areas' own
commands): checked settings, a gate started for one command, bounded number
arguments."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from gate.base.settings import Settings, SettingsError, load_settings


def checked_settings() -> Settings:
    """Every setting, the areas' too (payments, expiry, operations), or exit 2 with the
    message. The areas read theirs when the gate is built, which for `gate serve` is
    inside each worker: too late for a clear message (a worker's traceback, restarted
    by the supervisor), so the gate is built once here to check them (no I/O)."""
    from gate.runtime import Gate
    from gate.store.scripts import ScriptMissing

    try:
        settings = load_settings()
        Gate(settings)
    except SettingsError as exc:
        print(f"gate: configuration error: {exc}", file=sys.stderr)
        hint = _dev_env_hint()
        if hint:
            print(hint, file=sys.stderr)
        raise SystemExit(2) from None
    except ScriptMissing as exc:
        print(f"gate: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    return settings


# Where scripts/run writes the settings of the development gate it runs.
DEV_ENV_FILE = Path(".local") / "dev.env"


def _dev_env_hint() -> str | None:
    """With GATE_ENV unset, in a checkout where scripts/run wrote its settings: how to
    reach that development gate (README's tour in a second shell)."""
    if os.environ.get("GATE_ENV", "").strip() or not DEV_ENV_FILE.is_file():
        return None
    return (
        f"gate: {DEV_ENV_FILE} holds the settings of the development gate scripts/run"
        f" started: `source {DEV_ENV_FILE}` to use them"
    )


async def with_gate(
    fn: Callable[[Any], Awaitable[int]], *, scripts: bool = True, daemon: bool = False
) -> int:
    """Run `fn(gate)` with the database and Redis started but no background loops.
    Its log: a `daemon` (a loop that runs until stopped) writes JSON lines at
    GATE_LOG_LEVEL as `gate serve` does; a one-shot command human-readable warnings
    on stderr, so that its stdout holds its output alone."""
    from gate.base.logs import configure, configure_command
    from gate.runtime import Gate
    from gate.store.dbwriter import NoWriter

    settings = checked_settings()
    # Either way with the secrets' redaction.
    (configure if daemon else configure_command)(settings.log_level)
    gate = Gate(settings)
    try:
        await gate.db.start()
    except NoWriter as exc:
        print(f"gate: {exc}", file=sys.stderr)
        return 1
    if scripts:
        await gate.runner.load()
    try:
        return await fn(gate)
    finally:
        await gate.stop()


def ranged_int(lo: int, hi: int) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        try:
            value = int(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {raw!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be within {lo}..{hi}, got {value}")
        return value

    return parse


def ranged_float(lo: float, hi: float) -> Callable[[str], float]:
    def parse(raw: str) -> float:
        try:
            value = float(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {raw!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be within {lo:g}..{hi:g}, got {value:g}")
        return value

    return parse
