"""Every SQL statement of the webhooks (db/070_webhooks.sql holds the tables).

    endpoints     create (the count bounded under the 'endpoints' lock row), read,
                  update, soft delete, rotate
    fan_out       outbox rows ──> events + deliveries, rows marked (one transaction)
    deal edges    webhook_deal_state ──> deal events (one transaction)
    claim         due deliveries of the endpoints asked, FOR UPDATE SKIP LOCKED, each
                  claimed for `claim_seconds` under a token (one transaction)
    record        attempts, deliveries' new states fenced by their claim token,
                  endpoints' health, hourly stats (one transaction)
    maintain      endpoints failing for 5 days disabled, old rows purged in bounded
                  batches, the backlog gauges

Transactions are short and never span an HTTP call: a slow receiver holds no
connection and no lock.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import orjson

from gate.store.db import Database
from gate.webhooks import events as ev
from gate.webhooks.model import (
    Claimed,
    Endpoint,
    Recorded,
    TooManyEndpoints,
    delivery_view,
    iso_z,
    short_text,
)

ENDPOINT_COLUMNS = (
    "id, url, events, description, status, disabled_reason, secret, previous_secret,"
    " previous_until IS NOT NULL AND previous_until > NOW(6), failing_since, last_success_at,"
    " created_at, updated_at"
)
ENDPOINTS_LISTED_MAX = 1000
ATTEMPTS_SHOWN_MAX = 20
# The maintenance pass's bounds: rows deleted per statement, statements per pass.
PURGE_BATCH = 1000
PURGE_ROUNDS = 10
DISABLE_AFTER_DAYS = 5
FAILING_GAUGE_AFTER_SECONDS = 3600
# Deal events: at most this many deals looked at per pass (by id, round-robin).
DEALS_PER_PASS = 500


class WebhookStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    # -- endpoints ---------------------------------------------------------------------

    async def create_endpoint(
        self,
        endpoint_id: str,
        url: str,
        events: list[str],
        description: str,
        sealed: str,
        endpoints_max: int,
    ) -> Endpoint:
        async with self.db.connection() as conn, conn.cursor() as cur:
            await cur.execute("START TRANSACTION")
            await cur.execute("SELECT name FROM webhook_locks WHERE name = 'endpoints' FOR UPDATE")
            await cur.execute(
                "SELECT COUNT(*), COALESCE(SUM(status = 'enabled'), 0) FROM webhook_endpoints"
                " WHERE status <> 'deleted'"
            )
            count, enabled = (int(x) for x in (await cur.fetchone()))
            if count >= endpoints_max:
                await cur.execute("ROLLBACK")
                raise TooManyEndpoints
            if enabled == 0:
                await _switch_on(cur)
            await cur.execute(
                "INSERT INTO webhook_endpoints (id, url, events, description, status, secret,"
                " created_at, updated_at) VALUES (%s, %s, %s, %s, 'enabled', %s, NOW(6), NOW(6))",
                (endpoint_id, url, json.dumps(events), description, sealed),
            )
            await cur.execute(
                f"SELECT {ENDPOINT_COLUMNS} FROM webhook_endpoints WHERE id = %s", (endpoint_id,)
            )
            row = await cur.fetchone()
            await cur.execute("COMMIT")
        return Endpoint.from_row(row)

    async def endpoint(self, endpoint_id: str) -> Endpoint | None:
        row = await self.db.fetchone(
            f"SELECT {ENDPOINT_COLUMNS} FROM webhook_endpoints WHERE id = %s"
            " AND status <> 'deleted'",
            (endpoint_id,),
        )
        return Endpoint.from_row(row) if row else None

    async def endpoints(self, *, enabled_only: bool = False) -> list[Endpoint]:
        where = "status = 'enabled'" if enabled_only else "status <> 'deleted'"
        rows = await self.db.fetchall(
            f"SELECT {ENDPOINT_COLUMNS} FROM webhook_endpoints WHERE {where}"
            " ORDER BY created_at, id LIMIT %s",
            (ENDPOINTS_LISTED_MAX,),
        )
        return [Endpoint.from_row(r) for r in rows]

    async def update_endpoint(self, endpoint_id: str, changes: dict[str, Any]) -> Endpoint | None:
        """Apply `changes` (url, events, description, status); None when there is no
        such endpoint. Enabling the first endpoint switches webhooks on (the floor)."""
        sets: list[str] = ["updated_at = NOW(6)"]
        args: list[Any] = []
        for name in ("url", "description"):
            if name in changes:
                sets.append(f"{name} = %s")
                args.append(changes[name])
        if "events" in changes:
            sets.append("events = %s")
            args.append(json.dumps(changes["events"]))
        if "status" in changes:
            sets.append("status = %s")
            args.append(changes["status"])
            if changes["status"] == "enabled":
                sets.append("disabled_reason = NULL, failing_since = NULL")
            else:
                sets.append("disabled_reason = %s")
                args.append(changes.get("disabled_reason", "manual"))
        async with self.db.connection() as conn, conn.cursor() as cur:
            await cur.execute("START TRANSACTION")
            await cur.execute("SELECT name FROM webhook_locks WHERE name = 'endpoints' FOR UPDATE")
            await cur.execute(
                "SELECT status FROM webhook_endpoints WHERE id = %s AND status <> 'deleted'"
                " FOR UPDATE",
                (endpoint_id,),
            )
            found = await cur.fetchone()
            if found is None:
                await cur.execute("ROLLBACK")
                return None
            if changes.get("status") == "enabled" and found[0] != "enabled":
                await cur.execute("SELECT COUNT(*) FROM webhook_endpoints WHERE status = 'enabled'")
                if int((await cur.fetchone())[0]) == 0:
                    await _switch_on(cur)
            await cur.execute(
                f"UPDATE webhook_endpoints SET {', '.join(sets)} WHERE id = %s",
                (*args, endpoint_id),
            )
            await cur.execute(
                f"SELECT {ENDPOINT_COLUMNS} FROM webhook_endpoints WHERE id = %s", (endpoint_id,)
            )
            row = await cur.fetchone()
            await cur.execute("COMMIT")
        return Endpoint.from_row(row)

    async def delete_endpoint(self, endpoint_id: str) -> bool:
        """Soft: the row stays (status 'deleted', nothing sent) until maintenance has
        purged its deliveries."""
        return (
            await self.db.execute(
                "UPDATE webhook_endpoints SET status = 'deleted', updated_at = NOW(6)"
                " WHERE id = %s AND status <> 'deleted'",
                (endpoint_id,),
            )
            == 1
        )

    async def rotate(self, endpoint_id: str, sealed: str, overlap_seconds: int) -> bool:
        """The new secret signs from now; the current one signs beside it for the
        overlap, then stops (a rotation within the overlap drops the older one)."""
        return (
            await self.db.execute(
                "UPDATE webhook_endpoints SET previous_secret = secret,"
                " previous_until = NOW(6) + INTERVAL %s SECOND, secret = %s,"
                " updated_at = NOW(6) WHERE id = %s AND status <> 'deleted'",
                (overlap_seconds, sealed, endpoint_id),
            )
            == 1
        )

    async def stats(self, endpoint_ids: list[str]) -> dict[str, dict[str, int]]:
        """Per endpoint: attempts and delivered ones in the last 24 hours, deliveries
        pending and failed."""
        out: dict[str, dict[str, int]] = {
            e: {"attempts_24h": 0, "delivered_24h": 0, "pending": 0, "failed": 0}
            for e in endpoint_ids
        }
        if not endpoint_ids:
            return out
        marks = ",".join(["%s"] * len(endpoint_ids))
        rows = await self.db.fetchall(
            "SELECT endpoint_id, COALESCE(SUM(attempts), 0), COALESCE(SUM(delivered), 0)"
            f" FROM webhook_endpoint_stats WHERE endpoint_id IN ({marks})"
            " AND hour >= DATE_FORMAT(NOW(6) - INTERVAL 23 HOUR, '%%Y-%%m-%%d %%H:00:00')"
            " GROUP BY endpoint_id",
            endpoint_ids,
        )
        for endpoint_id, attempts, delivered in rows:
            out[str(endpoint_id)].update(attempts_24h=int(attempts), delivered_24h=int(delivered))
        rows = await self.db.fetchall(
            "SELECT endpoint_id, status, COUNT(*) FROM webhook_deliveries"
            f" WHERE endpoint_id IN ({marks}) AND status IN ('pending', 'failed')"
            " GROUP BY endpoint_id, status",
            endpoint_ids,
        )
        for endpoint_id, status, count in rows:
            out[str(endpoint_id)][str(status)] = int(count)
        return out

    # -- deliveries --------------------------------------------------------------------

    async def deliveries(
        self, endpoint_id: str, status: str | None, limit: int, after: int | None
    ) -> list[dict[str, Any]]:
        """Newest first; `after` the last id of the previous page."""
        where = ["d.endpoint_id = %s"]
        args: list[Any] = [endpoint_id]
        if status is not None:
            where.append("d.status = %s")
            args.append(status)
        if after is not None:
            where.append("d.id < %s")
            args.append(after)
        rows = await self.db.fetchall(
            "SELECT d.id, e.event_id, e.type, d.status, d.attempts, d.next_attempt_at,"
            " d.last_status, d.last_error, d.created_at, d.updated_at, d.delivered_at"
            " FROM webhook_deliveries d JOIN webhook_events e ON e.id = d.event_row"
            f" WHERE {' AND '.join(where)} ORDER BY d.id DESC LIMIT %s",
            (*args, limit),
        )
        found = [delivery_view(r) for r in rows]
        if not found:
            return found
        marks = ",".join(["%s"] * len(found))
        attempts = await self.db.fetchall(
            "SELECT delivery_id, attempt, started_at, duration_ms, http_status, error FROM"
            " (SELECT a.*, ROW_NUMBER() OVER (PARTITION BY delivery_id ORDER BY id DESC) AS n"
            f" FROM webhook_attempts a WHERE delivery_id IN ({marks})) AS t"
            " WHERE n <= %s ORDER BY delivery_id, id",
            (*(d["id"] for d in found), ATTEMPTS_SHOWN_MAX),
        )
        by_id = {d["id"]: d for d in found}
        for delivery_id, attempt, started, duration_ms, http_status, error in attempts:
            by_id[int(delivery_id)]["attempts"].append(
                {
                    "attempt": int(attempt),
                    "at": iso_z(started),
                    "duration_ms": int(duration_ms),
                    "http_status": None if http_status is None else int(http_status),
                    "error": error,
                }
            )
        return found

    async def failed(self, endpoint_ids: list[str], per_endpoint: int) -> list[dict[str, Any]]:
        """The latest failed deliveries of each endpoint (each read along its index)."""
        if not endpoint_ids:
            return []
        one = (
            "(SELECT d.id, e.event_id, e.type, d.status, d.attempts, d.next_attempt_at,"
            " d.last_status, d.last_error, d.created_at, d.updated_at, d.delivered_at,"
            " d.endpoint_id FROM webhook_deliveries d JOIN webhook_events e"
            " ON e.id = d.event_row WHERE d.endpoint_id = %s AND d.status = 'failed'"
            " ORDER BY d.id DESC LIMIT %s)"
        )
        rows = await self.db.fetchall(
            " UNION ALL ".join([one] * len(endpoint_ids)),
            [x for e in endpoint_ids for x in (e, per_endpoint)],
        )
        return [{**delivery_view(r), "endpoint_id": str(r[11])} for r in rows]

    async def retry(self, endpoint_id: str, delivery_id: int) -> bool:
        """Send again now, as a new round of the schedule (an attempt in flight is
        left to finish: its claim stands)."""
        async with self.db.connection() as conn, conn.cursor() as cur:
            await cur.execute("START TRANSACTION")
            await cur.execute(
                "SELECT claim, status FROM webhook_deliveries WHERE id = %s AND endpoint_id = %s"
                " FOR UPDATE",
                (delivery_id, endpoint_id),
            )
            row = await cur.fetchone()
            if row is None:
                await cur.execute("ROLLBACK")
                return False
            if row[0] is None:
                await cur.execute(
                    "UPDATE webhook_deliveries SET status = 'pending', attempts = 0,"
                    " next_attempt_at = NOW(6), updated_at = NOW(6) WHERE id = %s",
                    (delivery_id,),
                )
            await cur.execute("COMMIT")
        return True

    async def add_test_event(self, endpoint_id: str, event_id: str, body: bytes) -> int:
        """A webhook.test event for this endpoint alone, its delivery due now."""
        async with self.db.connection() as conn, conn.cursor() as cur:
            await cur.execute("START TRANSACTION")
            await cur.execute(
                "INSERT INTO webhook_events (event_id, type, aggregate_id, sequence, body,"
                " endpoint_id, created_at, fanned_out_at)"
                " VALUES (%s, %s, %s, 0, %s, %s, NOW(6), NOW(6))",
                (event_id, ev.TEST_TYPE, endpoint_id, body.decode(), endpoint_id),
            )
            event_row = cur.lastrowid
            await cur.execute(
                "INSERT INTO webhook_deliveries (endpoint_id, event_row, next_attempt_at)"
                " VALUES (%s, %s, NOW(6))",
                (endpoint_id, event_row),
            )
            delivery_id = int(cur.lastrowid)
            await cur.execute("COMMIT")
        return delivery_id

    # -- fan-out -----------------------------------------------------------------------

    async def fan_out(self, batch_max: int) -> int:
        """One batch of outbox rows and pending deal events into deliveries; the number
        of events that got deliveries."""
        async with self.db.connection() as conn, conn.cursor() as cur:
            await cur.execute("START TRANSACTION")
            await cur.execute(
                "SELECT id, events FROM webhook_endpoints WHERE status = 'enabled' LIMIT %s",
                (ENDPOINTS_LISTED_MAX,),
            )
            endpoints = [(str(r[0]), list(json.loads(r[1]))) for r in await cur.fetchall()]
            if not endpoints:
                # Deal events made while no endpoint is enabled go to nobody.
                await cur.execute(
                    "UPDATE webhook_events SET fanned_out_at = NOW(6) WHERE fanned_out_at IS NULL"
                    " LIMIT %s",
                    (batch_max,),
                )
                await cur.execute("COMMIT")
                return 0
            await cur.execute("SELECT outbox_floor FROM webhook_cursor WHERE name = 'outbox'")
            floor_row = await cur.fetchone()
            floor = int(floor_row[0]) if floor_row else 0
            # Locking, not skipping: a row whose transaction has not committed is
            # waited for, so rows are handled in id order (the sequences depend on it).
            await cur.execute(
                "SELECT id, event_id, topic, aggregate_id, payload, created_at FROM outbox"
                " WHERE webhooks_at IS NULL AND id > %s ORDER BY id LIMIT %s FOR UPDATE",
                (floor, batch_max),
            )
            rows = await cur.fetchall()
            made = await _events_from_outbox(cur, rows)
            await cur.execute(
                "SELECT id, type, endpoint_id FROM webhook_events WHERE fanned_out_at IS NULL"
                " ORDER BY id LIMIT %s FOR UPDATE",
                (batch_max,),
            )
            waiting = [(int(r[0]), str(r[1]), r[2]) for r in await cur.fetchall()]
            deliveries = [
                (endpoint_id, event_row)
                for event_row, event_type, target in [*made, *waiting]
                for endpoint_id, events in endpoints
                if ev.subscribed(events, event_type, endpoint_id, target)
            ]
            if deliveries:
                values = ",".join(["(%s, %s, NOW(6), NOW(6), NOW(6))"] * len(deliveries))
                await cur.execute(
                    "INSERT IGNORE INTO webhook_deliveries (endpoint_id, event_row,"
                    f" next_attempt_at, created_at, updated_at) VALUES {values}",
                    [x for pair in deliveries for x in pair],
                )
            if rows:
                marks = ",".join(["%s"] * len(rows))
                await cur.execute(
                    f"UPDATE outbox SET webhooks_at = NOW(6) WHERE id IN ({marks})",
                    [int(r[0]) for r in rows],
                )
            if waiting:
                marks = ",".join(["%s"] * len(waiting))
                await cur.execute(
                    f"UPDATE webhook_events SET fanned_out_at = NOW(6) WHERE id IN ({marks})",
                    [w[0] for w in waiting],
                )
            await cur.execute("COMMIT")
        return len(made) + len(waiting)

    async def deal_edges(self, after_deal_id: int) -> tuple[list[tuple[int, str, int]], int]:
        """One pass of the deal watcher over at most DEALS_PER_PASS deals above
        `after_deal_id`: each deal whose sold-out state changed gets its event (the
        state row locked first: two watchers cannot both see the same edge). Returns
        the events made (deal id, type, sequence) and the last deal id looked at (0:
        the pass reached the end)."""
        async with self.db.connection() as conn, conn.cursor() as cur:
            await cur.execute("START TRANSACTION")
            await cur.execute(
                "SELECT id FROM deals WHERE id > %s AND (ends_at IS NULL OR ends_at >"
                " NOW(6) - INTERVAL 1 DAY) ORDER BY id LIMIT %s",
                (after_deal_id, DEALS_PER_PASS),
            )
            deal_ids = [int(r[0]) for r in await cur.fetchall()]
            if not deal_ids:
                await cur.execute("COMMIT")
                return [], 0
            marks = ",".join(["%s"] * len(deal_ids))
            await cur.execute(
                "SELECT deal_id, sold_out, sequence FROM webhook_deal_state"
                f" WHERE deal_id IN ({marks}) FOR UPDATE",
                deal_ids,
            )
            states = {int(r[0]): (bool(r[1]), int(r[2])) for r in await cur.fetchall()}
            await cur.execute(
                "SELECT b.deal_id, SUM(b.available), SUM(b.total) FROM deal_buckets b"
                " JOIN deals d ON d.id = b.deal_id AND b.epoch = d.layout_epoch"
                f" WHERE b.deal_id IN ({marks}) GROUP BY b.deal_id",
                deal_ids,
            )
            made: list[tuple[int, str, int]] = []
            for deal_id, available, total in await cur.fetchall():
                deal_id, available, total = int(deal_id), int(available), int(total)
                sold_out = total > 0 and available == 0
                before = states.get(deal_id)
                if before is not None and before[0] == sold_out:
                    continue
                if before is None and not sold_out:
                    # First sight of a deal with units: its state, no event.
                    await cur.execute(
                        "INSERT INTO webhook_deal_state (deal_id, sold_out, sequence,"
                        " changed_at) VALUES (%s, 0, 0, NOW(6))",
                        (deal_id,),
                    )
                    continue
                sequence = (before[1] if before else 0) + 1
                event_type = ev.DEAL_SOLD_OUT if sold_out else ev.DEAL_AVAILABLE_AGAIN
                await cur.execute(
                    "INSERT INTO webhook_deal_state (deal_id, sold_out, sequence, changed_at)"
                    " VALUES (%s, %s, %s, NOW(6)) ON DUPLICATE KEY UPDATE"
                    " sold_out = VALUES(sold_out), sequence = VALUES(sequence),"
                    " changed_at = VALUES(changed_at)",
                    (deal_id, int(sold_out), sequence),
                )
                await cur.execute("SELECT NOW(6)")
                (now,) = await cur.fetchone()
                data = ev.deal_data(deal_id, sequence, available, total)
                await cur.execute(
                    "INSERT INTO webhook_events (event_id, type, aggregate_id, sequence, body,"
                    " created_at) VALUES (%s, %s, %s, %s, %s, %s)",
                    (
                        f"deal_{deal_id}_{sequence}",
                        event_type,
                        str(deal_id),
                        sequence,
                        ev.body(event_type, now, data).decode(),
                        now,
                    ),
                )
                made.append((deal_id, event_type, sequence))
            await cur.execute("COMMIT")
        last = deal_ids[-1] if len(deal_ids) == DEALS_PER_PASS else 0
        return made, last

    # -- claims and outcomes -----------------------------------------------------------

    async def claim(
        self, wants: dict[str, int], claim_seconds: float, token: str
    ) -> tuple[list[Claimed], list[int]]:
        """Claim up to wants[endpoint] due deliveries of each endpoint. Returns the
        claimed ones and the ids among them whose previous claim had lapsed (their
        sender died mid-attempt: that attempt is recorded as interrupted)."""
        wants = {e: n for e, n in wants.items() if n > 0}
        if not wants:
            return [], []
        async with self.db.connection() as conn, conn.cursor() as cur:
            await cur.execute("START TRANSACTION")
            ids: list[int] = []
            lapsed: list[int] = []
            for endpoint_id, count in wants.items():
                await cur.execute(
                    "SELECT id, claim IS NOT NULL FROM webhook_deliveries WHERE endpoint_id = %s"
                    " AND status = 'pending' AND next_attempt_at <= NOW(6)"
                    " ORDER BY next_attempt_at LIMIT %s FOR UPDATE SKIP LOCKED",
                    (endpoint_id, count),
                )
                for delivery_id, was_claimed in await cur.fetchall():
                    ids.append(int(delivery_id))
                    if was_claimed:
                        lapsed.append(int(delivery_id))
            if not ids:
                await cur.execute("COMMIT")
                return [], []
            marks = ",".join(["%s"] * len(ids))
            if lapsed:
                lapsed_marks = ",".join(["%s"] * len(lapsed))
                await cur.execute(
                    "INSERT INTO webhook_attempts (delivery_id, attempt, started_at, duration_ms,"
                    " error) SELECT id, attempts, updated_at,"
                    " LEAST(TIMESTAMPDIFF(MICROSECOND, updated_at, NOW(6)) DIV 1000, 4294967295),"
                    " 'interrupted: its sender stopped before the answer was recorded'"
                    f" FROM webhook_deliveries WHERE id IN ({lapsed_marks})",
                    lapsed,
                )
            await cur.execute(
                "UPDATE webhook_deliveries SET claim = %s, attempts = LEAST(attempts + 1, 65535),"
                " next_attempt_at = NOW(6) + INTERVAL %s MICROSECOND, updated_at = NOW(6)"
                f" WHERE id IN ({marks})",
                (token, int(claim_seconds * 1e6), *ids),
            )
            await cur.execute(
                "SELECT d.id, d.endpoint_id, d.attempts, e.event_id, e.body, e.created_at"
                " FROM webhook_deliveries d JOIN webhook_events e ON e.id = d.event_row"
                f" WHERE d.id IN ({marks})",
                ids,
            )
            rows = await cur.fetchall()
            await cur.execute("COMMIT")
        claimed = [
            Claimed(
                int(r[0]),
                str(r[1]),
                int(r[2]),
                str(r[3]),
                r[4].encode("utf-8") if isinstance(r[4], str) else bytes(r[4]),
                r[5],
                token,
            )
            for r in rows
        ]
        return claimed, lapsed

    async def record(self, done: list[Recorded]) -> list[str]:
        """Every finished attempt in one transaction: its row, its delivery's state
        (only while the attempt's claim still stands: a sender that was too slow and
        was replaced records its attempt, not the delivery's state), the endpoints'
        health and hourly stats. Returns the endpoints disabled for a 410."""
        if not done:
            return []
        gone: list[str] = []
        async with self.db.connection() as conn, conn.cursor() as cur:
            await cur.execute("START TRANSACTION")
            values = ",".join(["(%s, %s, %s, %s, %s, %s)"] * len(done))
            await cur.execute(
                "INSERT INTO webhook_attempts (delivery_id, attempt, started_at, duration_ms,"
                f" http_status, error) VALUES {values}",
                [
                    x
                    for r in done
                    for x in (
                        r.claimed.delivery_id,
                        min(r.claimed.attempt, 65535),
                        r.started_at,
                        min(r.duration_ms, 4_294_967_295),
                        r.http_status,
                        short_text(r.error),
                    )
                ],
            )
            # The common case, delivered, in one statement per claim token and status;
            # retries and failures (rarer) one statement each.
            delivered: dict[tuple[str, int | None], list[int]] = defaultdict(list)
            for r in done:
                if r.state == "delivered":
                    delivered[(r.claimed.token, r.http_status)].append(r.claimed.delivery_id)
                    continue
                failed = r.state == "failed"
                await cur.execute(
                    "UPDATE webhook_deliveries SET claim = NULL, last_status = %s,"
                    " last_error = %s, status = IF(%s, 'failed', 'pending'),"
                    " next_attempt_at = NOW(6) + INTERVAL %s MICROSECOND,"
                    " updated_at = NOW(6) WHERE id = %s AND claim = %s",
                    (
                        r.http_status,
                        short_text(r.error),
                        failed,
                        0 if failed else int(r.next_delay_seconds * 1e6),
                        r.claimed.delivery_id,
                        r.claimed.token,
                    ),
                )
            for (token, http_status), ids in delivered.items():
                marks = ",".join(["%s"] * len(ids))
                await cur.execute(
                    "UPDATE webhook_deliveries SET status = 'delivered', claim = NULL,"
                    " last_status = %s, last_error = NULL, delivered_at = NOW(6),"
                    f" updated_at = NOW(6) WHERE id IN ({marks}) AND claim = %s",
                    (http_status, *ids, token),
                )
            await _endpoint_health(cur, done)
            for endpoint_id in sorted({r.claimed.endpoint_id for r in done if r.gone}):
                await cur.execute(
                    "UPDATE webhook_endpoints SET status = 'disabled', disabled_reason = 'gone',"
                    " updated_at = NOW(6) WHERE id = %s AND status = 'enabled'",
                    (endpoint_id,),
                )
                if cur.rowcount == 1:
                    gone.append(endpoint_id)
            await cur.execute("COMMIT")
        return gone

    # -- maintenance -------------------------------------------------------------------

    async def disable_failing(self) -> int:
        return await self.db.execute(
            "UPDATE webhook_endpoints SET status = 'disabled', disabled_reason = 'failing',"
            " updated_at = NOW(6) WHERE status = 'enabled'"
            f" AND failing_since < NOW(6) - INTERVAL {DISABLE_AFTER_DAYS} DAY"
        )

    async def backlog(self) -> tuple[int, float, int]:
        """Pending deliveries of enabled endpoints, how long the most overdue one has
        been due (seconds), enabled endpoints failing for an hour or more."""
        row = await self.db.fetchone(
            "SELECT COUNT(*), COALESCE(MAX(TIMESTAMPDIFF(MICROSECOND, d.next_attempt_at,"
            " NOW(6))), 0) FROM webhook_endpoints e JOIN webhook_deliveries d"
            " ON d.endpoint_id = e.id AND d.status = 'pending'"
            " WHERE e.status = 'enabled'"
        )
        failing = await self.db.fetchone(
            "SELECT COUNT(*) FROM webhook_endpoints WHERE status = 'enabled'"
            " AND failing_since < NOW(6) - INTERVAL %s SECOND",
            (FAILING_GAUGE_AFTER_SECONDS,),
        )
        pending, overdue_us = (int(x) for x in row) if row else (0, 0)
        return pending, max(0.0, overdue_us / 1e6), int(failing[0]) if failing else 0

    async def purge(self, retention_days: int) -> int:
        """Old deliveries (with their attempts), deliveries of deleted endpoints, old
        events and stats, endpoints deleted with nothing left: bounded batches. An
        attempt in flight is left until its claim has lapsed."""
        idle = "(claim IS NULL OR next_attempt_at < NOW(6))"
        deleted = [
            str(r[0])
            for r in await self.db.fetchall(
                "SELECT id FROM webhook_endpoints WHERE status = 'deleted' LIMIT %s",
                (ENDPOINTS_LISTED_MAX,),
            )
        ]
        selects: list[tuple[str, list[Any]]] = [
            (
                f"SELECT id FROM webhook_deliveries WHERE created_at < NOW(6) - INTERVAL %s DAY"
                f" AND {idle} LIMIT %s",
                [retention_days, PURGE_BATCH],
            )
        ]
        if deleted:
            marks = ",".join(["%s"] * len(deleted))
            selects.append(
                (
                    f"SELECT id FROM webhook_deliveries WHERE endpoint_id IN ({marks})"
                    f" AND {idle} LIMIT %s",
                    [*deleted, PURGE_BATCH],
                )
            )
        purged = 0
        for sql, args in selects:
            for _ in range(PURGE_ROUNDS):
                ids = [int(r[0]) for r in await self.db.fetchall(sql, args)]
                if not ids:
                    break
                marks = ",".join(["%s"] * len(ids))
                await self.db.execute(
                    f"DELETE FROM webhook_attempts WHERE delivery_id IN ({marks})", ids
                )
                purged += await self.db.execute(
                    f"DELETE FROM webhook_deliveries WHERE id IN ({marks})", ids
                )
        # A day more for the events: a delivery made a moment after its event was
        # recorded is purged a moment after it too.
        await self.db.execute(
            "DELETE FROM webhook_events WHERE created_at < NOW(6) - INTERVAL %s DAY"
            " AND fanned_out_at IS NOT NULL LIMIT %s",
            (retention_days + 1, PURGE_BATCH * PURGE_ROUNDS),
        )
        await self.db.execute(
            "DELETE FROM webhook_endpoint_stats WHERE hour < NOW(6) - INTERVAL %s DAY",
            (retention_days,),
        )
        if deleted:
            marks = ",".join(["%s"] * len(deleted))
            await self.db.execute(
                f"DELETE FROM webhook_endpoints WHERE id IN ({marks}) AND NOT EXISTS (SELECT 1"
                " FROM webhook_deliveries d WHERE d.endpoint_id = webhook_endpoints.id)",
                deleted,
            )
        return purged


async def _switch_on(cur: Any) -> None:
    """Webhooks go on (no endpoint was enabled): the outbox as it stands now is
    history, never sent; the fan-out starts above it."""
    await cur.execute(
        "UPDATE webhook_cursor SET outbox_floor = GREATEST(outbox_floor,"
        " (SELECT COALESCE(MAX(id), 0) FROM outbox)) WHERE name = 'outbox'"
    )


async def _events_from_outbox(cur: Any, rows: Sequence[Any]) -> list[tuple[int, str, Any]]:
    """The webhook events of these outbox rows (the topics a shop may subscribe to):
    each order's next sequence numbers in id order, the order's facts, the body made
    once. Returns (event row id, type, None) for each."""
    wanted = [r for r in rows if str(r[2]) in ev.OUTBOX_TYPES]
    if not wanted:
        return []
    counts: dict[str, int] = defaultdict(int)
    for r in wanted:
        counts[str(r[3])] += 1
    aggregates = sorted(counts)
    values = ",".join(["(%s, %s)"] * len(aggregates))
    await cur.execute(
        f"INSERT INTO webhook_sequences (aggregate_id, sequence) VALUES {values}"
        " ON DUPLICATE KEY UPDATE sequence = sequence + VALUES(sequence)",
        [x for a in aggregates for x in (a, counts[a])],
    )
    marks = ",".join(["%s"] * len(aggregates))
    await cur.execute(
        f"SELECT aggregate_id, sequence FROM webhook_sequences WHERE aggregate_id IN ({marks})",
        aggregates,
    )
    next_seq = {str(a): int(s) - counts[str(a)] + 1 for a, s in await cur.fetchall()}
    await cur.execute(
        "SELECT id, deal_id, user_id, quantity, amount, currency FROM orders"
        f" WHERE id IN ({marks})",
        aggregates,
    )
    orders = {
        str(r[0]): (int(r[1]), int(r[2]), int(r[3]), int(r[4]), str(r[5]))
        for r in await cur.fetchall()
    }
    made: list[tuple[Any, ...]] = []
    for _outbox_id, event_id, topic, aggregate, payload, created_at in wanted:
        aggregate = str(aggregate)
        sequence = next_seq[aggregate]
        next_seq[aggregate] = sequence + 1
        try:
            facts = orjson.loads(payload)
        except orjson.JSONDecodeError:
            facts = {}
        if not isinstance(facts, dict):
            facts = {}
        data = ev.order_data(facts, orders.get(aggregate), sequence)
        body = ev.body(str(topic), created_at, data).decode()
        made.append((str(event_id), str(topic), aggregate, sequence, body))
    values = ",".join(["(%s, %s, %s, %s, %s, %s, NOW(6))"] * len(made))
    await cur.execute(
        "INSERT IGNORE INTO webhook_events (event_id, type, aggregate_id, sequence, body,"
        f" created_at, fanned_out_at) VALUES {values}",
        [
            x
            for (event_id, topic, aggregate, sequence, body), r in zip(made, wanted, strict=True)
            for x in (event_id, topic, aggregate, sequence, body, r[5])
        ],
    )
    marks = ",".join(["%s"] * len(made))
    await cur.execute(
        f"SELECT id, type FROM webhook_events WHERE event_id IN ({marks})",
        [m[0] for m in made],
    )
    return [(int(r[0]), str(r[1]), None) for r in await cur.fetchall()]


async def _endpoint_health(cur: Any, done: list[Recorded]) -> None:
    """An endpoint with a delivered attempt in the batch is healthy; one with only
    failures is failing since its first (kept). And the hourly stats."""
    ok = sorted({r.claimed.endpoint_id for r in done if r.state == "delivered"})
    bad = sorted({r.claimed.endpoint_id for r in done} - set(ok))
    if ok:
        marks = ",".join(["%s"] * len(ok))
        await cur.execute(
            "UPDATE webhook_endpoints SET failing_since = NULL, last_success_at = NOW(6)"
            f" WHERE id IN ({marks})",
            ok,
        )
    if bad:
        marks = ",".join(["%s"] * len(bad))
        await cur.execute(
            "UPDATE webhook_endpoints SET failing_since = COALESCE(failing_since, NOW(6))"
            f" WHERE id IN ({marks})",
            bad,
        )
    tally: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for r in done:
        tally[r.claimed.endpoint_id][0] += 1
        tally[r.claimed.endpoint_id][1] += int(r.state == "delivered")
    values = ",".join(["(%s, DATE_FORMAT(NOW(6), '%%Y-%%m-%%d %%H:00:00'), %s, %s)"] * len(tally))
    await cur.execute(
        "INSERT INTO webhook_endpoint_stats (endpoint_id, hour, attempts, delivered)"
        f" VALUES {values}"
        " ON DUPLICATE KEY UPDATE attempts = attempts + VALUES(attempts),"
        " delivered = delivered + VALUES(delivered)",
        [x for e, (n, d) in sorted(tally.items()) for x in (e, n, d)],
    )
