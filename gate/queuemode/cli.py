"""`gate queue status | dead-letters | retry` (docs/cli.md, docs/queue-mode.md).

status       per deal with a queue: depth, oldest age, consumers, pending
             (delivered, not yet settled), retrying, dead letters
dead-letters the queue_dead_letters rows (newest first, at most DEAD_LETTERS_MAX)
retry ID     claims the dead letter (retried_at), submits its request again
             through the normal reservation path (a fresh admission: its units went
             back when it was dead-lettered), queued or committed like any request,
             and records the answer (retried_outcome, retried_order_id): one outcome
             per dead letter, a second retry is refused.

                 claim ──> reserve ──> order: outcome = its status, order id
                   │          ├──────> final refusal: outcome = its code
                   │          └──────> no outcome yet (RETRY_AGAIN_CODES, a failure):
                   │                   claim released
                   └─ taken: refused, unless a claim with no outcome is older than
                      RETRY_CLAIM_SECONDS (its command died before the answer)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

from gate.base.settings import SettingsError
from gate.cli.common import ranged_int
from gate.inventory.deals import MAX_ID as DEAL_ID_MAX
from gate.queuemode import store

DEAD_LETTERS_MAX = 1000
DEALS_MAX = 1000
ID_MAX = 2**64 - 1  # BIGINT UNSIGNED, a dead letter's id column type
# Refusals that are not the request's outcome: a retry refused with one of these is
# released (retried_at back to NULL) so that it may be retried again.
RETRY_AGAIN_CODES = frozenset({"OVERLOADED", "RATE_LIMITED", "IDEMPOTENCY_IN_PROGRESS", "INTERNAL"})
# A claim with no outcome this old was made by a command that died before its answer
# (a retry is one reservation: its Redis and database calls time out within seconds):
# a later retry may take it over. The request's idempotency key keeps both to one order.
RETRY_CLAIM_SECONDS = 300


def _print(data: Any, as_json: bool, lines: list[str]) -> None:
    if as_json:
        print(json.dumps(data, indent=2, default=str))
    else:
        print("\n".join(lines) if lines else "(none)")


class NoSuchDeal(Exception):
    pass


async def queue_heads(redis: Any, deal_ids: list[int]) -> dict[int, tuple[int, float]]:
    """Each deal's queue: (depth, age in seconds of its oldest entry), read in one
    pipeline for all the deals."""
    if not deal_ids:
        return {}
    from gate.store.keys import queue_keys
    from gate.store.resp import text

    pipe = redis.pipeline(transaction=False)
    for deal_id in deal_ids:
        stream = queue_keys(deal_id).stream
        pipe.xlen(stream)
        pipe.xrange(stream, "-", "+", count=1)
    answers = await pipe.execute()
    now = time.time()
    out: dict[int, tuple[int, float]] = {}
    for i, deal_id in enumerate(deal_ids):
        depth, first = int(answers[2 * i]), answers[2 * i + 1]
        age = 0.0
        if depth and first:
            # A stream entry's id starts with the Redis time it was added at (ms).
            ms = int(text(first[0][0]).split("-")[0])
            age = max(0.0, now - ms / 1000)
        out[deal_id] = (depth, round(age, 3))
    return out


async def _status(gate: Any, deal: int | None) -> list[dict[str, Any]]:
    from gate.queuemode.consumer import GROUP
    from gate.store.keys import QUEUE_DEALS, queue_keys

    redis = gate.redis
    if deal is not None:
        deals = [deal]
    else:
        deals = sorted(int(d) for d in await redis.smembers(QUEUE_DEALS))[:DEALS_MAX]
    out: list[dict[str, Any]] = []
    if not deals:
        return out
    # Only the deals shown: a database of many past sales is not read whole.
    modes = {int(r[0]): str(r[1]) for r in await store.deal_modes(gate.db, deals)}
    if deal is not None and deal not in modes:
        raise NoSuchDeal(deal)
    counts = {int(r[0]): int(r[1]) for r in await store.dead_letter_counts(gate.db, deals)}
    heads = await queue_heads(redis, deals)
    for deal_id in deals:
        stream = queue_keys(deal_id).stream
        depth, age = heads[deal_id]
        consumers = pending = retrying = 0
        try:
            for c in await redis.xinfo_consumers(stream, GROUP):
                consumers += 1
                pending += int(c["pending"])
            summary: Any = await redis.xpending_range(stream, GROUP, "-", "+", DEALS_MAX)
            retrying = sum(1 for p in summary if int(p["times_delivered"]) > 1)
        except Exception:
            pass  # no group yet: no consumer has read this stream
        out.append(
            {
                "deal_id": deal_id,
                "mode": modes.get(deal_id, "?"),
                "depth": depth,
                "oldest_age_seconds": age,
                "consumers": consumers,
                "pending": pending,
                "retrying": retrying,
                "dead_letters": counts.get(deal_id, 0),
            }
        )
    return out


async def _dead_letters(gate: Any, deal: int | None) -> list[dict[str, Any]]:
    rows = await store.dead_letters(gate.db, deal, DEAD_LETTERS_MAX)
    names = (
        "entry_id",
        "order_id",
        "deal_id",
        "user_id",
        "quantity",
        "attempts",
        "last_error",
        "created_at",
        "retried_order_id",
        "retried_outcome",
        "retried_at",
    )
    return [dict(zip(names, r, strict=True)) for r in rows]


async def retry_dead_letter(gate: Any, entry_id: int) -> tuple[int, str]:
    from gate.base.errors import Problem
    from gate.reserve.request import ReserveRequest

    row = await store.dead_letter_request(gate.db, entry_id)
    if row is None:
        return 1, f"no dead letter {entry_id}"
    # One claim at a time; a claim stays once the retry has an outcome.
    claimed = await store.claim(gate.db, entry_id, RETRY_CLAIM_SECONDS)
    if not claimed:
        return 1, await _why_taken(gate, entry_id)
    claim = await store.claim_time(gate.db, entry_id)
    deal_id, user_id, quantity, key = int(row[0]), int(row[1]), int(row[2]), str(row[3])

    try:
        result = await gate.reservations.reserve(
            ReserveRequest(deal_id, user_id, quantity, key, "127.0.0.1", None, operator_retry=True)
        )
    except Problem as problem:
        if problem.code in RETRY_AGAIN_CODES:
            # No outcome yet (nothing admitted, or the same key's earlier attempt still
            # in flight): the dead letter is released for a later retry, which the
            # request's idempotency key keeps to one order.
            await store.release(gate.db, entry_id, claim)
            return 1, (
                f"retry of {entry_id} refused for now: {problem.code} {problem.detail}"
                " (it may be retried again)"
            )
        await store.record_refusal(gate.db, entry_id, claim, problem.code)
        return 1, f"retry of {entry_id} refused: {problem.code} {problem.detail}"
    except Exception as exc:
        # Redis or the database failed mid-call: whatever was admitted is under the
        # request's idempotency key, so a later retry answers that same order.
        await store.release(gate.db, entry_id, claim)
        return 1, f"retry of {entry_id} failed: {exc!r} (it may be retried again)"
    order_id = str(result.body["order_id"])
    status = str(result.body["status"])
    await store.record_order(gate.db, entry_id, claim, order_id, status)
    return 0, f"dead letter {entry_id} re-submitted as order {order_id} ({status})"


async def _why_taken(gate: Any, entry_id: int) -> str:
    row = await store.why_taken(gate.db, entry_id)
    if row is None:
        return f"no dead letter {entry_id}"
    order_id, outcome, at, age = row
    if order_id is not None or outcome is not None:
        answer = f"order {order_id} ({outcome})" if order_id else f"refused {outcome}"
        return f"dead letter {entry_id} was already retried at {at}: {answer}"
    return (
        f"dead letter {entry_id} is being retried (claimed {age} s ago, at {at}); a claim"
        f" with no outcome may be taken over after {RETRY_CLAIM_SECONDS} s"
    )


def cmd_queue(args: argparse.Namespace) -> int:
    from gate.base.logs import configure_command
    from gate.base.settings import load_settings
    from gate.runtime import Gate, StartupError

    try:
        settings = load_settings()
    except SettingsError as exc:
        print(f"gate: configuration error: {exc}", file=sys.stderr)
        return 2
    # One-shot: its output on stdout, the gate's warnings on stderr for people.
    configure_command(settings.log_level)

    async def main() -> int:
        try:
            gate = Gate(settings)
        except SettingsError as exc:
            print(f"gate: configuration error: {exc}", file=sys.stderr)
            return 2
        try:
            await gate.start(background=False)
        except StartupError as exc:
            print(f"gate: {exc}", file=sys.stderr)
            await gate.stop()
            return 2
        try:
            if args.queue_cmd == "status":
                try:
                    data = await _status(gate, args.deal)
                except NoSuchDeal:
                    print(f"gate: no such deal {args.deal}", file=sys.stderr)
                    return 2
                _print(
                    data,
                    args.json,
                    [
                        f"deal {d['deal_id']} ({d['mode']}): depth {d['depth']}, oldest"
                        f" {d['oldest_age_seconds']}s, consumers {d['consumers']}, pending"
                        f" {d['pending']}, retrying {d['retrying']}, dead letters"
                        f" {d['dead_letters']}"
                        for d in data
                    ],
                )
                return 0
            if args.queue_cmd == "dead-letters":
                letters = await _dead_letters(gate, args.deal)
                _print(
                    letters,
                    args.json,
                    [
                        f"{d['entry_id']}: order {d['order_id']} deal {d['deal_id']} user"
                        f" {d['user_id']} x{d['quantity']} after {d['attempts']} attempts:"
                        f" {d['last_error']}" + _retried_note(d)
                        for d in letters
                    ],
                )
                return 0
            code, message = await retry_dead_letter(gate, args.entry_id)
            print(message, file=sys.stdout if code == 0 else sys.stderr)
            return code
        finally:
            await gate.stop()

    return asyncio.run(main())


def _retried_note(letter: dict[str, Any]) -> str:
    if letter["retried_order_id"]:
        return f" (retried as {letter['retried_order_id']}, {letter['retried_outcome']})"
    if letter["retried_outcome"]:
        return f" (retried: refused {letter['retried_outcome']})"
    if letter["retried_at"]:
        return f" (being retried since {letter['retried_at']})"
    return ""


# A deal id as everywhere else (the HTTP API, gate deal); a dead letter's as its column.
_deal_id = ranged_int(1, DEAL_ID_MAX)
_entry_id = ranged_int(1, ID_MAX)


def add_commands(sub: argparse._SubParsersAction[Any]) -> None:
    q = sub.add_parser("queue", help="queue mode: status, dead letters, retry")
    qs = q.add_subparsers(dest="queue_cmd", required=True)
    s = qs.add_parser("status", help="depth, oldest age, consumers, retries, dead letters")
    s.add_argument("--deal", type=_deal_id, default=None, help="only this deal")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    d = qs.add_parser("dead-letters", help="list the queue's dead letters")
    d.add_argument("--deal", type=_deal_id, default=None, help="only this deal")
    d.add_argument("--json", action="store_true", help="machine-readable output")
    r = qs.add_parser("retry", help="re-submit one dead letter (exactly once)")
    r.add_argument(
        "entry_id", type=_entry_id, help="the dead letter's id (gate queue dead-letters)"
    )
    for p in (s, d, r):
        p.set_defaults(fn=cmd_queue)
