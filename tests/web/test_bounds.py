"""Every integer a request carries is bounded, and the OpenAPI document says so.

Generated from the served document: for every operation, every integer path and
query parameter and every integer field of its JSON body (nested ones included) is
sent past its bounds (4,400 digits, 2**63, maximum + 1, minimum - 1, negatives) and
the answer must be a problem+json 4xx (never a 500, never a reset connection) that
changed nothing. On main `GET /v1/deals/<4,400 digits>` was a 500 and the same
`POST …/reservations` a reset connection: int() refuses more than 4,300 digits.

"Changed nothing" is judged on what the requests could change (`Scope`): the rows
of the test's own deal and of the deal a `POST /v1/admin/deals` would create, the
rows of the order, payment and event the requests name, and the deal's Redis keys,
compared row by row and key by key. Not whole tables: the shared gate's background
loops (an earlier test's hold expiring: a ledger row and an outbox row of another
deal) write to them meanwhile. A write a bad input could make is caught (shown with
writes planted on purpose, and one elsewhere that is not).
"""

from __future__ import annotations

import json as stdjson
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis.asyncio as aioredis

from gate.base.errors import Problem
from gate.payments.signing import decode_secret, sign_headers
from gate.store.db import Database
from gate.store.keys import deal_keys
from gate.web.http_io import check_json_headers
from tests.support import (
    ADMIN,
    WEBHOOK_SECRET,
    Client,
    assert_invariants,
    buyer,
    create_deal,
    reserve,
)

HUGE_DIGITS = "9" * 4400
INT64_OVER = 2**63
PLACEHOLDER = "__bounded_integer__"
HTTP_METHODS = {"get", "put", "post", "delete", "patch"}

# A valid body per request schema, each integer field of which is then replaced by
# an out-of-bounds value. A new schema with integer fields must be added here (the
# test fails until it is): that is how a new route gets covered.
BASE_BODIES: dict[str, dict[str, Any]] = {
    "ReservationRequest": {"quantity": 1},
    "DealCreate": {"title": "bounds", "unit_price": 100, "currency": "EUR", "stock": 5},
    "StockAdjustment": {"delta": 1, "reason": "bounds test"},
    "Rebucket": {"count": 2},
    "WaitingRoom": {"admit_per_second": 10, "admission_ttl_seconds": 60, "prequeue_seconds": 0},
    "addAccessCodes": {"generate": 1},
    "PaymentEvent": {
        "id": "evt_bounds",
        "type": "payment.succeeded",
        "created": 1_700_000_000,
        "data": {
            "payment_id": "pay_bounds",
            "order_id": "01JD3W9K2XG5W7Q8M4Z6V1R0TB",
            "amount": 100,
            "currency": "EUR",
        },
    },
}
PATH_VALUES = {
    "order_id": "01JD3W9K2XG5W7Q8M4Z6V1R0TB",
    "provider": "sandbox",
    "endpoint_id": "01JD3W9K2XG5W7Q8M4Z6V1R0TB",
}


def _resolve(doc: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    ref = node.get("$ref")
    if ref is None:
        return node
    _, _, section, name = ref.split("/")
    resolved: dict[str, Any] = doc["components"][section][name]
    return resolved


def _is_integer(schema: dict[str, Any]) -> bool:
    kind = schema.get("type")
    return kind == "integer" or (isinstance(kind, list) and "integer" in kind)


def _integer_fields(
    doc: dict[str, Any], schema: dict[str, Any], prefix: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], dict[str, Any]]]:
    """(path of keys, schema) of every integer field of an object schema, nested too."""
    schema = _resolve(doc, schema)
    for name, prop in schema.get("properties", {}).items():
        prop = _resolve(doc, prop)
        if _is_integer(prop):
            yield (*prefix, name), prop
        elif prop.get("type") == "object":
            yield from _integer_fields(doc, prop, (*prefix, name))


def _over_values(schema: dict[str, Any]) -> list[str]:
    """Integer literals past the schema's bounds (as JSON text)."""
    values = [HUGE_DIGITS, "-" + HUGE_DIGITS, str(INT64_OVER), str(-INT64_OVER - 1)]
    values.append(str(schema["maximum"] + 1))
    values.append(str(schema["minimum"] - 1))
    return values


def _operations(doc: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for path, item in doc["paths"].items():
        for method, op in item.items():
            if method in HTTP_METHODS:
                yield method, path, op


def _parameters(doc: dict[str, Any], op: dict[str, Any]) -> list[dict[str, Any]]:
    return [_resolve(doc, p) for p in op.get("parameters", [])]


def _body_schema(doc: dict[str, Any], op: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    body = op.get("requestBody")
    if body is None:
        return None
    schema = body["content"]["application/json"]["schema"]
    if "$ref" not in schema and schema.get("type") == "object":
        # A body described in place (e.g. POST …/access-codes): named by its operation.
        return op["operationId"], schema
    if "$ref" not in schema:
        # A nullable body (e.g. PUT …/waiting-room: the object or null): its object.
        refs = [s for s in schema.get("oneOf", schema.get("anyOf", [])) if "$ref" in s]
        assert len(refs) == 1, schema
        schema = refs[0]
    name = schema["$ref"].rsplit("/", 1)[1]
    return name, _resolve(doc, schema)


def _set(body: dict[str, Any], keys: tuple[str, ...], value: Any) -> None:
    for key in keys[:-1]:
        body = body[key]
    body[keys[-1]] = value


class Sender:
    """Builds and sends one request of an operation with chosen parameter values."""

    def __init__(self, client: Client, doc: dict[str, Any], deal_id: int) -> None:
        self.client = client
        self.doc = doc
        self.deal_id = deal_id
        self.sent = 0

    async def send(
        self,
        method: str,
        path: str,
        op: dict[str, Any],
        *,
        path_values: dict[str, str] | None = None,
        query: str = "",
        body: bytes | None = None,
    ) -> tuple[int, str, dict[str, Any] | None]:
        values = {"deal_id": str(self.deal_id), **PATH_VALUES, **(path_values or {})}
        url = re.sub(r"\{([^}]+)\}", lambda m: values[m[1]], path) + query
        headers: dict[str, str] = {}
        security = op.get("security", [])
        if {"buyer": []} in security:
            headers.update(buyer(4242))
        if {"admin": []} in security:
            headers.update(ADMIN)
        names = {p["name"] for p in _parameters(self.doc, op) if p["in"] == "header"}
        self.sent += 1
        if "Idempotency-Key" in names:
            headers["Idempotency-Key"] = f"bounds-{os.getpid()}-{self.sent:06d}"
        if body is not None:
            if "webhook-signature" in names:
                key = decode_secret(WEBHOOK_SECRET)
                headers.update(sign_headers([key], f"msg_{self.sent}", int(time.time()), body))
            headers["Content-Type"] = "application/json"
        resp = await self.client.request(method.upper(), url, content=body, headers=headers)
        is_problem = resp.headers.get("content-type") == "application/problem+json"
        problem = resp.json() if is_problem else None
        return resp.status_code, url[:80], problem


def _assert_problem_4xx(status: int, where: str, problem: dict[str, Any] | None) -> None:
    assert 400 <= status < 500, (where, status, problem)
    assert problem is not None and problem["status"] == status and problem["code"], where


@dataclass(frozen=True)
class Scope:
    """What the sweep's requests can reach: its own deal, the deal a `POST
    /v1/admin/deals` of the sweep would create (by its title), and the order, payment
    and provider event the paths and bodies name."""

    deal_id: int
    title: str
    order_id: str = PATH_VALUES["order_id"]
    payment_id: str = BASE_BODIES["PaymentEvent"]["data"]["payment_id"]
    event_id: str = BASE_BODIES["PaymentEvent"]["id"]

    def bodies(self) -> dict[str, dict[str, Any]]:
        """BASE_BODIES with this scope's title for a deal to create."""
        bodies = stdjson.loads(stdjson.dumps(BASE_BODIES))
        bodies["DealCreate"]["title"] = self.title
        return bodies  # type: ignore[no-any-return]


# Rows of the scope's orders: the named one and every order of the deal.
_OF_ORDERS = "order_id = %(order)s OR order_id IN (SELECT id FROM orders WHERE deal_id = %(deal)s)"
# Per table, its rows in the scope (every column a request could write; the outbox
# row's published_at is the relay's, not a request's).
SCOPED_ROWS: dict[str, str] = {
    "deals": "SELECT * FROM deals WHERE id = %(deal)s OR title = %(title)s",
    "deal_buckets": "SELECT * FROM deal_buckets WHERE deal_id = %(deal)s"
    " OR deal_id IN (SELECT id FROM deals WHERE title = %(title)s)",
    "inventory_ledger": "SELECT * FROM inventory_ledger WHERE deal_id = %(deal)s"
    " OR order_id = %(order)s OR deal_id IN (SELECT id FROM deals WHERE title = %(title)s)",
    "orders": "SELECT * FROM orders WHERE deal_id = %(deal)s OR id = %(order)s",
    "user_quota": "SELECT * FROM user_quota WHERE deal_id = %(deal)s",
    "outbox": "SELECT id, event_id, topic, aggregate_id, payload FROM outbox"
    " WHERE aggregate_id = %(order)s"
    " OR aggregate_id IN (SELECT id FROM orders WHERE deal_id = %(deal)s)"
    " OR JSON_VALUE(payload, '$.deal_id') = %(deal)s",
    "payments": f"SELECT * FROM payments WHERE payment_id = %(payment)s OR {_OF_ORDERS}",
    "payment_events": "SELECT * FROM payment_events WHERE event_id = %(event)s"
    f" OR payment_id = %(payment)s OR {_OF_ORDERS}",
    "payment_refunds": "SELECT * FROM payment_refunds WHERE payment_id = %(payment)s"
    f" OR {_OF_ORDERS}",
    "payment_sessions": f"SELECT * FROM payment_sessions WHERE {_OF_ORDERS}",
    "queue_dead_letters": "SELECT * FROM queue_dead_letters WHERE deal_id = %(deal)s"
    " OR order_id = %(order)s OR retried_order_id = %(order)s",
    "room_access_codes": "SELECT * FROM room_access_codes WHERE deal_id = %(deal)s",
    # The webhook endpoint the paths name (none exists: a write there would be new).
    "webhook_endpoints": "SELECT * FROM webhook_endpoints WHERE id = %(endpoint)s",
    "webhook_deliveries": "SELECT * FROM webhook_deliveries WHERE endpoint_id = %(endpoint)s",
    "webhook_attempts": "SELECT * FROM webhook_attempts WHERE delivery_id IN"
    " (SELECT id FROM webhook_deliveries WHERE endpoint_id = %(endpoint)s)",
    "webhook_endpoint_stats": "SELECT * FROM webhook_endpoint_stats"
    " WHERE endpoint_id = %(endpoint)s",
    "webhook_events": "SELECT id, event_id, type, aggregate_id, body, endpoint_id"
    " FROM webhook_events WHERE endpoint_id = %(endpoint)s",
}
# Tables no request writes: the migrations' own bookkeeping, the database writer mark,
# the webhook loops' own state (their fan-out cursor and leases, the per-order and
# per-deal sequences they number events with).
UNREACHABLE_TABLES = frozenset(
    {
        "schema_lock",
        "schema_migrations",
        "schema_routines",
        "writer_mark",
        "webhook_cursor",
        "webhook_locks",
        "webhook_sequences",
        "webhook_deal_state",
    }
)


async def _scoped_state(db: Database, rds: aioredis.Redis, scope: Scope) -> dict[str, Any]:
    """Every row and Redis key the sweep's requests could change, by table / key."""
    names = {
        "deal": scope.deal_id,
        "title": scope.title,
        "order": scope.order_id,
        "payment": scope.payment_id,
        "event": scope.event_id,
        "endpoint": PATH_VALUES["endpoint_id"],
    }
    state: dict[str, Any] = {}
    for table, sql in SCOPED_ROWS.items():
        # Database.fetchall binds positionally: the named values in order of use.
        order = re.findall(r"%\((\w+)\)s", sql)
        rows = await db.fetchall(re.sub(r"%\(\w+\)s", "%s", sql), [names[n] for n in order])
        state[table] = sorted(map(repr, rows))
    deals = [scope.deal_id] + [
        int(r[0])
        for r in await db.fetchall("SELECT id FROM deals WHERE title = %s", (scope.title,))
    ]
    for deal_id in deals:
        keys = deal_keys(deal_id)
        found = sorted(
            [
                str(k)
                async for k in rds.scan_iter(match=f"{keys.tag}:*", count=1000)
                # A resync pass's lock (gate/inventory/resync.py): the background loop's own.
                if str(k) != keys.sync_lock
            ]
        )
        state[f"redis {keys.tag}"] = [(k, await rds.dump(k)) for k in found]
    return state


def _changed(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    return sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))


async def _sweep(
    client: Client,
    doc: dict[str, Any],
    scope: Scope,
    only: set[tuple[str, str]] | None = None,
) -> set[tuple[str, str, str]]:
    """Send every integer past its bounds (of the operations `only` names, or all),
    assert each answer a problem+json 4xx; what was checked."""
    sender = Sender(client, doc, scope.deal_id)
    bodies = scope.bodies()
    checked: set[tuple[str, str, str]] = set()
    for method, path, op in _operations(doc):
        if only is not None and (method, path) not in only:
            continue
        params = _parameters(doc, op)
        found = _body_schema(doc, op)
        base_body = bodies.get(found[0]) if found else None
        valid_body = stdjson.dumps(base_body).encode() if base_body is not None else None
        for param in params:
            if not _is_integer(param["schema"]) or param["in"] not in ("path", "query"):
                continue
            for value in _over_values(param["schema"]):
                if param["in"] == "path":
                    if value.startswith("-"):
                        continue  # not digits: another route's (or no route's) path
                    status, where, problem = await sender.send(
                        method, path, op, path_values={param["name"]: value}, body=valid_body
                    )
                else:
                    status, where, problem = await sender.send(
                        method, path, op, query=f"?{param['name']}={value}", body=valid_body
                    )
                _assert_problem_4xx(status, where, problem)
                checked.add((method, path, param["name"]))
        if found is None or base_body is None:
            continue
        for keys, field in _integer_fields(doc, found[1]):
            for value in _over_values(field):
                body = stdjson.loads(stdjson.dumps(base_body))
                _set(body, keys, PLACEHOLDER)
                # json.dumps cannot write a 4,400-digit int either: splice the literal.
                text = stdjson.dumps(body).replace(f'"{PLACEHOLDER}"', value).encode()
                status, where, problem = await sender.send(method, path, op, body=text)
                _assert_problem_4xx(status, f"{where} {'.'.join(keys)}={value[:24]}", problem)
                checked.add((method, path, ".".join(keys)))
    return checked


async def test_document_states_the_bounds_of_every_request_integer(client: Client) -> None:
    doc = (await client.get("/openapi.json")).json()
    seen = []
    for method, path, op in _operations(doc):
        for param in _parameters(doc, op):
            if _is_integer(param["schema"]):
                seen.append((method, path, param["name"]))
                assert {"minimum", "maximum"} <= set(param["schema"]), (method, path, param)
        found = _body_schema(doc, op)
        if found is not None:
            name, schema = found
            for keys, field in _integer_fields(doc, schema):
                seen.append((method, path, ".".join(keys)))
                assert {"minimum", "maximum"} <= set(field), (method, path, keys, field)
                assert name in BASE_BODIES, f"{name}: add a valid body to BASE_BODIES"
    # The walk found what it should (a document reshuffle must not make it vacuous).
    assert ("get", "/v1/deals/{deal_id}", "deal_id") in seen
    assert ("get", "/v1/admin/deals/{deal_id}/ledger", "limit") in seen
    assert ("post", "/v1/deals/{deal_id}/reservations", "quantity") in seen
    assert ("post", "/v1/payments/{provider}/webhook", "data.amount") in seen
    for field in ("delta", "count", "stock", "unit_price", "per_user_limit"):
        assert any(s[2] == field for s in seen), field


async def test_every_integer_past_its_bounds_is_a_problem_4xx_and_changes_nothing(
    client: Client, db: Database, rds: aioredis.Redis
) -> None:
    doc = (await client.get("/openapi.json")).json()
    deal_id = await create_deal(client, stock=10, buckets=2, max_per_order=2)
    scope = Scope(deal_id, f"bounds {deal_id}")
    tables = {str(r[0]) for r in await db.fetchall("SHOW TABLES")}
    # Every table is judged or known to be out of any request's reach: a new table
    # must be added to SCOPED_ROWS (or UNREACHABLE_TABLES) before this passes.
    assert tables == SCOPED_ROWS.keys() | UNREACHABLE_TABLES, tables ^ (
        SCOPED_ROWS.keys() | UNREACHABLE_TABLES
    )
    before = await _scoped_state(db, rds, scope)
    assert before["deal_buckets"] and before[f"redis {deal_keys(deal_id).tag}"]
    checked = await _sweep(client, doc, scope)
    assert ("post", "/v1/deals/{deal_id}/reservations", "deal_id") in checked
    assert ("post", "/v1/payments/{provider}/webhook", "data.amount") in checked
    assert len(checked) >= 15, checked
    after = await _scoped_state(db, rds, scope)
    assert _changed(before, after) == [], _changed(before, after)
    await assert_invariants(db, rds, deal_id)


STOCK = ("post", "/v1/admin/deals/{deal_id}/stock")
CREATE = ("post", "/v1/admin/deals")
RESERVE = ("post", "/v1/deals/{deal_id}/reservations")
WEBHOOK = ("post", "/v1/payments/{provider}/webhook")


@pytest.mark.parametrize(
    ("plant", "operation", "caught"),
    [
        # What each operation would have done had it taken a bad input for a good one.
        ("stock adjusted", STOCK, ["deal_buckets", "inventory_ledger", "redis"]),
        ("deal created", CREATE, ["deal_buckets", "deals", "inventory_ledger", "redis"]),
        ("reservation taken", RESERVE, ["deal_buckets", "inventory_ledger", "orders", "redis"]),
        ("named event recorded", WEBHOOK, ["outbox", "payment_events"]),
        # Nothing, or a write outside the scope (a hold of another deal cancelled: a
        # ledger and an outbox row, as an earlier test's expiry writes them): unseen.
        ("nothing", STOCK, []),
        ("another deal's hold cancelled", RESERVE, []),
    ],
)
async def test_the_check_catches_what_a_bad_input_could_write(
    client: Client,
    db: Database,
    rds: aioredis.Redis,
    plant: str,
    operation: tuple[str, str],
    caught: list[str],
) -> None:
    """The sweep of one operation, then the write one of its bad inputs could have made
    done for real: the check names what changed (or nothing, for a write elsewhere)."""
    doc = (await client.get("/openapi.json")).json()
    deal_id = await create_deal(client, stock=10, buckets=2, max_per_order=2)
    scope = Scope(deal_id, f"bounds {deal_id}")
    before = await _scoped_state(db, rds, scope)
    assert await _sweep(client, doc, scope, only={operation})
    if plant == "stock adjusted":
        r = await client.post(
            f"/v1/admin/deals/{deal_id}/stock",
            json={"delta": 1, "reason": "planted"},
            headers=ADMIN,
        )
        assert r.status_code == 200, r.text
    elif plant == "deal created":
        await create_deal(client, title=scope.title, stock=5)
    elif plant == "reservation taken":
        assert (
            await reserve(client, deal_id, 4242, f"bounds-planted-{deal_id}")
        ).status_code == 201
    elif plant == "named event recorded":
        body = stdjson.dumps(scope.bodies()["PaymentEvent"] | {"id": f"evt_{deal_id}"}).encode()
        # This deal's own event id: the payment id stays the scope's.
        key = decode_secret(WEBHOOK_SECRET)
        headers = sign_headers([key], f"msg_planted_{deal_id}", int(time.time()), body)
        r = await client.post(
            "/v1/payments/sandbox/webhook",
            content=body,
            headers={**headers, "Content-Type": "application/json"},
        )
        assert r.status_code < 300, r.text
    elif plant == "another deal's hold cancelled":
        other = await create_deal(client, stock=3)
        held = await reserve(client, other, 4243, f"bounds-elsewhere-{other}")
        assert held.status_code == 201, held.text
        order_id = held.json()["order_id"]
        cancelled = await client.post(f"/v1/orders/{order_id}/cancel", headers=buyer(4243))
        assert cancelled.status_code == 200, cancelled.text
    after = await _scoped_state(db, rds, scope)
    changed = sorted({k.split(" ")[0] for k in _changed(before, after)})
    assert changed == caught, (plant, _changed(before, after))
    await assert_invariants(db, rds, deal_id)


@pytest.mark.parametrize(
    "path",
    [
        "/v1/deals/{huge}",
        "/v1/admin/deals/{huge}",
        "/v1/admin/deals/{deal}/ledger?limit={huge}",
        "/v1/admin/deals/{deal}/ledger?after={huge}",
    ],
)
async def test_the_measured_500s_are_4xx(client: Client, path: str) -> None:
    deal_id = await create_deal(client, stock=1)
    r = await client.get(path.format(huge=HUGE_DIGITS, deal=deal_id), headers=ADMIN)
    assert r.status_code in (400, 404), r.text
    assert r.headers["content-type"] == "application/problem+json"


async def test_the_measured_reset_is_a_404(client: Client) -> None:
    r = await client.post(
        f"/v1/deals/{HUGE_DIGITS}/reservations",
        json={"quantity": 1},
        headers={**buyer(4243), "Idempotency-Key": "bounds-reset-0001"},
    )
    assert r.status_code == 404, r.text
    assert r.json()["code"] == "NOT_FOUND"


@pytest.mark.parametrize(("length", "status"), [("\u00b2", 400), (HUGE_DIGITS, 413)])
def test_content_length_is_judged_without_int_of_it_all(length: str, status: int) -> None:
    # "²" (latin-1, so it survives the header decoding) passed str.isdigit and made
    # int() raise, as did 4,400 digits: each a 500.
    with pytest.raises(Problem) as refused:
        check_json_headers(4096, "application/json", length)
    assert refused.value.status == status
    # Leading zeros do not make a small length large.
    check_json_headers(4096, "application/json", "0" * 4400 + "12")
