"""`python -m loadtest.baseline serve|migrate|check` — the peer baseline's command.

The database is BASELINE_MYSQL_URL, or GATE_MYSQL_URL's server with the database
`gate_baseline`; secrets and pool settings are the gate's (GATE_JWT_SECRET, …).
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import orjson

from gate.base.settings import MysqlTarget, SettingsError


def _target() -> MysqlTarget:
    from loadtest.baseline.store import baseline_url

    try:
        return MysqlTarget.parse(baseline_url())
    except SettingsError as exc:
        print(f"baseline: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def cmd_serve(args: argparse.Namespace) -> int:
    from gate.cli import run_server
    from loadtest.baseline.store import migrate

    asyncio.run(migrate(_target()))
    # The gate's own server (uvloop, httptools, a listening socket per worker, no
    # proxy-header rewriting), so only the reservation path differs.
    app = "loadtest.baseline.lean:create_app" if args.lean else "loadtest.baseline.app:create_app"
    return run_server(app, args.host, args.port, args.workers)


def cmd_migrate(args: argparse.Namespace) -> int:
    from loadtest.baseline.store import migrate

    target = _target()
    asyncio.run(migrate(target, drop=args.drop))
    print(f"baseline schema ready in {target.database}")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from gate.store.db import Database
    from loadtest.baseline.app import baseline_settings
    from loadtest.baseline.store import check_deal, deal_ids

    async def run() -> int:
        try:
            settings = baseline_settings()
        except SettingsError as exc:
            print(f"baseline: configuration error: {exc}", file=sys.stderr)
            return 2
        db = Database(settings, pool_max=2)
        await db.start()
        try:
            ids = [args.deal] if args.deal else await deal_ids(db)
            reports = [await check_deal(db, i) for i in ids]
        finally:
            await db.close()
        ok = all(r["invariant"]["ok"] for r in reports)
        if args.json:
            sys.stdout.write(orjson.dumps({"ok": ok, "deals": reports}).decode() + "\n")
        else:
            for r in reports:
                verdict = "OK" if r["invariant"]["ok"] else "BREACH"
                print(f"deal {r['deal_id']}: {verdict} {r.get('totals', '')}")
                for breach in r["invariant"]["breaches"]:
                    print(f"  ! {breach}")
            print("all invariants hold" if ok else "INVARIANT BREACH")
        return 0 if ok else 1

    try:
        return asyncio.run(run())
    except Exception as exc:
        # No verdict (the database did not answer…), which is not a pass either.
        print(f"baseline: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.baseline", description="The DB-only peer baseline."
    )
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="run the baseline's HTTP server")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8100)
    s.add_argument("--workers", type=int, default=1)
    s.add_argument(
        "--lean",
        action="store_true",
        help="the lean peer: UPDATE the stock row, INSERT the order, COMMIT; no auth, no"
        " idempotency look-up (loadtest/baseline/lean.py)",
    )
    s.set_defaults(fn=cmd_serve)
    s = sub.add_parser("migrate", help="create the baseline's database and tables")
    s.add_argument("--drop", action="store_true", help="drop the baseline database first")
    s.set_defaults(fn=cmd_migrate)
    s = sub.add_parser("check", help="verify stock = available + ordered (exit 1 on breach)")
    s.add_argument("--deal", type=int)
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_check)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    code: int = args.fn(args)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
