"""`gate webhooks list | create | show | deliveries | retry | rotate | test | disable |
enable` (docs/cli.md, docs/webhooks.md): the admin API's endpoints from a shell, through
the same checks (gate/webhooks/service.py). `--json` prints the API's answer.

    create  --url URL --events TYPE[,TYPE…]|* [--description TEXT]: prints the secret,
            once (as the API shows it once)
    rotate  ID: prints the new secret, once
Exit 0 done; 1 refused (no such endpoint or delivery, URL refused, limit reached: the
problem's code and detail on stderr); 2 configuration or arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from gate.base.errors import Problem
from gate.cli.common import ranged_int, with_gate
from gate.webhooks.config import load_webhook_settings
from gate.webhooks.service import (
    DELIVERIES_LIMIT_DEFAULT,
    DELIVERIES_LIMIT_MAX,
    DELIVERY_STATUSES,
    WebhookService,
)
from gate.webhooks.store import WebhookStore
from gate.webhooks.vault import Vault

ID_MAX = 2**63 - 1


def _print(data: Any, as_json: bool, lines: list[str]) -> None:
    if as_json:
        print(json.dumps(data, indent=2, default=str))
    else:
        print("\n".join(lines) if lines else "(none)")


def _endpoint_line(e: dict[str, Any]) -> str:
    stats = e.get("stats") or {}
    reason = f" ({e['disabled_reason']})" if e.get("disabled_reason") else ""
    rate = ""
    if stats.get("attempts_24h"):
        rate = f", {100 * stats['delivered_24h'] / stats['attempts_24h']:.1f} % delivered (24 h)"
    counts = ""
    if stats:
        counts = f", {stats.get('pending', 0)} pending, {stats.get('failed', 0)} failed"
    return f"{e['id']} {e['status']}{reason} {e['url']} [{','.join(e['events'])}]{rate}{counts}"


def _delivery_lines(d: dict[str, Any]) -> list[str]:
    head = (
        f"{d['id']} {d['status']} {d['type']} {d['event_id']}"
        f" (attempts this round: {d['attempts_in_round']})"
    )
    return [head] + [
        f"    #{a['attempt']} {a['at']} {a['duration_ms']} ms "
        + (f"HTTP {a['http_status']}" if a["http_status"] is not None else "")
        + (f" {a['error']}" if a["error"] else "")
        for a in d["attempts"]
    ]


def service_for(gate: Any) -> WebhookService:
    """The endpoints' service of a one-shot command's gate (no sender: a test event or
    a retry waits for the senders of `gate serve`)."""
    settings = load_webhook_settings(gate.settings.environ, gate.settings.is_dev)
    return WebhookService(WebhookStore(gate.db), Vault(settings.encryption_keys), settings)


async def _run(args: argparse.Namespace, gate: Any) -> int:
    service = service_for(gate)
    cmd = args.webhooks_cmd
    if cmd == "list":
        found = await service.list()
        _print({"endpoints": found}, args.json, [_endpoint_line(e) for e in found])
    elif cmd == "create":
        body: dict[str, Any] = {"url": args.url, "events": args.events.split(",")}
        if args.description is not None:
            body["description"] = args.description
        made = await service.create(body)
        _print(made, args.json, [_endpoint_line(made), f"secret (shown once): {made['secret']}"])
    elif cmd == "show":
        shown = await service.show(args.endpoint_id)
        _print(shown, args.json, [_endpoint_line(shown)])
    elif cmd == "deliveries":
        query = {"limit": str(args.limit)}
        if args.status:
            query["status"] = args.status
        if args.after:
            query["after"] = str(args.after)
        page = await service.deliveries(args.endpoint_id, query)
        lines = [line for d in page["deliveries"] for line in _delivery_lines(d)]
        if page["next_after"]:
            lines.append(f"(more: --after {page['next_after']})")
        _print(page, args.json, lines)
    elif cmd == "retry":
        queued = await service.retry(args.endpoint_id, args.delivery_id)
        _print(queued, args.json, [f"delivery {args.delivery_id} will be sent again now"])
    elif cmd == "rotate":
        rotated = await service.rotate(args.endpoint_id)
        _print(rotated, args.json, [f"new secret (shown once): {rotated['secret']}"])
    elif cmd == "test":
        sent = await service.send_test(args.endpoint_id)
        _print(
            sent, args.json, [f"webhook.test {sent['event_id']}: delivery {sent['delivery_id']}"]
        )
    else:
        status = "enabled" if cmd == "enable" else "disabled"
        changed = await service.update(args.endpoint_id, {"status": status})
        _print(changed, args.json, [_endpoint_line(changed)])
    return 0


def cmd_webhooks(args: argparse.Namespace) -> int:
    async def go(gate: Any) -> int:
        try:
            return await _run(args, gate)
        except Problem as problem:
            print(f"gate webhooks: {problem.code}: {problem.detail}", file=sys.stderr)
            return 1

    run: Callable[[Any], Awaitable[int]] = go
    return asyncio.run(with_gate(run, scripts=False))


def add_commands(sub: argparse._SubParsersAction[Any]) -> None:
    w = sub.add_parser("webhooks", help="outbound webhook endpoints and their deliveries")
    w.set_defaults(fn=cmd_webhooks)
    ws = w.add_subparsers(dest="webhooks_cmd", required=True)

    def command(name: str, text: str, *, endpoint: bool = True) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = ws.add_parser(name, help=text)
        if endpoint:
            p.add_argument("endpoint_id", metavar="ID", help="the endpoint's id")
        p.add_argument("--json", action="store_true", help="the API's answer as JSON")
        return p

    command("list", "every endpoint with its status and last 24 h", endpoint=False)
    c = command("create", "register an endpoint; prints its secret once", endpoint=False)
    c.add_argument("--url", required=True, help="https://… (see docs/webhooks.md)")
    c.add_argument("--events", required=True, help="comma-separated event types, or *")
    c.add_argument("--description", default=None, help="a note for people")
    command("show", "one endpoint and its last 24 h")
    d = command("deliveries", "the endpoint's deliveries, newest first, with their attempts")
    d.add_argument("--status", choices=DELIVERY_STATUSES, default=None, help="only these")
    d.add_argument(
        "--limit",
        type=ranged_int(1, DELIVERIES_LIMIT_MAX),
        default=DELIVERIES_LIMIT_DEFAULT,
        help=f"at most this many (1..{DELIVERIES_LIMIT_MAX})",
    )
    d.add_argument("--after", type=ranged_int(1, ID_MAX), default=None, help="the next page")
    r = command("retry", "send a delivery again now")
    r.add_argument("delivery_id", metavar="DELIVERY_ID", type=ranged_int(1, ID_MAX))
    command("rotate", "a new signing secret (the old one signs too for the overlap)")
    command("test", "send a webhook.test event")
    command("disable", "stop sending to the endpoint")
    command("enable", "send to the endpoint again")
