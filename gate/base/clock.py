"""Conversions between database DATETIME(6) values (UTC, naive) and the API's ISO 8601."""

from __future__ import annotations

from datetime import UTC, datetime


def iso(value: datetime | None) -> str | None:
    """A naive UTC datetime from the database as ISO 8601 with a Z suffix."""
    if value is None:
        return None
    return value.replace(tzinfo=None).isoformat(timespec="microseconds") + "Z"


def epoch_ms(value: datetime | None) -> int:
    """Milliseconds since the epoch for a naive UTC datetime; 0 for None."""
    if value is None:
        return 0
    return int(value.replace(tzinfo=UTC).timestamp() * 1000)


def parse_iso(text: str) -> datetime:
    """Parse an ISO 8601 timestamp with an explicit offset into naive UTC.

    Raises ValueError when the text is not a timestamp or carries no offset: a
    local time without an offset would be read differently by different servers.
    """
    if not isinstance(text, str) or len(text) > 64:
        raise ValueError("not a timestamp")
    value = datetime.fromisoformat(text.replace("z", "Z").replace("Z", "+00:00"))
    if value.tzinfo is None:
        raise ValueError("timestamp needs an offset, e.g. 2026-11-29T10:00:00Z")
    try:
        return value.astimezone(UTC).replace(tzinfo=None)
    except OverflowError:
        # 0001-01-01T00:00:00+01:00 is a valid text whose UTC time is before year 1.
        raise ValueError("timestamp out of range") from None
