"""Queue mode's panel of the live console (docs/console.md, "Queue mode").

console snapshot (at most once a second per process)
    --> QueuePanel.fields(shown deal ids)
          database  one query: each deal's mode and its dead letters (all, and
                    those waiting for a retry)
          Redis     one pipeline (cli.py queue_heads) for the deals in queue mode or with
                    dead letters: each stream's length and oldest entry
    --> per such deal: "queue" {mode, depth, oldest_age_seconds, dead_letters,
        dead_letters_waiting}

POST /console/api/deals/{id}/retry_dead_letters {}
    --> the deal's dead letters waiting for a retry (at most RETRY_PER_ACTION_MAX,
        oldest first), each through `gate queue retry`'s own code
        (gate/queuemode/cli.py retry_dead_letter: claimed, re-submitted through
        the reservation path, its outcome recorded; exactly once per dead letter)
    --> a ledger note (reason dead_letter_retry) naming the operator's session and
        what the retries came to
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from gate.base import validate
from gate.base.errors import Problem, not_found
from gate.extensions import ConsoleAction
from gate.inventory.deals import ledger_note
from gate.queuemode.cli import RETRY_CLAIM_SECONDS, queue_heads, retry_dead_letter

if TYPE_CHECKING:
    from gate.runtime import Gate

RETRY_REASON = "dead_letter_retry"
# Dead letters one console action retries: each is a reservation of its own.
RETRY_PER_ACTION_MAX = 100
# A dead letter waits for a retry until one has an outcome; a claim with none older
# than the CLI's takeover age was made by a retry that died (gate/queuemode/cli.py).
_WAITING = (
    "(retried_at IS NULL OR (retried_outcome IS NULL AND retried_order_id IS NULL"
    " AND retried_at < NOW(6) - INTERVAL %s SECOND))"
)


class QueuePanel:
    def __init__(self, gate: Gate) -> None:
        self.gate = gate
        self.actions: Mapping[str, ConsoleAction] = {"retry_dead_letters": self.retry}

    async def fields(self, deal_ids: list[int]) -> dict[int, dict[str, Any]]:
        if not deal_ids:
            return {}
        marks = ",".join(["%s"] * len(deal_ids))
        rows = await self.gate.db.fetchall(
            # COUNT and SUM over the joined rows only: a deal without dead letters has
            # one row of NULLs, which is no dead letter.
            "SELECT d.id, d.mode, COUNT(l.id), COALESCE(SUM(l.id IS NOT NULL AND "
            + _WAITING
            + "), 0)"
            " FROM deals d LEFT JOIN queue_dead_letters l ON l.deal_id = d.id"
            f" WHERE d.id IN ({marks}) GROUP BY d.id, d.mode",
            (RETRY_CLAIM_SECONDS, *deal_ids),
        )
        # A deal switched back to sync keeps its panel while it has dead letters.
        shown = {
            int(r[0]): (str(r[1]), int(r[2]), int(r[3]))
            for r in rows
            if str(r[1]) == "queue" or int(r[2]) > 0
        }
        heads = await queue_heads(self.gate.redis, sorted(shown))
        return {
            deal_id: {
                "queue": {
                    "mode": mode,
                    "depth": heads[deal_id][0],
                    "oldest_age_seconds": heads[deal_id][1],
                    "dead_letters": letters,
                    "dead_letters_waiting": waiting,
                }
            }
            for deal_id, (mode, letters, waiting) in shown.items()
        }

    async def retry(self, deal_id: int, body: Any, actor: str) -> dict[str, Any]:
        """Retry the deal's dead letters that wait for one (the body: {})."""
        validate.no_unknown(validate.obj(body), set())
        if await self.gate.db.fetchone("SELECT 1 FROM deals WHERE id = %s", (deal_id,)) is None:
            raise not_found("deal")
        rows = await self.gate.db.fetchall(
            f"SELECT id FROM queue_dead_letters WHERE deal_id = %s AND {_WAITING}"
            " ORDER BY id LIMIT %s",
            (deal_id, RETRY_CLAIM_SECONDS, RETRY_PER_ACTION_MAX),
        )
        if not rows:
            raise Problem("CONFLICT", "No dead letter of this deal waits for a retry.")
        results = []
        for (entry_id,) in rows:
            code, message = await retry_dead_letter(self.gate, int(entry_id))
            results.append(
                {"entry_id": int(entry_id), "resubmitted": code == 0, "message": message}
            )
        resubmitted = sum(1 for r in results if r["resubmitted"])
        note = (
            f"{len(results)} dead letter(s) retried, {resubmitted} re-submitted;"
            f" ids {','.join(str(r['entry_id']) for r in results)}"
        )
        async with self.gate.db.connection() as conn, conn.cursor() as cur:
            await ledger_note(cur, deal_id, RETRY_REASON, actor, note)
        return {
            "deal_id": deal_id,
            "retried": len(results),
            "resubmitted": resubmitted,
            "results": results,
        }
