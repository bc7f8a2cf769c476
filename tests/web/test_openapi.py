"""The OpenAPI document stays in step with the app: every route is documented, every
documented operation is a route or one of the few contract endpoints not built yet,
and the bodies the gate really answers have the documented fields."""

from __future__ import annotations

import re
from typing import Any

import orjson

from gate.api.app import build_app
from gate.base.errors import _PROBLEMS
from gate.base.settings import Settings
from gate.web import openapi, openapi_kit
from gate.web.recorder import route_label
from tests.support import ADMIN, Client, buyer, create_deal, reserve

# Contract endpoints (docs/api.md) that no merged area serves yet. When one is
# built this test fails until it is removed from here: keep the list honest and short.
NOT_YET_BUILT: set[tuple[str, str]] = set()

# Every endpoint of the contract, as (method, path shape).
CONTRACT = {
    ("get", "/healthz"),
    ("get", "/readyz"),
    ("get", "/metrics"),
    ("get", "/v1/deals/{}"),
    ("post", "/v1/deals/{}/reservations"),
    ("get", "/v1/orders/{}"),
    ("post", "/v1/orders/{}/cancel"),
    ("post", "/v1/orders/{}/payment"),
    ("post", "/v1/admin/deals"),
    ("get", "/v1/admin/deals/{}"),
    ("post", "/v1/admin/deals/{}/stock"),
    ("put", "/v1/admin/deals/{}/buckets"),
    ("get", "/v1/admin/deals/{}/ledger"),
    ("post", "/v1/payments/{}/webhook"),
}

HTTP_METHODS = {"get", "put", "post", "delete", "patch", "options", "head", "trace"}


def shape(path: str) -> str:
    """A path with its parameters anonymised: names may differ, positions may not."""
    return re.sub(r"\{[^}]*\}", "{}", route_label(path))


def app_operations(settings: Settings) -> set[tuple[str, str]]:
    app = build_app(settings)  # no I/O until the lifespan starts
    ops = set()
    for route in app.routes:
        methods = getattr(route, "methods", None) or set()
        for method in methods:
            if method != "HEAD":  # Starlette adds HEAD to every GET
                ops.add((method.lower(), shape(getattr(route, "path", ""))))
    return ops


def documented_operations(doc: dict[str, Any]) -> set[tuple[str, str]]:
    return {
        (method, shape(path))
        for path, item in doc["paths"].items()
        for method in item
        if method in HTTP_METHODS
    }


def test_every_route_is_documented_and_every_document_path_is_served(settings: Settings) -> None:
    doc = openapi.document()
    # /metrics is served by the metrics listener (GATE_METRICS_ADDR) outside
    # GATE_ENV=dev, by the application too in dev.
    served = app_operations(settings) | {("get", "/metrics")}
    documented = documented_operations(doc)
    assert not served - documented, (
        f"routes missing from the OpenAPI document: {served - documented}"
    )
    extra = documented - served
    assert extra <= NOT_YET_BUILT, (
        f"documented but neither served nor pending: {extra - NOT_YET_BUILT}"
    )
    built = NOT_YET_BUILT & served
    assert not built, f"now served, remove from NOT_YET_BUILT: {built}"
    assert CONTRACT <= documented, f"contract endpoints not documented: {CONTRACT - documented}"
    assert ("get", "/openapi.json") in served


def _walk(node: Any) -> Any:
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk(value)


def test_document_is_well_formed() -> None:
    doc = openapi.document()
    assert doc["openapi"].startswith("3.1")
    components = doc["components"]
    for node in _walk(doc):
        ref = node.get("$ref")
        if ref is not None:
            hash_, root, section, name = ref.split("/")
            assert (hash_, root) == ("#", "components") and name in components[section], ref
    op_ids = []
    for path, item in doc["paths"].items():
        params = set(re.findall(r"\{([^}]+)\}", path))
        for method, op in item.items():
            op_ids.append(op["operationId"])
            assert op["responses"], (method, path)
            declared = set()
            for p in op.get("parameters", []):
                if "$ref" in p:
                    p = components["parameters"][p["$ref"].rsplit("/", 1)[1]]
                if p["in"] == "path":
                    declared.add(p["name"])
            assert declared == params, (method, path, declared, params)
            for status, response in op["responses"].items():
                assert status == "default" or re.fullmatch(r"[1-5](\d\d|XX)", status)
                assert response["description"]
    assert len(op_ids) == len(set(op_ids))


def test_problem_codes_match_the_errors_module() -> None:
    assert openapi_kit.PROBLEM_CODES == {code: status for code, (status, _) in _PROBLEMS.items()}
    enum = openapi.document()["components"]["schemas"]["Problem"]["properties"]["code"]["enum"]
    assert set(enum) == set(_PROBLEMS)


async def test_served_document_and_real_bodies_match(client: Client) -> None:
    r = await client.get("/openapi.json")
    assert r.status_code == 200 and r.headers["Content-Type"] == "application/json"
    doc = r.json()
    assert doc == orjson.loads(openapi.render())
    schemas = doc["components"]["schemas"]

    def fields(name: str) -> set[str]:
        return set(schemas[name]["properties"])

    deal_id = await create_deal(client, stock=1)
    deal = (await client.get(f"/v1/deals/{deal_id}")).json()
    assert set(deal) == fields("Deal")
    reserved = await reserve(client, deal_id, 6_600_001, "openapi-key-0001")
    assert reserved.status_code == 201
    assert set(reserved.json()) == fields("Reservation")
    order_id = reserved.json()["order_id"]
    order = await client.get(f"/v1/orders/{order_id}", headers=buyer(6_600_001))
    assert set(order.json()) == fields("Order")
    sold_out = await reserve(client, deal_id, 6_600_002, "openapi-key-0002")
    assert sold_out.status_code == 409
    assert set(sold_out.json()) <= fields("Problem")
    assert set(schemas["Problem"]["required"]) <= set(sold_out.json())
    admin = (await client.get(f"/v1/admin/deals/{deal_id}", headers=ADMIN)).json()
    assert set(admin) <= fields("AdminDealView")
    ledger = (await client.get(f"/v1/admin/deals/{deal_id}/ledger", headers=ADMIN)).json()
    assert set(ledger) == fields("Ledger")
    item_fields = set(schemas["Ledger"]["properties"]["items"]["items"]["properties"])
    assert set(ledger["items"][0]) == item_fields
    ready = (await client.get("/readyz")).json()
    assert set(ready) == fields("Ready")
    assert ready["status"] in schemas["Ready"]["properties"]["status"]["enum"]
    assert ready["redis_circuit"] in schemas["Ready"]["properties"]["redis_circuit"]["enum"]
    assert set(ready["db_pool"]) == set(schemas["Ready"]["properties"]["db_pool"]["properties"])
