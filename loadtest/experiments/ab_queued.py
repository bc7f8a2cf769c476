"""Queue mode's 202 at the edge, measured in one process, pair by pair
(docs/hotpath.md, lever 43; docs/queue-mode.md).

    GATE_MYSQL_URL=mysql://root@127.0.0.1:3306/gate_hp GATE_REDIS_URL=redis://127.0.0.1:6379/9 \\
    python -m loadtest ab-queued [--rounds 10] [--requests 3000] [--concurrency 32]

Builds the gate's application as loadtest/hotpath.py does (the database migrated,
the Redis logical database flushed first: point both at throw-away ones) and sends
reservations of fresh buyers to a deal in queue mode (no consumer runs: the entries
wait) through `gate serve`'s protocol, alternating, in a new order each round:

  today      the admission's reply settled by a callback at the edge, the order's
             index written by the admission itself
  task       the same admission, answered in a task (`--off queue-callback`)
  before     a task, and the index in a call of its own (`--off queue-callback
             queue-index`: the path before lever 43)

Also a sold-out answer each round, the ratio's other side. Prints the CPU per
request (this process, user + system) of each, and the median ratios of the rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import time
from typing import Any

from loadtest import hotpath as hp

VARIANTS = ("today", "task", "before")


async def measure(rounds: int, n: int, concurrency: int) -> dict[str, Any]:
    from gate.api.app import build_app
    from gate.queuemode.service import QueueService
    from gate.reserve.path import ReservationPath
    from loadtest.tokens import TokenMint

    settings = await hp.prepared_settings()
    app = build_app(settings, background=False)
    mint = TokenMint(settings.jwt_secret.reveal())
    probe = hp.Probe(app, settings.admin_token.reveal(), mint, edge=True)
    start_queued = ReservationPath.start_queued
    index_in_admission = QueueService.index_in_admission

    def variant(name: str) -> None:
        ReservationPath.start_queued = start_queued  # type: ignore[method-assign]
        QueueService.index_in_admission = index_in_admission  # type: ignore[method-assign]
        if name in ("task", "before"):
            hp.switch_off("queue-callback")
        if name == "before":
            hp.switch_off("queue-index")

    samples: dict[str, list[float]] = {name: [] for name in (*VARIANTS, "sold_out")}
    async with app.router.lifespan_context(app):
        sold = await probe.deal(1)
        assert (await probe.reserve_call(sold, hp.USER_BASE - 1)())[0] == 201
        deal = await probe.deal(hp.BIG_STOCK, mode="queue")
        fresh = iter(range(hp.USER_BASE + 40_000_000, hp.USER_BASE + 90_000_000))
        losers = [hp.USER_BASE + i for i in range(32)]
        buyers = [next(fresh) for _ in range(n * (len(VARIANTS) * rounds + 1))]
        firsts = [next(fresh) for _ in range(len(VARIANTS) * rounds)]
        fresh = iter(firsts)
        for u in [*buyers, *losers, *firsts]:
            app.state.gate.buyer_auth.user_id(f"Bearer {mint.token(u)}")
        at = iter(range(0, len(buyers), n))
        # Once unmeasured: the deal's price read, its queue announced, caches warm.
        await hp.drive([probe.reserve_call(deal, u) for u in buyers[next(at) :][:n]], concurrency)
        orders = list(itertools.permutations(VARIANTS))
        for r in range(rounds):
            for name in orders[r % len(orders)]:
                variant(name)
                # A deal per run: the entries wait (no consumer), within the queue's cap.
                deal = await probe.deal(hp.BIG_STOCK, mode="queue")
                await hp.drive([probe.reserve_call(deal, next(fresh))], 1)
                i = next(at)
                calls = [probe.reserve_call(deal, u) for u in buyers[i : i + n]]
                started = time.process_time()
                statuses = await hp.drive(calls, concurrency)
                samples[name].append((time.process_time() - started) / n * 1e6)
                assert statuses == {202: n}, statuses
            calls = [probe.reserve_call(sold, losers[j % 32]) for j in range(n)]
            started = time.process_time()
            await hp.drive(calls, concurrency)
            samples["sold_out"].append((time.process_time() - started) / n * 1e6)
        variant("today")

    def ratio(a: str, b: str) -> dict[str, Any]:
        ratios = sorted(x / y for x, y in zip(samples[a], samples[b], strict=True))
        return {
            "median": round(statistics.median(ratios), 3),
            "spread": [round(ratios[0], 3), round(ratios[-1], 3)],
        }

    return {
        "us_median": {k: round(statistics.median(v), 1) for k, v in samples.items()},
        "today_over_task": ratio("today", "task"),
        "today_over_before": ratio("today", "before"),
        "sold_out_over_today": ratio("sold_out", "today"),
        "sold_out_over_before": ratio("sold_out", "before"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--concurrency", type=int, default=32)
    a = p.parse_args()
    for key, row in asyncio.run(measure(a.rounds, a.requests, a.concurrency)).items():
        print(key, row, flush=True)


if __name__ == "__main__":
    main()
