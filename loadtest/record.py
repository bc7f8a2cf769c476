"""The client record: what the load generator saw, for the verifier to hold against the
database.

A headless run writes one JSON file. The verifier reads it to check that every order a
client was told about (201) exists, that paid orders ended paid, and that no client saw
two different orders for one idempotency key.
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
VIOLATIONS_MAX = 1_000

OrderRef = tuple[str, int, int]  # order id, user id, deal id


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
