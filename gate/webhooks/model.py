"""The webhooks' records as the code passes them around (the rows are read and
written in gate/webhooks/store.py)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

ERROR_MAX_CHARS = 255


class TooManyEndpoints(Exception):
    pass


@dataclass
class Endpoint:
    id: str
    url: str
    events: list[str]
    description: str
    status: str
    disabled_reason: str | None
    secret: str
    previous_secret: str | None
    previous_active: bool
    failing_since: datetime | None
    last_success_at: datetime | None
    created_at: datetime
    updated_at: datetime

    @classmethod
    def from_row(cls, row: Sequence[Any]) -> Endpoint:
        return cls(
            str(row[0]),
            str(row[1]),
            list(json.loads(row[2])),
            str(row[3]),
            str(row[4]),
            row[5],
            str(row[6]),
            row[7],
            bool(row[8]),
            row[9],
            row[10],
            row[11],
            row[12],
        )


@dataclass
class Claimed:
    delivery_id: int
    endpoint_id: str
    attempt: int
    event_id: str
    body: bytes
    event_created_at: datetime
    token: str


@dataclass
class Recorded:
    """One finished attempt, as the dispatcher decided it (gate/webhooks/dispatcher.py)."""

    claimed: Claimed
    started_at: datetime
    duration_ms: int
    http_status: int | None
    error: str | None
    # 'delivered', 'retry' (next_delay_seconds from now) or 'failed'.
    state: str
    next_delay_seconds: float = 0.0
    gone: bool = False


def short_text(text: str | None) -> str | None:
    return None if text is None else text[:ERROR_MAX_CHARS]


def iso_z(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat(timespec="microseconds") + "Z"


def delivery_view(r: Sequence[Any]) -> dict[str, Any]:
    return {
        "id": int(r[0]),
        "event_id": str(r[1]),
        "type": str(r[2]),
        "status": str(r[3]),
        "attempts_in_round": int(r[4]),
        "next_attempt_at": iso_z(r[5]) if str(r[3]) == "pending" else None,
        "last_status": None if r[6] is None else int(r[6]),
        "last_error": r[7],
        "created_at": iso_z(r[8]),
        "updated_at": iso_z(r[9]),
        "delivered_at": iso_z(r[10]),
        "attempts": [],
    }
