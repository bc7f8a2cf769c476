"""The `gate` command."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import orjson

from gate import __version__
from gate.base.settings import Settings, SettingsError
from gate.cli.common import checked_settings, ranged_int, with_gate

SERVE_BACKLOG = 4096
PORT_MAX = 65_535
WORKERS_MAX = 64
TOKEN_TTL_SECONDS_MAX = 366 * 86_400  # a dev or test token; buyers' come from the shop


def cmd_serve(args: argparse.Namespace) -> int:
    from gate.base.logs import configure
    from gate.base.metrics import prepare_multiprocess
    from gate.store.migrate import MigrationError, migrate

    if args.no_background:
        os.environ["GATE_BACKGROUND"] = "0"
    # Also reads the Lua scripts: a missing one exits 2 here.
    settings = checked_settings()
    configure(settings.log_level)
    refusal = asyncio.run(_writer_refusal(settings))
    if refusal:
        print(f"gate: refusing to start: {refusal}", file=sys.stderr)
        return 1
    if settings.auto_migrate:
        # A current schema is only read, so the least-privilege app user may do this.
        try:
            asyncio.run(migrate(settings.mysql, settings.db_connect_timeout_seconds))
        except MigrationError as exc:
            print(f"gate: {exc}", file=sys.stderr)
            return 2
    metrics_addr = _metrics_addr(settings, args.port, args.workers)
    # Several workers keep their metrics in files one scrape merges (gate/base/metrics.py).
    metrics_dir = prepare_multiprocess(args.workers)
    return run_server(
        "gate.api.app:create_app",
        args.host,
        args.port,
        args.workers,
        worker_timeout_seconds=settings.worker_timeout_seconds,
        metrics_addr=metrics_addr,
        metrics_dir=metrics_dir,
        shutdown_delay_seconds=settings.shutdown_delay_seconds,
        shutdown_grace_seconds=settings.shutdown_grace_seconds,
    )


def _metrics_addr(settings: Settings, port: int, workers: int) -> tuple[str, int] | None:
    """Where this gate serves /metrics: GATE_METRICS_ADDR, or unset 127.0.0.1 at a
    port derived from --port (gate/base/settings.py `metrics_address`). Several
    workers: the parent binds it (`_parent_metrics`). One worker binds it in its
    lifespan, from GATE_METRICS_ADDR, written here: the address is tried first, so
    that a port in use exits 2 here too."""
    from gate.base.settings import metrics_address
    from gate.web.metrics_listener import listen_socket

    addr = metrics_address(settings, port)
    if addr is None or workers > 1:
        return addr
    try:
        listen_socket(addr).close()
    except OSError as exc:
        _cannot_listen(addr, exc)
    host = f"[{addr[0]}]" if ":" in addr[0] else addr[0]
    os.environ["GATE_METRICS_ADDR"] = f"{host}:{addr[1]}"
    return addr


def _cannot_listen(addr: tuple[str, int], exc: OSError) -> NoReturn:
    """Exit 2 naming GATE_METRICS_ADDR; when it was unset, what it defaulted to."""
    unset = not os.environ.get("GATE_METRICS_ADDR", "").strip()
    default = (
        " (GATE_METRICS_ADDR is unset: the default for this --port; set it to a free"
        " host:port, or off)"
        if unset
        else ""
    )
    reason = exc.strerror or type(exc).__name__
    print(
        f"gate: cannot listen on GATE_METRICS_ADDR {addr[0]}:{addr[1]}{default}: {reason}",
        file=sys.stderr,
    )
    raise SystemExit(2)


def _parent_metrics(addr: tuple[str, int] | None, metrics_dir: str | None) -> Any:
    """With several workers, the metrics listener of this supervising process over
    the workers' files, and GATE_METRICS_ADDR=off for the workers it spawns
    (gate/web/metrics_listener.py); None otherwise (one worker starts its own).
    Exits 2 when the address cannot be bound."""
    if addr is None or metrics_dir is None:
        return None
    from gate.web.metrics_listener import MetricsListener, files_render

    try:
        listener = MetricsListener(addr, files_render(metrics_dir)).start()
    except OSError as exc:
        _cannot_listen(addr, exc)
    os.environ["GATE_METRICS_ADDR"] = "off"
    return listener


async def _writer_refusal(settings: Settings) -> str | None:
    """Why no listed database node may take the writes (read-only, not Synced,
    unreachable: gate/store/dbwriter.py), or None when one may."""
    from gate.store.dbwriter import NoWriter, first_usable

    try:
        await first_usable(settings.mysql, settings.db_connect_timeout_seconds)
    except NoWriter as exc:
        return str(exc)
    return None


def run_server(
    app: str,
    host: str,
    port: int,
    workers: int,
    *,
    worker_timeout_seconds: float = 30.0,
    metrics_addr: tuple[str, int] | None = None,
    metrics_dir: str | None = None,
    shutdown_delay_seconds: float = 0.0,
    shutdown_grace_seconds: float = 10.0,
) -> int:
    """Serve the ASGI app factory `app` the way `gate serve` does (also the peer
    baseline's server, so that only the application differs between them).
    `metrics_addr` with `metrics_dir` (several workers): this process serves the
    merged metrics there. On SIGTERM each serving process drains for
    `shutdown_delay_seconds`, then gives requests in flight `shutdown_grace_seconds`
    (gate/cli/draining.py)."""
    listener = _parent_metrics(metrics_addr, metrics_dir)
    stop = _Stop(shutdown_delay_seconds, shutdown_grace_seconds)
    try:
        return _serve(app, host, port, workers, worker_timeout_seconds, stop)
    finally:
        if listener is not None:
            listener.stop()


@dataclass(frozen=True)
class _Stop:
    delay_seconds: float
    grace_seconds: float


def _serve(
    app: str, host: str, port: int, workers: int, worker_timeout_seconds: float, stop: _Stop
) -> int:
    import uvicorn

    from gate.cli import supervisor
    from gate.cli.draining import DrainingServer

    server: dict[str, Any] = {
        "app": app,
        "factory": True,
        "loop": "uvloop",
        # uvicorn's httptools protocol, with the edge's routes answered by the
        # protocol itself (gate/web/edge.py); any other application is served unchanged.
        "http": "gate.web.edge:EdgeProtocol",
        # Gate serves no WebSocket: a request asking to upgrade is answered as HTTP/1.1
        # (gate/web/edge.py `_unsupported_upgrade_warning`). uvicorn's own upgrade would
        # hand the connection to a protocol the edge's transport cannot switch to.
        "ws": "none",
        "access_log": False,
        # No "server: uvicorn" on every answer: it names the software to an attacker
        # and costs the sold-out answer a header (two regex checks in uvicorn).
        "server_header": False,
        # The gate reads X-Forwarded-For itself, from GATE_TRUSTED_PROXIES only;
        # uvicorn's own proxy-headers rewriting would believe any peer at 127.0.0.1.
        "proxy_headers": False,
        "log_config": None,
        "lifespan": "on",
        "timeout_graceful_shutdown": stop.grace_seconds,
    }
    if workers > 1 and supervisor.available():
        # A socket per worker (gate/cli/supervisor.py): connections spread over the workers.
        return supervisor.Supervisor(
            server,
            host,
            port,
            workers,
            SERVE_BACKLOG,
            stop.grace_seconds,
            worker_timeout_seconds=worker_timeout_seconds,
            delay_seconds=stop.delay_seconds,
        ).run()
    if workers > 1:
        # No SO_REUSEPORT (not Linux nor a BSD): uvicorn's own supervisor, which stops
        # its workers at once on SIGTERM (no drain).
        uvicorn.run(host=host, port=port, workers=workers, backlog=SERVE_BACKLOG, **server)
        return 0
    config = uvicorn.Config(host=host, port=port, backlog=SERVE_BACKLOG, **server)
    one = DrainingServer(config, stop.delay_seconds)
    one.run()
    return 0 if one.started else supervisor.STARTUP_FAILURE


def cmd_migrate(args: argparse.Namespace) -> int:
    """Apply pending migrations; with GATE_MYSQL_APP_USER, also create the gate's
    least-privilege database user (docs/operations.md, "Database users")."""
    from gate.store.migrate import (
        APP_PRIVILEGES,
        MigrationError,
        ensure_app_user,
        load_app_user,
        migrate,
    )

    settings = checked_settings()
    try:
        app_user = load_app_user(settings.environ, settings.mysql)
    except SettingsError as exc:
        print(f"gate: configuration error: {exc}", file=sys.stderr)
        return 2
    timeout = settings.db_connect_timeout_seconds
    try:
        applied = asyncio.run(migrate(settings.mysql, timeout))
        print("applied: " + ", ".join(applied) if applied else "schema is current")
        if app_user is not None:
            asyncio.run(ensure_app_user(settings.mysql, app_user, timeout))
            print(
                f"database user {app_user.name}@{app_user.host}:"
                f" {', '.join(APP_PRIVILEGES)} on {settings.mysql.database}"
            )
    except MigrationError as exc:
        print(f"gate migrate: {exc}", file=sys.stderr)
        return 1
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from gate.inventory.check import check_all, render

    async def run(gate: Any) -> int:
        try:
            await gate.redis.ping()
            client = gate.redis
        except Exception as exc:
            print(
                f"gate: Redis unreachable ({type(exc).__name__}); checking the database only",
                file=sys.stderr,
            )
            client = None
        report = await check_all(gate.db, client, args.deal)
        if args.json:
            sys.stdout.write(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode() + "\n")
        else:
            print(render(report))
        return 0 if report["ok"] else 1

    return asyncio.run(with_gate(run, scripts=False))


def cmd_token(args: argparse.Namespace) -> int:
    from gate.web.auth import mint

    settings = checked_settings()
    if not settings.jwt_hs256:
        # The secret kept then is random: a token minted with it is refused by every gate.
        print(
            "gate: buyer tokens come from the identity provider (GATE_JWT_JWKS_FILE/URL);"
            " gate token signs HS256 tokens only when GATE_JWT_SECRET is set",
            file=sys.stderr,
        )
        return 2
    try:
        print(mint(settings.jwt_secret, args.user_id, args.ttl_seconds))
    except ValueError as exc:
        print(f"gate: {exc}", file=sys.stderr)
        return 2
    return 0


def _loop_command(name: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        async def go(gate: Any) -> int:
            worker = getattr(gate, name)
            if args.once:
                done = await worker.run_once()
                print(f"{name}: {done}")
                return 0
            stop = asyncio.Event()
            await worker.run(stop)
            return 0

        return asyncio.run(with_gate(go, daemon=not args.once))

    return run


DEMO_TITLE = "Demo: limited edition"


async def _demo_deal(gate: Any, args: argparse.Namespace) -> tuple[dict[str, Any], bool]:
    """The demo deal and whether it was made now: the newest one of an earlier run
    while it has units left and no sale window (as made; unless --new), else a new
    one."""
    if not args.new:
        found = await gate.deals.newest_titled(DEMO_TITLE)
        if (
            found is not None
            and found["totals"]["available"] > 0
            and found["starts_at"] is None
            and found["ends_at"] is None
        ):
            return found, False
    created = await gate.deals.create(
        {
            "title": DEMO_TITLE,
            "unit_price": 1999,
            "currency": "USD",
            "stock": args.stock,
            "buckets": args.buckets,
            "hold_seconds": 120,
            "per_user_limit": 2,
            "max_per_order": 2,
        }
    )
    return created, True


def cmd_demo(args: argparse.Namespace) -> int:
    """Create (or find again) the demo deal and print how to try the gate with it."""
    from gate.web.auth import mint

    async def run(gate: Any) -> int:
        deal, created = await _demo_deal(gate, args)
        token = (
            mint(gate.settings.jwt_secret, 42, 86_400)
            if gate.settings.jwt_hs256
            else "<a token from your identity provider for buyer 42>"
        )
        base = args.base_url
        if created:
            print(
                f"Demo deal {deal['id']} created with {args.stock} units in {args.buckets} buckets."
            )
        else:
            totals = deal["totals"]
            print(
                f"Demo deal {deal['id']} reused: {totals['available']} of {totals['total']}"
                " units left (gate demo --new makes another)."
            )
        print("Try it (buyer 42):")
        print(f"  TOKEN={token}")
        print(f"  curl -s {base}/v1/deals/{deal['id']}")
        print(
            f"  curl -s -X POST {base}/v1/deals/{deal['id']}/reservations"
            " -H \"Authorization: Bearer $TOKEN\" -H 'Idempotency-Key: demo-key-0001'"
            " -H 'Content-Type: application/json' -d '{\"quantity\": 1}'"
        )
        print("  gate token 43   # mint a token for another buyer")
        print("  gate check      # verify every invariant")
        return 0

    return asyncio.run(with_gate(run))


def _not_yet(name: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        print(f"gate {name}: not available in this version yet", file=sys.stderr)
        return 2

    return run


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gate", description="Flash-sale admission gate.")
    p.add_argument("--version", action="version", version=f"gate {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    from gate.inventory.deals import MAX_BUCKETS, MAX_ID, MAX_STOCK
    from gate.web.auth import MAX_USER_ID

    s = sub.add_parser("serve", help="run the HTTP gate (and its background workers)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=ranged_int(1, PORT_MAX), default=8000)
    s.add_argument("--workers", type=ranged_int(1, WORKERS_MAX), default=1)
    s.add_argument("--no-background", action="store_true", help="do not run background workers")
    s.set_defaults(fn=cmd_serve)

    s = sub.add_parser("migrate", help="apply pending database migrations")
    s.set_defaults(fn=cmd_migrate)

    s = sub.add_parser("check", help="verify every invariant (exit 1 on any breach)")
    s.add_argument("--deal", type=ranged_int(1, MAX_ID))
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_check)

    s = sub.add_parser("token", help="mint a buyer token")
    s.add_argument("user_id", type=ranged_int(1, MAX_USER_ID))
    s.add_argument("--ttl-seconds", type=ranged_int(1, TOKEN_TTL_SECONDS_MAX), default=86_400)
    s.set_defaults(fn=cmd_token)

    for name, text in (
        ("janitor", "resolve orphaned in-flight reservation tokens"),
        ("resync", "repair Redis drift against the database"),
    ):
        s = sub.add_parser(name, help=text)
        s.add_argument("--once", action="store_true")
        s.set_defaults(fn=_loop_command(name))

    s = sub.add_parser(
        "demo", help="create the demo deal (or reuse an earlier run's) and print how to try it"
    )
    s.add_argument("--stock", type=ranged_int(0, MAX_STOCK), default=100)
    s.add_argument("--buckets", type=ranged_int(1, MAX_BUCKETS), default=4)
    s.add_argument(
        "--new", action="store_true", help="a new demo deal even if an earlier one has units left"
    )
    s.add_argument("--base-url", default="http://127.0.0.1:8000")
    s.set_defaults(fn=cmd_demo)

    from gate.cli import deals

    deals.add_commands(sub)

    from gate.extensions import area_modules

    for module in area_modules():
        module.add_commands(sub)
    # Contract commands no area provides yet say so instead of failing to parse.
    for name in ("sweep", "reconcile", "sandbox"):
        if name not in sub.choices:
            s = sub.add_parser(name, help=f"{name} (not available in this version yet)")
            s.add_argument("--once", action="store_true")
            s.add_argument("--port", type=ranged_int(1, PORT_MAX))
            s.set_defaults(fn=_not_yet(name))
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        code: int = args.fn(args)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (`gate deal list | head`): not an error of the command.
        # Python would report the failed flush at exit; stdout goes to /dev/null.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return code


if __name__ == "__main__":
    raise SystemExit(main())
