"""Pausing a deal's sale: by the invariant monitor when the books break, by hand.

    pause(deal, why, actor)                          resume(deal, actor)
      |                                                |  gate check of the deal
      |                                                |  fails -> 409, nothing changed
      v                                                v
    one transaction: deals.paused_at / pause_reason set (cleared), and a zero-delta
    ledger row (reason 'pause' / 'resume', the actor, the why) -- only when the
    state changes: a second pause or resume changes and ledgers nothing
      |
    COMMIT, then each of the deal's Redis states gets "paused" 1 (0) in its meta
    hash (lua/deal_pause.lua), which lua/admit.lua reads in the call it makes
    anyway: a paused deal's reservations answer 503 SALE_PAUSED, and the room
    (lua/room_advance.lua) admits nobody while tickets keep their places.

The database is the truth. A Redis state loaded or resynced takes the flag from the
deals row (lua/sync_deal.lua); every gate process re-reads the paused deals each
invariant interval (`PauseWatch`) and writes the flag again, which closes the window
in which a resync that read the row just before a pause wrote the old value.
Reservations already admitted when the flag lands finish; payments of existing
holds still complete.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from gate.base import validate
from gate.base.clock import iso
from gate.base.errors import Problem, not_found
from gate.base.metrics import METRICS
from gate.inventory import store
from gate.inventory.check import check_deal
from gate.inventory.deals import ledger_note
from gate.inventory.mirror import Mirror
from gate.store.db import Database
from gate.store.scripts import lua_source

log = logging.getLogger("gate.pause")

REASON_MAX_CHARS = 255
# Paused deals one read of `PauseWatch` takes at most (a gate runs few deals).
WATCH_DEALS_MAX = 1000
BREACHES_NAMED_MAX = 3

PAUSED = METRICS.gauge(
    "gate_deal_paused",
    "1 while the deal's sale is paused (by the invariant monitor or by hand), as this"
    " process last read it.",
    ["deal"],
    kind="flag",
)


@dataclass(frozen=True)
class PauseState:
    deal_id: int
    paused: bool
    paused_at: datetime | None
    reason: str | None

    def view(self) -> dict[str, Any]:
        return {
            "deal_id": self.deal_id,
            "paused": self.paused,
            "paused_at": iso(self.paused_at),
            "reason": self.reason,
        }


async def state(db: Database, deal_id: int) -> PauseState:
    """The deal's pause as the database says; 404 for no such deal."""
    row = await store.pause_row(db, deal_id)
    if row is None:
        raise not_found("deal")
    return PauseState(deal_id, row[0] is not None, row[0], row[1])


async def _set(
    db: Database,
    deal_id: int,
    paused: bool,
    reason: str,
    actor: str,
    seen_at: datetime | None = None,
) -> bool:
    """The row changed and ledgered in one transaction; False when it was already so,
    or (a pause with `seen_at`) when the deal was resumed after `seen_at`."""
    async with db.connection() as conn, conn.cursor() as cur:
        await store.begin(cur)
        try:
            if paused:
                changed = await store.set_paused(cur, deal_id, reason[:REASON_MAX_CHARS], seen_at)
            else:
                changed = await store.set_resumed(cur, deal_id)
            if changed:
                await ledger_note(cur, deal_id, "pause" if paused else "resume", actor, reason)
        except BaseException:
            await store.rollback(cur)
            raise
        await store.commit(cur)
    return changed


@functools.cache
def _flag_source() -> str:
    return lua_source("deal_pause")


async def mirror_flag(mirror: Mirror, deal_id: int, paused: bool) -> int:
    """Write the flag into each of the deal's Redis states that exists; how many."""
    source = _flag_source()
    parts = await mirror.partitions(deal_id)
    written = 0
    for keys in mirror.keys_of(deal_id, parts):
        written += int(await mirror.redis.eval(source, 1, keys.meta, "1" if paused else "0"))
    return written


async def pause(
    db: Database,
    mirror: Mirror,
    deal_id: int,
    *,
    reason: str,
    actor: str,
    seen_at: datetime | None = None,
) -> dict[str, Any]:
    """Pause the deal's sale (nothing changes when it is paused already). `seen_at`
    (the invariant monitor's): the database time before the check that found the
    books broken; a deal resumed since then is left selling (the resume's own check
    saw the books after that one did)."""
    await state(db, deal_id)
    reason = reason.strip() or "paused by hand"
    changed = await _set(db, deal_id, True, reason, actor, seen_at)
    now = await state(db, deal_id)
    if not now.paused:
        log.warning(
            "deal %s: resumed after the check that found it broken; not paused",
            deal_id,
            extra={"deal_id": deal_id},
        )
        return {**now.view(), "changed": False}
    await mirror_flag(mirror, deal_id, True)
    PAUSED.labels(str(deal_id)).set(1)
    if changed:
        log.error(
            "deal %s paused by %s: %s",
            deal_id,
            actor,
            reason,
            extra={"deal_id": deal_id, "actor": actor},
        )
    return {**now.view(), "changed": changed}


async def resume(
    db: Database, mirror: Mirror, deal_id: int, *, actor: str, note: str = ""
) -> dict[str, Any]:
    """Resume the deal's sale, only when `gate check` of the deal passes: a 409
    naming the breaches otherwise, and nothing changed."""
    before = await state(db, deal_id)
    report = await check_deal(db, mirror.redis, deal_id)
    breaches = list(report["invariant"]["breaches"])
    if breaches:
        shown = "; ".join(breaches[:BREACHES_NAMED_MAX])
        raise Problem(
            "CONFLICT",
            f"Deal {deal_id} stays paused: `gate check --deal {deal_id}` finds"
            f" {len(breaches)} breach(es): {shown}. Repair the books first"
            f" (gate deal repair {deal_id}), then resume.",
            extra={"breaches": breaches[:20], "paused": before.paused},
        )
    changed = await _set(db, deal_id, False, note.strip() or "gate check passes", actor)
    await mirror_flag(mirror, deal_id, False)
    PAUSED.labels(str(deal_id)).set(0)
    if changed:
        log.warning("deal %s resumed by %s", deal_id, actor, extra={"deal_id": deal_id})
    return {**(await state(db, deal_id)).view(), "changed": changed}


def pause_body(body: Any) -> str:
    """POST /v1/admin/deals/{id}/pause's body: {"reason": "…"}, the ledger's why."""
    body = validate.obj(body)
    validate.no_unknown(body, {"reason"})
    return validate.string(body, "reason", REASON_MAX_CHARS)


def resume_body(body: Any) -> str:
    """POST /v1/admin/deals/{id}/resume's body: {} or {"note": "…"} for the ledger."""
    body = validate.obj(body)
    validate.no_unknown(body, {"note"})
    return validate.string(body, "note", REASON_MAX_CHARS, default="")


def breach_reason(breaches: tuple[str, ...] | list[str]) -> str:
    """The ledger's why of a pause by the invariant monitor."""
    named = "; ".join(breaches[:BREACHES_NAMED_MAX])
    more = f" (+{len(breaches) - BREACHES_NAMED_MAX} more)" if len(breaches) > 3 else ""
    return f"books broken: {named}{more}"[:REASON_MAX_CHARS]


class PauseWatch:
    """Every gate process, each invariant interval: the paused deals read from the
    database, exported (gate_deal_paused) and their Redis flag written again; a deal
    resumed since the last read gets its gauge and flag back to 0."""

    def __init__(self, db: Database, mirror: Mirror) -> None:
        self.db = db
        self.mirror = mirror
        self.paused: set[int] = set()

    async def run_once(self) -> set[int]:
        now = set(await store.paused_deal_ids(self.db, WATCH_DEALS_MAX))
        for deal_id in now:
            await mirror_flag(self.mirror, deal_id, True)
            PAUSED.labels(str(deal_id)).set(1)
        for deal_id in self.paused - now:
            await mirror_flag(self.mirror, deal_id, False)
            PAUSED.labels(str(deal_id)).set(0)
        self.paused = now
        return now
