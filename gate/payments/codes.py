"""Outcomes of the payment procedures (db/003_payments.sql), value for value."""

from __future__ import annotations

from enum import IntEnum


class EventCode(IntEnum):
    """gate_payment_event"""

    APPLIED = 0
    DUPLICATE = 1
    IGNORED = 2
    QUARANTINED = 3
    LATE = 4
    WAITING = 5


# The metric label of each outcome (gate_callbacks_total{outcome}). A late event is
# applied by the late settlement right after; a waiting one has no effect yet.
METRIC_OUTCOME = {
    EventCode.APPLIED: "applied",
    EventCode.DUPLICATE: "duplicate",
    EventCode.IGNORED: "ignored",
    EventCode.QUARANTINED: "quarantined",
    EventCode.LATE: "applied",
    EventCode.WAITING: "ignored",
}

EVENT_TYPES = frozenset(
    {
        "payment.authorized",
        "payment.succeeded",
        "payment.failed",
        "authorization.voided",
        "refund.succeeded",
        "refund.failed",
    }
)
