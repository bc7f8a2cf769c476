"""`gate deal …`: the admin API's deal operations for the people who run a sale, from
a shell, plus repair and bucket advice.

    gate deal list | create | show | stock | buckets [--count N | --advise] | ledger | repair
        | pause [--reason TEXT] | resume
        |  argparse: types, ranges, the operator name        -> exit 2, nothing changed
        v
    the same functions as the admin endpoints (gate/inventory/deals.py: Deals.create,
    admin_view, adjust_stock, rebucket, ledger), with the same bodies: the same
    validation, ledger rows and Redis effects; repair is gate/inventory/repair.py, the
    advice gate/inventory/advice.py, pause and resume gate/inventory/pause.py (resume only
    when `gate check --deal ID` passes: refused, exit 1, naming the breaches)
        |  Problem 400/404/413/415/422 (bad input, no such deal)      -> exit 2
        |  Problem 409/503, database or Redis unreachable (refused)    -> exit 1
        v
    the answer: text, or with --json the admin API's JSON        -> exit 0

Mutating commands write the operator (`--operator NAME`, default the OS user) as the
ledger rows' actor, where the admin API writes "admin".
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import re
import sys
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

import orjson

from gate.base.errors import Problem
from gate.cli.common import ranged_float, ranged_int, with_gate
from gate.inventory.advice import SAMPLE_SECONDS_MAX
from gate.inventory.deals import LEDGER_PAGE_MAX, LIST_PAGE_MAX, MAX_BUCKETS, MAX_ID
from gate.inventory.pause import REASON_MAX_CHARS
from gate.inventory.repair import WAIT_SECONDS_MAX
from gate.store.db import DbUnavailable

EXIT_OK = 0
EXIT_REFUSED = 1
EXIT_BAD_INPUT = 2
BAD_INPUT_STATUSES = frozenset((400, 404, 413, 415, 422))
OPERATOR_RE = re.compile(r"^[A-Za-z0-9_.@:+-]{1,64}$")
ADVISE_SAMPLE_SECONDS = 2.0


def _operator(raw: str) -> str:
    if not OPERATOR_RE.match(raw):
        raise argparse.ArgumentTypeError(
            "must be 1-64 characters of [A-Za-z0-9_.@:+-] (it is written to the ledger)"
        )
    return raw


def _reason(raw: str) -> str:
    if not raw.strip() or len(raw) > REASON_MAX_CHARS or not raw.isprintable():
        raise argparse.ArgumentTypeError(
            f"must be 1-{REASON_MAX_CHARS} printable characters (it is written to the ledger)"
        )
    return raw


def _http_url(raw: str) -> str:
    parts = urlsplit(raw)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"must be an http(s):// URL, got {raw!r}")
    return raw


def _default_operator() -> str:
    try:
        name = getpass.getuser()
    except (KeyError, OSError):
        return "operator"
    return name if OPERATOR_RE.match(name) else "operator"


# `int` would take "-5" or "10**30" for a deal id and fail later with a database error.
_deal_id = ranged_int(1, MAX_ID)


def _emit(args: argparse.Namespace, data: Any, text: Callable[[Any], str]) -> None:
    if args.json:
        sys.stdout.write(orjson.dumps(data, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        print(text(data))


def _run(
    args: argparse.Namespace,
    work: Callable[[Any], Awaitable[Any]],
    text: Callable[[Any], str],
) -> int:
    """Run `work(gate)` with the database and Redis, map its outcome to an exit code."""

    async def go(gate: Any) -> int:
        try:
            data = await work(gate)
        except Problem as problem:
            print(f"gate deal {args.deal_command}: {problem.detail}", file=sys.stderr)
            return EXIT_BAD_INPUT if problem.status in BAD_INPUT_STATUSES else EXIT_REFUSED
        _emit(args, data, text)
        return EXIT_OK

    try:
        return asyncio.run(with_gate(go, scripts=False))
    except BrokenPipeError:
        raise  # the reader of the output went away: gate/cli/__init__.py main() ends quietly
    except (DbUnavailable, OSError) as exc:
        print(f"gate deal {args.deal_command}: unavailable: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    except Exception as exc:
        # pymysql and redis errors: the command could not run; say which.
        print(
            f"gate deal {args.deal_command}: failed: {type(exc).__name__}: {exc}", file=sys.stderr
        )
        return EXIT_REFUSED


# -- text renderings ------------------------------------------------------------------


def _deal_text(view: dict[str, Any]) -> str:
    from gate.inventory.check import render

    lines = [
        f"deal {view['id']}: {view['title']!r}  {view['unit_price']} {view['currency']}"
        f"  buckets={view['buckets']} (epoch {view['layout_epoch']})"
        f"  hold={view['hold_seconds']}s  per_user_limit={view['per_user_limit']}"
        f"  max_per_order={view['max_per_order']}  capture={view['capture_mode']}",
        f"  sale: {view['starts_at'] or '-'} .. {view['ends_at'] or '-'}",
    ]
    if view.get("paused"):
        lines.append(
            f"  PAUSED since {view['paused']['since']}: {view['paused']['reason']}"
            f" (gate deal resume {view['id']})"
        )
    if "invariant" in view:
        report = {"ok": view["invariant"]["ok"], "deals": [view]}
        lines.append(render(report))
        for row in view.get("bucket_rows", []):
            lines.append(
                f"  bucket {row['bucket']}: total={row['total']} available={row['available']}"
                f" held={row['held']} sold={row['sold']} redis={row.get('redis_available')}"
            )
    return "\n".join(lines)


def _list_text(page: dict[str, Any]) -> str:
    lines = []
    for d in page["items"]:
        t = d["totals"]
        lines.append(
            f"deal {d['id']}: {d['title']!r}  buckets={d['buckets']}  total={t['total']}"
            f" available={t['available']} held={t['held']} sold={t['sold']}"
        )
    if not lines:
        lines.append("no deals")
    if page["next_after"] is not None:
        lines.append(f"more: --after {page['next_after']}")
    return "\n".join(lines)


def _ledger_text(page: dict[str, Any]) -> str:
    lines = []
    for r in page["items"]:
        d = r["delta"]
        lines.append(
            f"{r['id']} {r['created_at']} bucket {r['bucket']} {r['reason']} by {r['actor']}:"
            f" total {d['total']:+d} available {d['available']:+d} held {d['held']:+d}"
            f" sold {d['sold']:+d} ({r['available_before']} -> {r['available_after']})"
            + (f" order {r['order_id']}" if r["order_id"] else "")
            + (f" - {r['note']}" if r["note"] else "")
        )
    if not lines:
        lines.append(f"deal {page['deal_id']}: no ledger rows")
    if page["next_after"] is not None:
        lines.append(f"more: --after {page['next_after']}")
    return "\n".join(lines)


def _repair_text(report: dict[str, Any]) -> str:
    head = f"deal {report['deal_id']}: "
    if not report["changed"]:
        return head + "counters and per-user quota agree with the orders; nothing to repair"
    lines = [
        head
        + ("would repair (dry run, nothing changed)" if report["dry_run"] else "repaired")
        + f" by {report['operator']}"
    ]
    for b in report["buckets"]:
        diffs = [
            f"{k} {b['before'][k]} -> {b['after'][k]}"
            for k in ("total", "available", "held", "sold")
            if b["before"][k] != b["after"][k]
        ]
        led = [
            f"{k} {b['ledger_before'][k]}"
            for k in ("total", "available", "held", "sold")
            if b["ledger_before"][k] != b["after"][k]
        ]
        text = ", ".join(diffs) or "counters unchanged"
        if led:
            text += "; ledger summed " + ", ".join(led)
        lines.append(f"  bucket {b['bucket']}: {text}")
    q = report["quota"]
    if q["rows"]:
        lines.append(
            f"  per-user quota: {q['rows']} buyer row(s), units {q['units_before']} ->"
            f" {q['units_after']}"
        )
        for row in q["shown"]:
            lines.append(f"    user {row['user_id']}: {row['before']} -> {row['after']}")
    return "\n".join(lines)


def _pause_text(view: dict[str, Any]) -> str:
    deal = view["deal_id"]
    if view["paused"]:
        head = "paused" if view["changed"] else f"already paused since {view['paused_at']}"
        return (
            f"deal {deal}: {head} ({view['reason']}); reservations answer 503 SALE_PAUSED"
            f" and the waiting room admits nobody until `gate deal resume {deal}`"
        )
    if view["changed"]:
        return f"deal {deal}: resumed; gate check passes and the sale goes on"
    return f"deal {deal}: not paused; nothing changed"


def _advice_text(advice: dict[str, Any]) -> str:
    lines = [
        f"deal {advice['deal_id']}: {advice['buckets']} bucket(s); recommended"
        f" {advice['recommended_buckets']} ({advice['change']})"
    ]
    lines.extend(f"  - {r}" for r in advice["reasons"])
    if advice["change"] != "keep":
        lines.append(
            f"  apply: gate deal buckets {advice['deal_id']} --count"
            f" {advice['recommended_buckets']}"
        )
    return "\n".join(lines)


# -- commands -------------------------------------------------------------------------


def cmd_list(args: argparse.Namespace) -> int:
    return _run(args, lambda gate: gate.deals.list_admin(args.after, args.limit), _list_text)


def cmd_create(args: argparse.Namespace) -> int:
    fields = {
        "title": args.title,
        "unit_price": args.unit_price,
        "currency": args.currency,
        "stock": args.stock,
        "buckets": args.buckets,
        "partitions": args.partitions,
        "hold_seconds": args.hold_seconds,
        "per_user_limit": args.per_user_limit,
        "max_per_order": args.max_per_order,
        "starts_at": args.starts_at,
        "ends_at": args.ends_at,
        "capture_mode": args.capture_mode,
    }
    # Only what was given: the defaults and the checks are the admin API's.
    body = {k: v for k, v in fields.items() if v is not None}
    return _run(args, lambda gate: gate.deals.create(body, actor=args.operator), _deal_text)


def cmd_show(args: argparse.Namespace) -> int:
    return _run(args, lambda gate: gate.deals.admin_view(args.deal_id), _deal_text)


def cmd_stock(args: argparse.Namespace) -> int:
    body = {"delta": args.delta, "reason": args.reason}
    return _run(
        args,
        lambda gate: gate.deals.adjust_stock(args.deal_id, body, actor=args.operator),
        _deal_text,
    )


def cmd_buckets(args: argparse.Namespace) -> int:
    if args.advise:
        from gate.inventory.advice import advise

        return _run(
            args,
            lambda gate: advise(gate.db, args.deal_id, args.sample_seconds, args.gate_url),
            _advice_text,
        )
    body = {"count": args.count}
    return _run(
        args, lambda gate: gate.deals.rebucket(args.deal_id, body, actor=args.operator), _deal_text
    )


def cmd_ledger(args: argparse.Namespace) -> int:
    async def work(gate: Any) -> dict[str, Any]:
        page: dict[str, Any] = await gate.deals.ledger(args.deal_id, args.after, args.limit)
        return page

    return _run(args, work, _ledger_text)


def cmd_repair(args: argparse.Namespace) -> int:
    from gate.inventory.repair import repair

    return _run(
        args,
        lambda gate: repair(
            gate.db,
            gate.mirror,
            args.deal_id,
            operator=args.operator,
            dry_run=args.dry_run,
            wait_seconds=args.wait,
        ),
        _repair_text,
    )


def cmd_pause(args: argparse.Namespace) -> int:
    from gate.inventory.pause import pause

    return _run(
        args,
        lambda gate: pause(
            gate.db, gate.mirror, args.deal_id, reason=args.reason, actor=args.operator
        ),
        _pause_text,
    )


def cmd_resume(args: argparse.Namespace) -> int:
    from gate.inventory.pause import resume

    return _run(
        args,
        lambda gate: resume(gate.db, gate.mirror, args.deal_id, actor=args.operator),
        _pause_text,
    )


def add_commands(sub: Any) -> None:
    deal = sub.add_parser(
        "deal",
        help="list, create, show, adjust, rebucket, repair, pause, resume deals (the admin API"
        " from a shell)",
        description="Exit codes: 0 done; 2 bad input or no such deal (nothing changed);"
        " 1 refused or failed (a conflict, reservations in flight, the database or Redis"
        " unreachable).",
    )
    dsub = deal.add_subparsers(dest="deal_command", required=True)

    def command(name: str, help_text: str, fn: Callable[[argparse.Namespace], int]) -> Any:
        p = dsub.add_parser(name, help=help_text)
        p.add_argument("--json", action="store_true", help="the admin API's JSON")
        p.set_defaults(fn=fn)
        return p

    def operator(p: Any) -> None:
        p.add_argument(
            "--operator",
            type=_operator,
            default=_default_operator(),
            help="who does this, written to the ledger (default: the OS user)",
        )

    p = command("list", "deals in id order with their stock totals", cmd_list)
    p.add_argument("--after", type=ranged_int(0, MAX_ID), default=0, help="deal id to start after")
    p.add_argument("--limit", type=ranged_int(1, LIST_PAGE_MAX), default=100)

    p = command("create", "create a deal (POST /v1/admin/deals)", cmd_create)
    p.add_argument("--title", required=True)
    p.add_argument("--unit-price", type=int, required=True, help="minor units, e.g. cents")
    p.add_argument("--currency", required=True, help="ISO 4217, e.g. USD")
    p.add_argument("--stock", type=int, required=True)
    p.add_argument("--buckets", type=int)
    p.add_argument("--partitions", type=int, help="Redis partitions (docs/scale-out.md)")
    p.add_argument("--hold-seconds", type=int)
    p.add_argument("--per-user-limit", type=int)
    p.add_argument("--max-per-order", type=int)
    p.add_argument("--starts-at", help="ISO 8601 with an offset, e.g. 2026-11-29T10:00:00Z")
    p.add_argument("--ends-at")
    p.add_argument("--capture-mode", help="automatic or manual")
    operator(p)

    p = command("show", "the admin view and invariant report (GET /v1/admin/deals/ID)", cmd_show)
    p.add_argument("deal_id", type=_deal_id)

    p = command("stock", "add or remove available units (POST …/stock)", cmd_stock)
    p.add_argument("deal_id", type=_deal_id)
    p.add_argument("--delta", type=int, required=True, help="units, + adds, - removes")
    p.add_argument("--reason", required=True, help="written to the ledger")
    operator(p)

    p = command("buckets", "change the bucket count (PUT …/buckets), or --advise", cmd_buckets)
    p.add_argument("deal_id", type=_deal_id)
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--count", type=int, help=f"the new bucket count, 1..{MAX_BUCKETS}")
    how.add_argument(
        "--advise",
        action="store_true",
        help="recommend a count from the deal's lock waits, load and stock (changes nothing)",
    )
    p.add_argument(
        "--sample-seconds",
        type=ranged_float(0.0, SAMPLE_SECONDS_MAX),
        default=ADVISE_SAMPLE_SECONDS,
        help="with --advise: how long to watch the deal's lock waits",
    )
    p.add_argument(
        "--gate-url",
        type=_http_url,
        help="with --advise: also read this running gate's /metrics, from its metrics"
        " listener (GATE_METRICS_ADDR, e.g. http://gate:18000)",
    )
    operator(p)

    p = command("ledger", "the deal's stock ledger (GET …/ledger)", cmd_ledger)
    p.add_argument("deal_id", type=_deal_id)
    p.add_argument("--after", type=ranged_int(0, MAX_ID), default=0, help="ledger id")
    p.add_argument("--limit", type=ranged_int(1, LEDGER_PAGE_MAX), default=100)

    p = command(
        "repair", "recompute the bucket counters and per-user quota from the orders", cmd_repair
    )
    p.add_argument("deal_id", type=_deal_id)
    p.add_argument("--dry-run", action="store_true", help="show the difference, change nothing")
    p.add_argument(
        "--wait",
        type=ranged_float(0.0, WAIT_SECONDS_MAX),
        default=0.0,
        help="wait up to this long for reservations in flight to finish (default: refuse)",
    )
    operator(p)

    p = command(
        "pause",
        "pause the deal's sale: reservations answer 503 SALE_PAUSED, the room admits nobody",
        cmd_pause,
    )
    p.add_argument("deal_id", type=_deal_id)
    p.add_argument(
        "--reason",
        type=_reason,
        default="paused by hand",
        help=f"why, written to the ledger (at most {REASON_MAX_CHARS} characters)",
    )
    operator(p)

    p = command(
        "resume",
        "resume a paused sale, only when `gate check --deal ID` passes (refused otherwise)",
        cmd_resume,
    )
    p.add_argument("deal_id", type=_deal_id)
    operator(p)
