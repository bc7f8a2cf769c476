"""What traces cost the hot paths, measured in one process, pair by pair
(docs/tracing.md, "Cost").

    GATE_MYSQL_URL=mysql://root@127.0.0.1:3306/gate_hp GATE_REDIS_URL=redis://127.0.0.1:6379/9 \\
    python -m loadtest.ab_tracing [--rounds 10] [--requests 3000] [--concurrency 32] [--ratio 0.01]

Builds the gate's application as loadtest/hotpath.py does (the database migrated,
the Redis logical database flushed first: point both at throw-away ones) with traces
configured by OTEL_* at `--ratio` of the traces the gate starts
(parentbased_traceidratio), exported over OTLP/HTTP to a process on loopback that
drops them (loadtest/otlp_sink.py). Requests go through `gate serve`'s protocol (the
edge), without a traceparent, alternating each round in a new order:

  off   the tracing flag down (gate/base/tracing.py `ENABLED`): what a gate without
        OTEL_* runs
  on    traces on at the ratio

for two cases: sold_out (the near-cache's 409) and committed (a reservation that
commits; fresh buyers each run). Prints the CPU per request of this process (user +
system: the SDK's export thread included) of each, and the median on/off ratio of
the rounds per case (goal: at most 1.03).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from typing import Any

from loadtest import hotpath as hp

VARIANTS = ("off", "on")
CASES = ("sold_out", "committed")


async def measure(rounds: int, n: int, concurrency: int) -> dict[str, Any]:
    from gate.api.app import build_app
    from gate.base import logs, tracing
    from loadtest.tokens import TokenMint

    settings = await hp.prepared_settings()
    app = build_app(settings, background=False)
    mint = TokenMint(settings.jwt_secret.reveal())
    probe = hp.Probe(app, settings.admin_token.reveal(), mint, edge=True)

    def variant(name: str) -> None:
        on = name == "on"
        tracing.ENABLED = on
        logs.use_trace_ids(tracing.log_ids if on else None)

    samples: dict[str, list[float]] = {f"{c}_{v}": [] for c in CASES for v in VARIANTS}
    async with app.router.lifespan_context(app):
        assert tracing.ENABLED, "traces did not start (OTEL_* below)"
        sold = await probe.deal(1)
        assert (await probe.reserve_call(sold, hp.USER_BASE - 1)())[0] == 201
        deal = await probe.deal(hp.BIG_STOCK)
        losers = [hp.USER_BASE + i for i in range(32)]
        fresh = iter(range(hp.USER_BASE + 40_000_000, hp.USER_BASE + 90_000_000))
        buyers = [next(fresh) for _ in range(n * (len(VARIANTS) * rounds + 1))]
        for u in [*buyers, *losers]:
            app.state.gate.buyer_auth.user_id(f"Bearer {mint.token(u)}")
        at = iter(range(0, len(buyers), n))
        # Once unmeasured: caches warm, the near-cache holding the sold-out deal.
        await hp.drive([probe.reserve_call(deal, u) for u in buyers[next(at) :][:n]], concurrency)
        await hp.drive([probe.reserve_call(sold, losers[j % 32]) for j in range(n)], concurrency)
        for r in range(rounds):
            for name in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
                variant(name)
                calls = [probe.reserve_call(sold, losers[j % 32]) for j in range(n)]
                started = time.process_time()
                statuses = await hp.drive(calls, concurrency)
                samples[f"sold_out_{name}"].append((time.process_time() - started) / n * 1e6)
                assert statuses == {409: n}, statuses
                i = next(at)
                calls = [probe.reserve_call(deal, u) for u in buyers[i : i + n]]
                started = time.process_time()
                statuses = await hp.drive(calls, concurrency)
                samples[f"committed_{name}"].append((time.process_time() - started) / n * 1e6)
                assert statuses == {201: n}, statuses
        variant("on")

    def ratio(case: str) -> dict[str, Any]:
        ratios = sorted(
            x / y for x, y in zip(samples[f"{case}_on"], samples[f"{case}_off"], strict=True)
        )
        return {
            "median": round(statistics.median(ratios), 3),
            "spread": [round(ratios[0], 3), round(ratios[-1], 3)],
        }

    return {
        "us_median": {k: round(statistics.median(v), 1) for k, v in samples.items()},
        **{f"{case}_on_over_off": ratio(case) for case in CASES},
    }


def main() -> None:
    from loadtest.otlp_sink import running_sink, tracing_env

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--ratio", type=float, default=0.01, help="the share sampled (0.01: 1 %%)")
    a = p.parse_args()
    with running_sink() as endpoint:
        os.environ.update(tracing_env(endpoint, a.ratio))
        for key, row in asyncio.run(measure(a.rounds, a.requests, a.concurrency)).items():
            print(key, row, flush=True)


if __name__ == "__main__":
    main()
