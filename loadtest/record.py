"""The client record: what the load generator saw, for the verifier to hold against the
database.

A headless run writes one JSON file. The verifier reads it to check that every order a
client was told about (201) exists, that paid orders ended paid, that every callback
the gate answered 2xx is recorded there, and that no client saw two different orders
for one idempotency key.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

VERSION = 1
# Bounds on what one record keeps; a run past them is still verified by counts.
ORDERS_MAX = 1_000_000
DELIVERIES_MAX = 1_000_000
VIOLATIONS_MAX = 1_000
# The status of a delivery that got no HTTP answer at all (reset, closed, timed out).
NO_ANSWER = 0

OrderRef = tuple[str, int, int]  # order id, user id, deal id
# One HTTP delivery of a payment callback and the answer it got: order id, deal id,
# event id, event type, HTTP status (NO_ANSWER when none came back).
DeliveryRef = tuple[str, int, str, str, int]


def acknowledged(status: int) -> bool:
    """Whether a delivery's answer tells the provider the event was taken (2xx)."""
    return 200 <= status < 300


@dataclass
class ClientRecord:
    host: str = ""
    deals: dict[str, int] = field(default_factory=dict)
    # deal id -> the stock it was created with (deals this run created): the verifier
    # holds the orders against it, not only against the counters.
    stocks: dict[int, int] = field(default_factory=dict)
    created: list[OrderRef] = field(default_factory=list)
    paid: list[OrderRef] = field(default_factory=list)
    late_paid: list[OrderRef] = field(default_factory=list)
    # Every callback delivery and its answer. `paid`/`late_paid` hold only orders whose
    # payment.succeeded got a 2xx; a payment no delivery got a 2xx for is in `unpaid`
    # (the gate never said it took it: not a payment the verifier may expect).
    deliveries: list[DeliveryRef] = field(default_factory=list)
    unpaid: list[OrderRef] = field(default_factory=list)
    truncated: bool = False
    violations: list[str] = field(default_factory=list)
    # deal id -> outcome (HTTP status or problem code) -> count
    outcomes: dict[int, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    notes: list[str] = field(default_factory=list)

    def outcome(self, deal_id: int, what: str) -> None:
        self.outcomes[deal_id][what] += 1

    def add(self, bucket: list[OrderRef], ref: OrderRef) -> None:
        if len(bucket) < ORDERS_MAX:
            bucket.append(ref)
        else:
            self.truncated = True

    def delivery(self, ref: DeliveryRef) -> None:
        if len(self.deliveries) < DELIVERIES_MAX:
            self.deliveries.append(ref)
        else:
            self.truncated = True

    def violation(self, text: str) -> None:
        if len(self.violations) < VIOLATIONS_MAX:
            self.violations.append(text)

    def sold_out_seen(self) -> list[int]:
        return sorted(d for d, c in self.outcomes.items() if c.get("SOLD_OUT"))

    def to_json(self) -> dict[str, Any]:
        return {
            "version": VERSION,
            "host": self.host,
            "deals": self.deals,
            "stocks": {str(d): n for d, n in self.stocks.items()},
            "created": self.created,
            "paid": self.paid,
            "late_paid": self.late_paid,
            "deliveries": self.deliveries,
            "unpaid": self.unpaid,
            "truncated": self.truncated,
            "violations": self.violations,
            "outcomes": {str(d): dict(c) for d, c in self.outcomes.items()},
            "notes": self.notes,
        }

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(orjson.dumps(self.to_json(), option=orjson.OPT_INDENT_2))

    @classmethod
    def read(cls, path: Path) -> ClientRecord:
        data = orjson.loads(path.read_bytes())
        if data.get("version") != VERSION:
            raise ValueError(f"{path}: record version {data.get('version')}, expected {VERSION}")
        record = cls(
            host=str(data.get("host", "")),
            deals={str(k): int(v) for k, v in data.get("deals", {}).items()},
            stocks={int(k): int(v) for k, v in data.get("stocks", {}).items()},
            created=[_ref(r) for r in data.get("created", [])],
            paid=[_ref(r) for r in data.get("paid", [])],
            late_paid=[_ref(r) for r in data.get("late_paid", [])],
            deliveries=[_delivery(r) for r in data.get("deliveries", [])],
            unpaid=[_ref(r) for r in data.get("unpaid", [])],
            truncated=bool(data.get("truncated", False)),
            violations=[str(v) for v in data.get("violations", [])],
            notes=[str(n) for n in data.get("notes", [])],
        )
        for deal, counts in data.get("outcomes", {}).items():
            record.outcomes[int(deal)].update({str(k): int(v) for k, v in counts.items()})
        return record


def _ref(raw: Any) -> OrderRef:
    order_id, user_id, deal_id = raw
    return str(order_id), int(user_id), int(deal_id)


def _delivery(raw: Any) -> DeliveryRef:
    order_id, deal_id, event_id, event_type, status = raw
    return str(order_id), int(deal_id), str(event_id), str(event_type), int(status)
