"""The waiting room's proof of work, priced by demand (docs/waiting-room.md).

    python -m loadtest bench-challenge [--units 20] [--min-bits 10] [--solves 40] …

Two figures, on one gate process:
  price    what a challenge costs a Python client (gate/room/gates.py `solve`, CPU
           time of this process) at 1 waiter per unit and at 100 waiters per unit:
           the room's queue is filled by real joins (a room asking 0 bits while it
           fills), then set to {"min_bits": M, "max_bits": 28}, and --solves
           challenges fetched from GET .../queue/challenge are solved at each demand.
           Target: the mean at 100 per unit ≥ 10 × the mean at 1 per unit.
  verify   the share of a join's gate CPU that verifying its challenge takes: the
           gate's CPU (user + system, /proc) over --joins joins that each carry a
           solved challenge (fetched and solved before the clock starts), against
           `JoinPasses.verify` timed in this process on the same challenges (one
           HMAC, one SHA-256: the same work whatever the bits; this process's CPU
           time, the median of 5 passes). For comparison, the
           gate's CPU per join of an open room (no body). --rounds rounds, each on a
           fresh deal. Target: verify ≤ 5 % of a join's gate CPU.

The joins go over --connections keep-alive connections, one thread each. It owns the
database and the Redis logical database it is given (default gate_test_pow and Redis
db 8): it drops and flushes them first. Prints one JSON report; exit 0 when both
targets are met, 2 when one is not.
"""

from __future__ import annotations

import argparse
import http.client
import os
import statistics
import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson

from loadtest import procs
from loadtest.bench_room import RoomBench
from loadtest.benchmark import http_json, say
from loadtest.tokens import TokenMint

USER_BASE = 7 * 10**12
VERIFY_REPEATS = 5


class Conn:
    """One keep-alive HTTP/1.1 connection to the gate."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.http = http.client.HTTPConnection(host, int(port), timeout=30)

    def call(self, method: str, path: str, auth: str, body: Any = None) -> tuple[int, Any]:
        headers = {"Authorization": auth}
        data = None
        if body is not None:
            data = orjson.dumps(body)
            headers["Content-Type"] = "application/json"
        self.http.request(method, path, body=data, headers=headers)
        resp = self.http.getresponse()
        return resp.status, orjson.loads(resp.read() or b"null")


class ChallengeBench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        args.env, args.workers = [], 1
        self.room = RoomBench(args)
        self.mint = TokenMint(self.room.jwt)
        self.next_user = USER_BASE

    @property
    def url(self) -> str:
        assert self.room.gate is not None
        return self.room.gate.url

    def users(self, n: int) -> list[int]:
        first = self.next_user
        self.next_user += n
        return list(range(first, first + n))

    def deal(self, units: int, challenge: dict[str, int] | None) -> int:
        starts = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
        room: dict[str, Any] = {"admit_per_second": 1000, "prequeue_seconds": 7200}
        if challenge is not None:
            room["challenge"] = challenge
        body = {
            "title": "bench challenge",
            "unit_price": 1000,
            "currency": "EUR",
            "stock": units,
            "starts_at": starts,
            "waiting_room": room,
        }
        status, answer = http_json("POST", self.url + "/v1/admin/deals", body, self.room.admin)
        if status != 201:
            raise RuntimeError(f"creating a deal answered {status}: {answer}")
        return int(answer["id"])

    def set_challenge(self, deal_id: int, low: int, high: int) -> None:
        room = {
            "admit_per_second": 1000,
            "prequeue_seconds": 7200,
            "challenge": {"min_bits": low, "max_bits": high},
        }
        url = f"{self.url}/v1/admin/deals/{deal_id}/waiting-room"
        status, answer = http_json("PUT", url, room, self.room.admin)
        assert status == 200, answer

    def challenges(self, deal_id: int, users: list[int]) -> list[tuple[int, dict[str, Any]]]:
        conn = Conn(self.url)
        out = []
        for user in users:
            status, body = conn.call(
                "GET", f"/v1/deals/{deal_id}/queue/challenge", self.mint.header(user)
            )
            assert status == 200, body
            out.append((user, body))
        return out

    def join_all(self, deal_id: int, bodies: list[tuple[int, Any]]) -> None:
        """Every (user, body) joined, over --connections connections in threads."""
        n = self.args.connections
        failures: list[Any] = []

        def worker(part: list[tuple[int, Any]]) -> None:
            conn = Conn(self.url)
            for user, body in part:
                status, answer = conn.call(
                    "POST", f"/v1/deals/{deal_id}/queue", self.mint.header(user), body
                )
                if status not in (200, 201):
                    failures.append(answer)

        # Tokens minted before the clock starts (the client's work, not the gate's).
        for user, _ in bodies:
            self.mint.header(user)
        threads = [threading.Thread(target=worker, args=(bodies[i::n],)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if failures:
            raise RuntimeError(f"{len(failures)} joins refused, e.g. {failures[0]}")

    def fill(self, deal_id: int, waiting: int) -> None:
        """Real joins up to `waiting` tickets, the room asking 0 bits meanwhile."""
        self.set_challenge(deal_id, 0, 0)
        have = self._waiting
        users = self.users(waiting - have)
        self.join_all(
            deal_id,
            [
                (u, {"challenge": c["challenge"], "nonce": "0"})
                for u, c in self.challenges(deal_id, users)
            ],
        )
        self._waiting = waiting

    def price(self) -> dict[str, Any]:
        from gate.room.gates import solve

        a = self.args
        deal_id = self.deal(a.units, {"min_bits": 0, "max_bits": 0})
        self._waiting = 0
        out: dict[str, Any] = {"units": a.units, "min_bits": a.min_bits}
        for per_unit in (1, 100):
            self.fill(deal_id, per_unit * a.units)
            self.set_challenge(deal_id, a.min_bits, 28)
            got = self.challenges(deal_id, self.users(a.solves))
            bits = {c["bits"] for _, c in got}
            assert len(bits) == 1, bits
            say(f"solving {a.solves} challenges of {bits} bits ({per_unit} waiters per unit)")
            costs = []
            for _, c in got:
                before = time.process_time()
                solve(c["challenge"], c["bits"])
                costs.append((time.process_time() - before) * 1000)
            out[f"per_unit_{per_unit}"] = {
                "bits": bits.pop(),
                "solve_cpu_ms_mean": round(statistics.fmean(costs), 2),
                "solve_cpu_ms_median": round(statistics.median(costs), 2),
                "solve_cpu_ms_min": round(min(costs), 2),
                "solve_cpu_ms_max": round(max(costs), 2),
            }
        low, high = out["per_unit_1"], out["per_unit_100"]
        out["ratio_mean"] = round(high["solve_cpu_ms_mean"] / low["solve_cpu_ms_mean"], 1)
        out["ratio_median"] = round(high["solve_cpu_ms_median"] / low["solve_cpu_ms_median"], 1)
        return out

    def gate_cpu_per_join(self, deal_id: int, bodies: list[tuple[int, Any]]) -> float:
        assert self.room.gate is not None
        pids = self.room.gate.pids()
        before = procs.cpu_seconds(pids)
        self.join_all(deal_id, bodies)
        return (procs.cpu_seconds(pids) - before) / len(bodies) * 1e6

    def verify_cost(self, passes: Any, deal_id: int, bodies: list[tuple[int, Any]]) -> float:
        """CPU µs per `JoinPasses.verify` of these joins' challenges: this process's
        CPU time (not wall time: a busy machine preempts), the median of
        VERIFY_REPEATS passes over all of them."""
        passes_us = []
        for _ in range(VERIFY_REPEATS):
            start = time.process_time()
            for user, body in bodies:
                passes.verify(deal_id, user, body["challenge"], body["nonce"])
            passes_us.append((time.process_time() - start) / len(bodies) * 1e6)
        return statistics.median(passes_us)

    def verify(self) -> dict[str, Any]:
        from gate.base.settings import Secret
        from gate.room.gates import JoinPasses

        a = self.args
        passes = JoinPasses(Secret(self.room.env["GATE_ADMISSION_SECRET"]))
        rounds = []
        for i in range(a.rounds):
            pow_deal = self.deal(a.joins, {"min_bits": 0, "max_bits": 0})
            got = self.challenges(pow_deal, self.users(a.joins))
            bodies = [(u, {"challenge": c["challenge"], "nonce": "0"}) for u, c in got]
            with_pow = self.gate_cpu_per_join(pow_deal, bodies)
            open_deal = self.deal(a.joins, None)
            plain = self.gate_cpu_per_join(open_deal, [(u, None) for u in self.users(a.joins)])
            verify_us = self.verify_cost(passes, pow_deal, bodies)
            rounds.append(
                {
                    "join_cpu_us": round(with_pow, 1),
                    "open_join_cpu_us": round(plain, 1),
                    "verify_us": round(verify_us, 2),
                    "verify_share": round(verify_us / with_pow, 4),
                }
            )
            say(f"round {i + 1}: {rounds[-1]}")
        shares = [r["verify_share"] for r in rounds]
        return {
            "joins_per_round": a.joins,
            "connections": a.connections,
            "rounds": rounds,
            "verify_share_median": statistics.median(shares),
            "verify_share_max": max(shares),
        }

    def run(self) -> dict[str, Any]:
        self.room.reset()
        self.room.start()
        try:
            report: dict[str, Any] = {"load_before": os.getloadavg()}
            report["price"] = self.price()
            report["verify"] = self.verify()
            report["load_after"] = os.getloadavg()
            return report
        finally:
            assert self.room.gate is not None
            self.room.gate.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest bench-challenge", description=__doc__)
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/8")
    p.add_argument("--mysql-url", default="mysql://root@127.0.0.1:3306/gate_test_pow")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--units", type=int, default=20)
    p.add_argument("--min-bits", type=int, default=10)
    p.add_argument("--solves", type=int, default=40)
    p.add_argument("--joins", type=int, default=5000)
    p.add_argument("--connections", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out")
    args = p.parse_args(argv)
    bench = ChallengeBench(args)
    report = bench.run()
    text = orjson.dumps(report, option=orjson.OPT_INDENT_2).decode()
    (bench.room.out / "report.json").write_text(text)
    print(text)
    met = report["price"]["ratio_mean"] >= 10 and report["verify"]["verify_share_max"] <= 0.05
    return 0 if met else 2


if __name__ == "__main__":
    raise SystemExit(main())
