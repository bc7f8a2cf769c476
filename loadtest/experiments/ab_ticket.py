"""A waiting-room ticket at the edge answered by a callback or by a task, measured
in one process, pair by pair (docs/hotpath.md, lever 42).

    GATE_MYSQL_URL=mysql://root@127.0.0.1:3306/gate_hp GATE_REDIS_URL=redis://127.0.0.1:6379/9 \\
    python -m loadtest ab-ticket [--pairs 30] [--requests 4000] [--concurrency 32]

Builds the gate's application as loadtest/hotpath.py does (the database migrated,
the Redis logical database flushed first: point both at throw-away ones) and drives
polls of one set of buyers and first joins of fresh buyers through `gate serve`'s
protocol, alternating `TicketEdge.handle` between the callback (today's) and the
task path (`--off ticket-callback`'s), the order swapped every pair. This VM's speed
moves by tens of per cent within minutes; pairs made seconds apart in one process
cancel most of that. Prints the CPU per request (this process, user + system) of
each and the median ratio of the pairs.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from loadtest import hotpath as hp


async def measure(pairs: int, n: int, concurrency: int) -> dict[str, Any]:
    from gate.api.app import build_app
    from gate.room import edge_lane
    from loadtest.tokens import TokenMint

    settings = await hp.prepared_settings()
    app = build_app(settings, background=False)
    mint = TokenMint(settings.jwt_secret.reveal())
    probe = hp.Probe(app, settings.admin_token.reveal(), mint, edge=True)
    callback = edge_lane.TicketEdge.handle
    hp.switch_off("ticket-callback")
    task = edge_lane.TicketEdge.handle
    samples: dict[str, dict[str, list[float]]] = {
        "callback": {"poll": [], "join": []},
        "task": {"poll": [], "join": []},
    }
    async with app.router.lifespan_context(app):
        poll_deal = await probe.deal(hp.BIG_STOCK, {"admit_per_second": 1})
        join_deal = await probe.deal(hp.BIG_STOCK, {"admit_per_second": 1})
        pollers = [hp.USER_BASE + 20_000_000 + i for i in range(n)]
        joiners = [hp.USER_BASE + 30_000_000 + i for i in range(n * 2 * pairs)]
        for u in [*pollers, *joiners]:
            app.state.gate.buyer_auth.user_id(f"Bearer {mint.token(u)}")
        await hp.drive([probe.queue_call("POST", poll_deal, u) for u in pollers], concurrency)
        at = 0
        for pair in range(pairs):
            order = [("callback", callback), ("task", task)]
            for name, handle in order if pair % 2 == 0 else order[::-1]:
                edge_lane.TicketEdge.handle = handle  # type: ignore[method-assign]
                polls = [probe.queue_call("GET", poll_deal, u) for u in pollers]
                started = time.process_time()
                await hp.drive(polls, concurrency)
                samples[name]["poll"].append((time.process_time() - started) / n * 1e6)
                joins = [probe.queue_call("POST", join_deal, u) for u in joiners[at : at + n]]
                at += n
                started = time.process_time()
                await hp.drive(joins, concurrency)
                samples[name]["join"].append((time.process_time() - started) / n * 1e6)
        edge_lane.TicketEdge.handle = callback  # type: ignore[method-assign]
    out: dict[str, Any] = {}
    for kind in ("poll", "join"):
        cb, tk = samples["callback"][kind], samples["task"][kind]
        ratios = sorted(c / t for c, t in zip(cb, tk, strict=True))
        out[kind] = {
            "callback_us_median": round(statistics.median(cb), 1),
            "task_us_median": round(statistics.median(tk), 1),
            "callback_over_task_median": round(statistics.median(ratios), 3),
            "spread": [round(ratios[0], 3), round(ratios[-1], 3)],
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--pairs", type=int, default=30)
    p.add_argument("--requests", type=int, default=4000)
    p.add_argument("--concurrency", type=int, default=32)
    a = p.parse_args()
    for kind, row in asyncio.run(measure(a.pairs, a.requests, a.concurrency)).items():
        print(kind, row, flush=True)


if __name__ == "__main__":
    main()
