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
from gate.queuemode import store
from gate.queuemode.cli import RETRY_CLAIM_SECONDS, queue_heads, retry_dead_letter

if TYPE_CHECKING:
    from gate.runtime import Gate

RETRY_REASON = "dead_letter_retry"
# Dead letters one console action retries: each is a reservation of its own.
RETRY_PER_ACTION_MAX = 100


class QueuePanel:
    def __init__(self, gate: Gate) -> None:
        self.gate = gate
        self.actions: Mapping[str, ConsoleAction] = {"retry_dead_letters": self.retry}

    async def fields(self, deal_ids: list[int]) -> dict[int, dict[str, Any]]:
        if not deal_ids:
            return {}
        rows = await store.panel_rows(self.gate.db, deal_ids, RETRY_CLAIM_SECONDS)
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
        if not await store.deal_exists(self.gate.db, deal_id):
            raise not_found("deal")
        rows = await store.waiting_dead_letters(
            self.gate.db, deal_id, RETRY_CLAIM_SECONDS, RETRY_PER_ACTION_MAX
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
