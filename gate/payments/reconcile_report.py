"""What a reconciliation pass found (gate/payments/reconcile.py): its findings, the
pass's report and its text rendering.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any


class ReconcileUnavailable(Exception):
    """The provider could not be read: nothing can be compared."""


@dataclass
class Finding:
    kind: str
    outcome: str
    order_id: str | None
    payment_id: str | None
    refund_id: str | None = None
    amount: int | None = None
    currency: str | None = None
    detail: str | None = None
    new: bool = True

    @property
    def needs_operator(self) -> bool:
        return self.outcome == "flagged"


@dataclass
class Report:
    provider: str
    window_seconds: float
    grace_seconds: float
    started_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    pages: int = 0
    transactions: int = 0
    paid_checked: int = 0
    refunds_checked: int = 0
    actions: int = 0
    complete: bool = True
    # The action budget ran out with work left: deferred to the next pass.
    budget_spent: bool = False
    error: str | None = None
    findings: list[Finding] = field(default_factory=list)
    # Payments whose refund this pass scheduled: not "stuck", they just started.
    scheduled: set[str] = field(default_factory=set)

    @property
    def result(self) -> str:
        if self.error is not None:
            return "unavailable"
        if not self.complete or self.budget_spent:
            return "incomplete"
        return "flagged" if any(f.needs_operator for f in self.findings) else "ok"

    @property
    def exit_code(self) -> int:
        return {"ok": 0, "flagged": 1}.get(self.result, 2)

    def as_dict(self) -> dict[str, Any]:
        counts: dict[str, dict[str, int]] = {}
        for f in self.findings:
            if f.new:
                by_kind = counts.setdefault(f.kind, {})
                by_kind[f.outcome] = by_kind.get(f.outcome, 0) + 1
        return {
            "provider": self.provider,
            "result": self.result,
            "exit_code": self.exit_code,
            "error": self.error,
            "window_seconds": self.window_seconds,
            "grace_seconds": self.grace_seconds,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "scanned": {
                "pages": self.pages,
                "transactions": self.transactions,
                "paid_orders": self.paid_checked,
                "refunds": self.refunds_checked,
                "complete": self.complete,
            },
            "actions": self.actions,
            "new": sum(1 for f in self.findings if f.new),
            "open": sum(1 for f in self.findings if f.needs_operator),
            "counts": counts,
            "findings": [{**asdict(f), "needs_operator": f.needs_operator} for f in self.findings],
        }


def render(report: Report) -> str:
    """The text report: one line per finding, then the verdict."""
    lines = [
        f"reconcile {report.provider}: window {report.window_seconds:g} s"
        f" (grace {report.grace_seconds:g} s); {report.transactions} provider transactions"
        f" in {report.pages} page(s), {report.paid_checked} paid orders and"
        f" {report.refunds_checked} unsettled refunds checked, {report.actions} actions"
    ]
    for f in report.findings:
        money = f" {f.amount} {f.currency}" if f.amount is not None else ""
        refs = " ".join(
            f"{name} {value}"
            for name, value in (
                ("order", f.order_id),
                ("payment", f.payment_id),
                ("refund", f.refund_id),
            )
            if value
        )
        tag = "NEW " if f.new else "open"
        detail = f"  ({f.detail})" if f.detail else ""
        lines.append(f"  {tag} {f.kind:<20} {f.outcome:<16} {refs}{money}{detail}")
    new = sum(1 for f in report.findings if f.new)
    open_ = sum(1 for f in report.findings if f.needs_operator)
    if report.error is not None:
        verdict = f"UNAVAILABLE: could not reconcile: {report.error}"
    elif not report.complete:
        verdict = (
            "INCOMPLETE: the window holds more transactions than GATE_RECONCILE_PAGES_MAX"
            " pages; shorten GATE_RECONCILE_WINDOW_SECONDS or raise the bound"
        )
    elif report.budget_spent:
        verdict = (
            "INCOMPLETE: GATE_RECONCILE_ACTIONS_MAX was spent; what is left is deferred to"
            " the next pass (run again, or raise the bound)"
        )
    elif open_:
        verdict = f"FLAGGED: {open_} finding(s) need an operator"
    else:
        verdict = "OK"
    summary = "nothing new" if new == 0 else f"{new} new"
    lines.append(f"{verdict}; {summary} (exit {report.exit_code})")
    return "\n".join(lines)
