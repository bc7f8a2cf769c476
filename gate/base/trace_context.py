"""The W3C Trace Context headers (https://www.w3.org/TR/trace-context/), read as the
recommendation says: `traceparent` whole or not at all, `tracestate` bounded and
kept whole or dropped (gate/base/tracing.py uses both; no OpenTelemetry import, so
an invalid header from a client never reaches the SDK's warnings).
"""

from __future__ import annotations

import re

TRACESTATE_MAX_CHARS = 512
TRACESTATE_MEMBERS_MAX = 32

_TRACEPARENT = re.compile(rb"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
_TRACESTATE_MEMBER = re.compile(
    r"((?:[a-z][_0-9a-z\-*/]{0,255})|(?:[a-z0-9][_0-9a-z\-*/]{0,240}@[a-z][_0-9a-z\-*/]{0,13}))"
    r"=([\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e])"
)


def parse_traceparent(raw: bytes | str | None) -> tuple[int, int, bool] | None:
    """(trace id, parent span id, sampled) of a valid `traceparent`, else None."""
    if raw is None:
        return None
    if isinstance(raw, str):
        raw = raw.encode("latin-1", "replace")
    raw = raw.strip()
    m = _TRACEPARENT.fullmatch(raw)
    if m is None:
        return None
    version, trace_hex, span_hex, flags, rest = m.groups()
    if version == b"ff" or (version == b"00" and rest is not None):
        return None
    trace_id, span_id = int(trace_hex, 16), int(span_hex, 16)
    if not trace_id or not span_id:
        return None
    return trace_id, span_id, bool(int(flags, 16) & 1)


def parse_tracestate(raw: bytes | str | None) -> list[tuple[str, str]]:
    """The members of a valid `tracestate` (bounded), else none: it is then dropped,
    never partly kept."""
    if not raw:
        return []
    text = raw.decode("latin-1") if isinstance(raw, bytes) else raw
    if len(text) > TRACESTATE_MAX_CHARS:
        return []
    pairs: dict[str, str] = {}
    for member in text.split(","):
        member = member.strip(" \t")
        if not member:
            continue
        m = _TRACESTATE_MEMBER.fullmatch(member)
        if m is None or m.group(1) in pairs or len(pairs) >= TRACESTATE_MEMBERS_MAX:
            return []
        pairs[m.group(1)] = m.group(2)
    return list(pairs.items())
