"""Typed extraction of request fields, each failure a clear 400 INVALID_REQUEST."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Any

from gate.base.clock import parse_iso
from gate.base.errors import invalid

_MISSING = object()
IDEMPOTENCY_KEY_RE = re.compile(r"[A-Za-z0-9_.:-]{8,255}")
# Ids (deals, ledger rows) fit a signed 64-bit integer: the database's BIGINT.
MAX_ID = 2**63 - 1


# At most this many digits go to int() as they are, without the length check first.
_SHORT_DIGITS = 18


def digits(text: str, hi: int) -> int | None:
    """The value of `text` if it is ASCII digits worth at most `hi`, else None.

    The length is judged before int() is called: int() of more than 4,300 digits
    raises ValueError (Python's int max str digits), which would be a 500, and
    str.isdigit alone admits digits int() refuses (superscripts such as "²").
    """
    if not (text.isascii() and text.isdigit()):
        return None
    if len(text) <= _SHORT_DIGITS:
        # The usual case (a Content-Length, a path id): int() of a few digits is cheap.
        value = int(text)
    else:
        significant = text.lstrip("0") or "0"
        if len(significant) > len(str(hi)):
            return None
        value = int(significant)
    return value if value <= hi else None


def obj(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise invalid("The body must be a JSON object.")
    return body


def no_unknown(body: dict[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise invalid(f"Unknown field(s): {', '.join(unknown)}.")


def integer(body: dict[str, Any], name: str, lo: int, hi: int, default: Any = _MISSING) -> int:
    value = body.get(name, _MISSING)
    if value is _MISSING or (value is None and default is not _MISSING):
        if default is _MISSING:
            raise invalid(f"'{name}' is required.")
        return int(default)
    # JSON Schema's integer is a number with no fractional part: 3.0 is the integer 3
    # (the OpenAPI document promises as much, and clients that send every number as
    # a float must not be refused). 3.5 is not; inf and nan are not.
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    # bool is an int subclass in Python; JSON true is not a quantity.
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"'{name}' must be an integer.")
    if not lo <= value <= hi:
        raise invalid(f"'{name}' must be between {lo} and {hi}.")
    return value


def optional_integer(body: dict[str, Any], name: str, lo: int, hi: int) -> int | None:
    if body.get(name) is None:
        return None
    return integer(body, name, lo, hi)


def string(
    body: dict[str, Any],
    name: str,
    max_len: int,
    *,
    pattern: re.Pattern[str] | None = None,
    default: Any = _MISSING,
) -> str:
    value = body.get(name, _MISSING)
    if value is _MISSING:
        if default is _MISSING:
            raise invalid(f"'{name}' is required.")
        return str(default)
    if not isinstance(value, str) or not value.strip():
        raise invalid(f"'{name}' must be a non-empty string.")
    value = value.strip()
    if len(value) > max_len:
        raise invalid(f"'{name}' must be at most {max_len} characters.")
    if pattern is not None and not pattern.fullmatch(value):
        raise invalid(f"'{name}' has an invalid format.")
    return value


def timestamp(body: dict[str, Any], name: str) -> datetime | None:
    value = body.get(name)
    if value is None:
        return None
    try:
        return parse_iso(value)
    except (ValueError, TypeError):
        raise invalid(
            f"'{name}' must be an ISO 8601 timestamp with an offset, e.g. 2026-11-29T10:00:00Z."
        ) from None


# The Admission-Token header's bound (the OpenAPI schema's maxLength; a token the
# waiting room mints is far shorter, gate/room/tokens.py).
ADMISSION_TOKEN_MAX_CHARS = 200


def admission_token(header: str | None) -> None:
    """An Admission-Token past its bound is malformed input on any deal (a well-formed
    but forged one is the waiting room's to refuse, 403)."""
    if header is not None and len(header) > ADMISSION_TOKEN_MAX_CHARS:
        raise invalid(f"Admission-Token must be at most {ADMISSION_TOKEN_MAX_CHARS} characters.")


def idempotency_key(header: str | None) -> str:
    if header is None:
        raise invalid("The Idempotency-Key header is required.")
    if not IDEMPOTENCY_KEY_RE.fullmatch(header):
        raise invalid("Idempotency-Key must be 8-255 characters of [A-Za-z0-9_.:-].")
    return header
