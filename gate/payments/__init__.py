"""Payments: provider interface, sandbox provider, signed callbacks, order state machine,
refunds, outbox (issue #4)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from gate.extensions import Extension

if TYPE_CHECKING:
    from gate.runtime import Gate


def install(gate: Gate) -> Extension:
    return Extension(name="payments")


def add_commands(sub: argparse._SubParsersAction[Any]) -> None:
    """Add this area's `gate` subcommands."""
