"""CPU per request of the gate's hot paths, measured in process (docs/hotpath.md).

    python -m loadtest.hotpath [--requests N] [--concurrency C] [--profile PATH]

Builds the gate's ASGI application from the environment (GATE_MYSQL_URL,
GATE_REDIS_URL, … as `gate serve` reads them; the database is migrated and the
Redis logical database flushed first, so point both at throw-away ones), creates
its deals through the admin API, then drives each path with N requests, C at a time,
straight into the application (no socket, no HTTP parser: what the gate's own code
costs) and prints the CPU time of this process per request (`time.process_time`,
user + system), which a busy machine disturbs far less than requests per second:

  healthz     GET /healthz
  sold_out    a reservation on a sold-out deal (the near-cache answers)
  limited     a reservation refused by the per-user limiter (GATE_LIMIT_USER,
              "1/m burst 1" unless set; the buyers spent their limit first)
  committed   a reservation that commits (one buyer per request)
  queued      a reservation of a deal in queue mode answered 202 (one buyer per
              request; no consumer runs in this process: the entries wait)
  join        a first join of a deal's waiting room (one buyer per request)
  poll        a read of a waiting ticket (GATE_ROOM_POLL_MIN_MS/MAX_MS 100 unless set)
  deal        a buyer's view of a deal (GET /v1/deals/{id}: its remaining units)
  order       a poll of a queued order (GET /v1/orders/{id} while it waits; each
              of N buyers queued one request first)
  replay      the same buyers' requests sent again with the same Idempotency-Key
              while they wait: 202 again, the queued order

`--profile PATH` also writes a cProfile of the measured requests per path
(PATH.<case>.prof) and prints the functions with the most time of their own.

`--token es256` signs the buyers' tokens with an ES256 key of the identity-provider
kind (a JWKS file written to a temporary directory and named by GATE_JWT_JWKS_FILE)
instead of HS256 with GATE_JWT_SECRET; with GATE_JWT_CACHE_MAX=0 every request
verifies its token again.

`--trace-ratio R` runs the gate with traces on (gate/base/tracing.py), OTEL_* set for
a ratio R of the traces the gate starts (parentbased_traceidratio; 0.01: 1 %),
exported over OTLP/HTTP to a process on loopback that drops them
(loadtest/otlp_sink.py): the CPU measured here includes the export. For pairs
alternated in one process: `python -m loadtest ab-tracing`.

`--edge` sends each request as bytes through the HTTP protocol `gate serve` runs
(gate/web/edge.py's `EdgeProtocol` on an in-memory transport, one kept-alive
"connection" per concurrent request): the edge answers its routes, the rest go
through uvicorn's ASGI cycle, as on a socket. Without it the requests enter the ASGI
application directly (what the routes the edge does not take cost).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import functools
import io
import os
import pstats
import secrets
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

Scope = dict[str, Any]
CASES = (
    "healthz",
    "sold_out",
    "limited",
    "committed",
    "queued",
    "join",
    "poll",
    "deal",
    "order",
    "replay",
)
USER_BASE = 5 * 10**12
BIG_STOCK = 50_000_000


class _Transport:
    """An in-memory transport for one protocol: what it writes is framed into answers
    (Content-Length), each resolving the request that waits for it."""

    def __init__(self) -> None:
        self.buf = b""
        self.waiting: asyncio.Future[tuple[int, bytes]] | None = None
        self.closing = False

    def write(self, data: bytes) -> None:
        self.buf += data
        while b"\r\n\r\n" in self.buf:
            head, rest = self.buf.split(b"\r\n\r\n", 1)
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if len(rest) < length:
                return
            self.buf = rest[length:]
            status = int(head.split(b" ", 2)[1])
            if self.waiting is not None and not self.waiting.done():
                self.waiting.set_result((status, rest[:length]))

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 40000), "sockname": ("127.0.0.1", 8000)}.get(
            name, default
        )

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass  # nothing is buffered: every write is taken at once


class Wire:
    """Requests as bytes through `gate serve`'s protocol (see `--edge`)."""

    def __init__(self, app: Any) -> None:
        import uvicorn
        from uvicorn.server import ServerState

        from gate.web.edge import EdgeProtocol

        self.config = uvicorn.Config(
            app, lifespan="off", proxy_headers=False, log_config=None, access_log=False
        )
        self.config.load()
        self.state = ServerState()
        self.protocol_class = EdgeProtocol
        self.free: list[tuple[Any, _Transport]] = []

    async def call(
        self, method: str, path: str, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> tuple[int, bytes]:
        # A kept-alive "connection" the gate closed meanwhile (idle past its keep-alive
        # timeout while the probe set up another case) is not used again.
        while self.free and self.free[-1][1].closing:
            self.free.pop()
        if self.free:
            protocol, transport = self.free.pop()
        else:
            protocol = self.protocol_class(
                config=self.config, server_state=self.state, app_state={}
            )
            transport = _Transport()
            protocol.connection_made(transport)
        lines = [b"%s %s HTTP/1.1" % (method.encode(), path.encode()), b"host: gate"]
        lines += [b"%s: %s" % (k, v) for k, v in headers]
        if body and not any(k == b"content-length" for k, _ in headers):
            lines.append(b"content-length: %d" % len(body))
        transport.waiting = asyncio.get_running_loop().create_future()
        protocol.data_received(b"\r\n".join(lines) + b"\r\n\r\n" + body)
        answer = await transport.waiting
        self.free.append((protocol, transport))
        return answer


class Probe:
    def __init__(self, app: Any, admin_token: str, mint: Any, edge: bool = False) -> None:
        self.app = app
        self.wire = Wire(app) if edge else None
        self.admin = f"Bearer {admin_token}".encode()
        self.mint = mint
        self.counter = 0
        # Keys are per buyer and the database keeps them: every run its own.
        self.tag = secrets.token_hex(4)

    async def call(
        self, method: str, path: str, headers: list[tuple[bytes, bytes]], body: bytes = b""
    ) -> tuple[int, bytes]:
        if self.wire is not None:
            return await self.wire.call(method, path, headers, body)
        scope: Scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": method,
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [(b"host", b"gate"), *headers],
            "client": ("127.0.0.1", 40000),
            "server": ("127.0.0.1", 8000),
        }
        sent = False
        status = 0
        chunks: list[bytes] = []

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if sent:
                await asyncio.sleep(3600)
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        await self.app(scope, receive, send)
        return status, b"".join(chunks)

    async def admin_json(self, method: str, path: str, body: Any) -> Any:
        status, out = await self.call(
            method,
            path,
            [(b"authorization", self.admin), (b"content-type", b"application/json")],
            orjson.dumps(body),
        )
        if status >= 300:
            raise RuntimeError(f"{method} {path} answered {status}: {out!r}")
        return orjson.loads(out)

    async def deal(self, stock: int, room: dict[str, int] | None = None, mode: str = "sync") -> int:
        spec: dict[str, Any] = {
            "title": "hotpath probe",
            "unit_price": 1000,
            "currency": "EUR",
            "stock": stock,
            "buckets": 16,
            "hold_seconds": 3600,
            "max_per_order": 1,
            "mode": mode,
        }
        if room:
            spec["waiting_room"] = room
        body = await self.admin_json("POST", "/v1/admin/deals", spec)
        return int(body["id"])

    def queue_call(
        self, method: str, deal_id: int, user: int
    ) -> Callable[[], Awaitable[tuple[int, bytes]]]:
        auth = f"Bearer {self.mint.token(user)}".encode()
        return functools.partial(
            self.call, method, f"/v1/deals/{deal_id}/queue", [(b"authorization", auth)]
        )

    def reserve_call(
        self, deal_id: int, user: int, key: str | None = None
    ) -> Callable[[], Awaitable[tuple[int, bytes]]]:
        """A reservation with a fresh Idempotency-Key each call, or always `key`."""
        auth = f"Bearer {self.mint.token(user)}".encode()
        path = f"/v1/deals/{deal_id}/reservations"

        def call() -> Awaitable[tuple[int, bytes]]:
            self.counter += 1
            idempotency_key = key or f"probe-{self.tag}-{self.counter:09d}"
            return self.call(
                "POST",
                path,
                [
                    (b"authorization", auth),
                    (b"idempotency-key", idempotency_key.encode()),
                    (b"content-type", b"application/json"),
                    (b"content-length", b"15"),
                ],
                b'{"quantity": 1}',
            )

        return call

    def order_call(self, order_id: str, user: int) -> Callable[[], Awaitable[tuple[int, bytes]]]:
        auth = f"Bearer {self.mint.token(user)}".encode()
        return functools.partial(
            self.call, "GET", f"/v1/orders/{order_id}", [(b"authorization", auth)]
        )


async def drive(
    calls: list[Callable[[], Awaitable[tuple[int, bytes]]]], concurrency: int
) -> dict[int, int]:
    statuses: dict[int, int] = {}
    for i in range(0, len(calls), concurrency):
        done = await asyncio.gather(*(c() for c in calls[i : i + concurrency]))
        for status, _ in done:
            statuses[status] = statuses.get(status, 0) + 1
    return statuses


LEVERS = (
    "ulid",
    "encoded",
    "refusals",
    "route-order",
    "ticket-callback",
    "queue-callback",
    "queue-index",
)


def switch_off(lever: str) -> None:
    """Put one lever back as it was before docs/hotpath.md, to measure what it gains
    in the same build and run."""
    if lever == "ulid":
        from ulid import ULID

        from gate.inventory import orders

        orders.new_id = lambda: str(ULID())
    elif lever == "encoded":
        from gate.base import errors

        # Every answer encoded again, as before the cache.
        errors.Problem.encoded = lambda self, instance=None: self._encode(instance)  # type: ignore[method-assign]
    elif lever == "refusals":
        from gate.reserve import refusals

        refusals.Refusals.check = lambda self, *request: None  # type: ignore[method-assign]
    elif lever == "route-order":
        from gate.api import app

        first = app.routes

        def reordered() -> list[Any]:
            routes = first()
            return routes[1:5] + routes[:1] + routes[5:]

        app.routes = reordered
    elif lever == "ticket-callback":
        from gate.room import edge_lane

        def in_a_task(self: Any, req: Any) -> None:
            # A join or a read in a task of its own, as before the callback.
            user_id = self.auth.user_id(req.header(b"authorization"))
            if not 1 <= req.id <= edge_lane.MAX_ID:
                raise edge_lane.not_found("deal")
            req.run(edge_lane._ticket_answer(self.room, req.id, user_id, self.join, req.path))

        edge_lane.TicketEdge.handle = in_a_task  # type: ignore[method-assign]
    elif lever == "queue-callback":
        from gate.reserve.path import ReservationPath

        # Every queue-mode reservation in a task of its own (`reserve`), as before.
        ReservationPath.start_queued = lambda self, req: None  # type: ignore[method-assign]
    elif lever == "queue-index":
        from gate.queuemode.service import QueueService

        # The order's index in a call of its own beside the admission, as before.
        QueueService.index_in_admission = False  # type: ignore[assignment,misc]


async def prepared_settings() -> Any:
    """The gate's settings from the environment (a dev gate, the limiter and the
    room's poll advice as the cases need them unless set), the database migrated and
    the Redis logical database flushed: point both at throw-away ones."""
    import redis.asyncio as aioredis

    from gate.base.logs import configure
    from gate.base.settings import load_settings
    from gate.store.migrate import migrate

    env = dict(os.environ)
    env.setdefault("GATE_LIMIT_USER", "1/m burst 1")
    env.setdefault("GATE_ENV", "dev")
    # The app runs in this process: no metrics listener thread (nor its port).
    env.setdefault("GATE_METRICS_ADDR", "off")
    env.setdefault("GATE_ROOM_POLL_MIN_MS", "100")
    env.setdefault("GATE_ROOM_POLL_MAX_MS", "100")
    settings = load_settings(env)
    configure("WARNING")
    await migrate(settings.mysql)
    rds = aioredis.Redis.from_url(settings.redis_url)
    await rds.flushdb()
    await rds.aclose()
    return settings


class Es256Mint:
    """Buyer tokens signed ES256, as a shop's identity provider signs them; its public
    key is written as a JWKS file for the gate (`jwks_file`)."""

    KID = "hotpath-es256"

    def __init__(self, directory: str, ttl_seconds: int = 3600) -> None:
        from cryptography.hazmat.primitives.asymmetric import ec
        from jwt.algorithms import ECAlgorithm

        self._key = ec.generate_private_key(ec.SECP256R1())
        public = ECAlgorithm.to_jwk(self._key.public_key(), as_dict=True)
        self.jwks_file = os.path.join(directory, "jwks.json")
        with open(self.jwks_file, "wb") as f:
            f.write(orjson.dumps({"keys": [{**public, "kid": self.KID}]}))
        self._ttl = ttl_seconds
        self._tokens: dict[int, str] = {}

    def token(self, user_id: int) -> str:
        import jwt

        hit = self._tokens.get(user_id)
        if hit is None:
            now = int(time.time())
            claims = {"sub": str(user_id), "iat": now, "exp": now + self._ttl}
            hit = jwt.encode(claims, self._key, algorithm="ES256", headers={"kid": self.KID})
            self._tokens[user_id] = hit
        return hit


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    from gate.api.app import build_app
    from loadtest.tokens import TokenMint

    mint: Any = None
    if args.token == "es256":
        mint = Es256Mint(tempfile.mkdtemp(prefix="gate-hotpath-"))
        os.environ["GATE_JWT_JWKS_FILE"] = mint.jwks_file
    settings = await prepared_settings()
    for lever in args.off:
        switch_off(lever)
    app = build_app(settings, background=False)
    mint = mint or TokenMint(settings.jwt_secret.reveal())
    probe = Probe(app, settings.admin_token.reveal(), mint, edge=args.edge)
    n, c = args.requests, args.concurrency
    results: dict[str, Any] = {}
    async with app.router.lifespan_context(app):
        sold = await probe.deal(1)
        first = await probe.reserve_call(sold, USER_BASE - 1)()
        assert first[0] == 201, first
        open_deal = await probe.deal(BIG_STOCK)
        few = [USER_BASE + i for i in range(32)]
        reps = args.repeat
        fresh = [USER_BASE + 1000 + i for i in range(n * reps)]
        queue_deal = await probe.deal(BIG_STOCK, mode="queue")
        queue_fresh = [USER_BASE + 1000 + n * reps + i for i in range(n * reps)]
        # Warm: every token verified once, every few-buyer's limit spent.
        await drive([probe.reserve_call(sold, u) for u in few] * 4, c)
        await drive([probe.reserve_call(open_deal, u) for u in few] * 4, c)
        # The room's buyers: joiners are fresh each run, pollers joined once.
        room_deal = await probe.deal(BIG_STOCK, {"admit_per_second": 1})
        poll_deal = await probe.deal(BIG_STOCK, {"admit_per_second": 1})
        joiners = [USER_BASE + 10_000_000 + i for i in range(n * reps)]
        pollers = [USER_BASE + 20_000_000 + i for i in range(n)]
        waiters = [USER_BASE + 30_000_000 + i for i in range(n)]
        for u in [*fresh, *queue_fresh, *joiners, *pollers, *waiters]:
            app.state.gate.buyer_auth.user_id(f"Bearer {mint.token(u)}")
        if "poll" in args.cases:
            await drive([probe.queue_call("POST", poll_deal, u) for u in pollers], c)
        queued_orders: list[tuple[str, int]] = []
        waiting = {u: probe.reserve_call(queue_deal, u, f"wait-{probe.tag}-{u}") for u in waiters}
        if "order" in args.cases or "replay" in args.cases:
            # No consumer runs here: each order stays QUEUED while it is polled.
            for u in waiters:
                status, out = await waiting[u]()
                assert status == 202, (status, out)
                queued_orders.append((str(orjson.loads(out)["order_id"]), u))
        health = [functools.partial(probe.call, "GET", "/healthz", []) for _ in range(n)]
        cases: dict[str, list[Callable[[], Awaitable[tuple[int, bytes]]]]] = {
            "healthz": health,
            "sold_out": [probe.reserve_call(sold, few[i % len(few)]) for i in range(n)],
            "limited": [probe.reserve_call(open_deal, few[i % len(few)]) for i in range(n)],
            "committed": [probe.reserve_call(open_deal, u) for u in fresh],
            "queued": [probe.reserve_call(queue_deal, u) for u in queue_fresh],
            "join": [probe.queue_call("POST", room_deal, u) for u in joiners],
            "poll": [probe.queue_call("GET", poll_deal, u) for u in pollers],
            "deal": [functools.partial(probe.call, "GET", f"/v1/deals/{open_deal}", [])] * n,
            "order": [probe.order_call(o, u) for o, u in queued_orders],
            "replay": [waiting[u] for _, u in queued_orders],
        }
        # Committed, queued, join: their buyers act once, so each run its own.
        parts = {
            name: [cases[name][r * n : (r + 1) * n] for r in range(reps)]
            for name in ("committed", "queued", "join")
        }
        for name in args.cases:
            # Once unmeasured to warm caches, except the buyers who act once.
            if name not in parts:
                await drive(cases[name][: min(n, 2000)], c)
            profiler = cProfile.Profile() if args.profile else None
            samples = []
            statuses: dict[int, int] = {}
            for rep in range(reps):
                # Each call makes a fresh Idempotency-Key: the list can be run again.
                calls = parts[name][rep] if name in parts else cases[name]
                started = time.process_time()
                if profiler:
                    profiler.enable()
                got = await drive(calls, c)
                if profiler:
                    profiler.disable()
                samples.append((time.process_time() - started) / n * 1e6)
                for k, v in got.items():
                    statuses[k] = statuses.get(k, 0) + v
            samples.sort()
            results[name] = {
                "cpu_us_per_request": round(samples[0], 1),
                "median_us": round(samples[len(samples) // 2], 1),
                "samples_us": [round(x, 1) for x in samples],
                "statuses": statuses,
            }
            print(
                f"{name:>10}: {samples[0]:7.1f} µs/request (lowest of {len(samples)};"
                f" median {samples[len(samples) // 2]:.1f})  {statuses}",
                flush=True,
            )
            if profiler:
                path = f"{args.profile}.{name}.prof"
                profiler.dump_stats(path)
                out = io.StringIO()
                pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(args.top)
                print(out.getvalue())
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.hotpath", description=__doc__)
    p.add_argument("--requests", type=int, default=20_000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument(
        "--repeat", type=int, default=5, help="measured runs per path; the lowest is reported"
    )
    p.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    p.add_argument("--profile", help="write cProfile files PATH.<case>.prof")
    p.add_argument("--edge", action="store_true", help="through gate serve's protocol (see above)")
    p.add_argument("--off", nargs="+", choices=LEVERS, default=[], help="switch these levers off")
    p.add_argument("--top", type=int, default=25)
    p.add_argument(
        "--token", choices=("hs256", "es256"), default="hs256", help="the buyers' tokens (above)"
    )
    p.add_argument("--json", help="write the results here")
    p.add_argument(
        "--trace-ratio", type=float, help="traces on, this share sampled (above; 0.01: 1 %%)"
    )
    args = p.parse_args(argv)
    if args.trace_ratio is None:
        results = asyncio.run(measure(args))
    else:
        from loadtest.otlp_sink import running_sink, tracing_env

        with running_sink() as endpoint:
            os.environ.update(tracing_env(endpoint, args.trace_ratio))
            results = asyncio.run(measure(args))
    if args.json:
        with open(args.json, "wb") as f:
            f.write(orjson.dumps(results, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
