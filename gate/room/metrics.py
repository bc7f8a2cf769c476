"""Waiting-room metrics, per deal, on the gate's one registry."""

from __future__ import annotations

from gate.base.metrics import DELAY_BUCKETS_SECONDS, METRICS

WAITING = METRICS.gauge(
    "gate_room_waiting",
    "Tickets waiting in a deal's waiting room (Redis, read by the room loop).",
    ["deal"],
)
UNSPENT = METRICS.gauge(
    "gate_room_unspent",
    "Admissions given and neither spent nor lapsed (Redis, read by the room loop).",
    ["deal"],
)
SPENT = METRICS.gauge(
    "gate_room_spent",
    "Admissions spent by a reservation since the room's Redis state was made"
    " (a counter kept in Redis; use rate()).",
    ["deal"],
)
ADMITTED = METRICS.counter(
    "gate_room_admitted_total", "Admissions given, by the process that gave them.", ["deal"]
)
LAPSED = METRICS.counter(
    "gate_room_lapsed_total", "Admissions that expired unspent and returned their slot.", ["deal"]
)
LEFT = METRICS.counter(
    "gate_room_left_total",
    "Tickets given up by their buyers (DELETE .../queue), by the process that answered.",
    ["deal"],
)
GIVEN_BACK = METRICS.counter(
    "gate_room_left_admitted_total",
    "Of those, tickets that were admitted: their unspent admission given back (counted"
    " as lapsed in the room's counters).",
    ["deal"],
)
WAIT = METRICS.histogram(
    "gate_room_wait_seconds",
    "Time from joining the queue to admission.",
    ["deal"],
    buckets=DELAY_BUCKETS_SECONDS,
)
RETIRED = METRICS.counter(
    "gate_room_retired_total",
    "Waiting rooms whose keys were deleted (removed, or sale over for an admission TTL).",
)
CODE_FAILURES = METRICS.counter(
    "gate_room_code_failures_total",
    "Joins with an access code refused, by reason: invalid (no such code), used (bound"
    " to another buyer), rate_limited (too many failed lately, per buyer or address).",
    ["reason"],
)
FAIRNESS_ENCODINGS = METRICS.counter(
    "gate_room_fairness_encodings_total",
    "Fairness documents encoded (once per change of a document and process).",
)
