"""The OpenAPI 3.1 document of the HTTP API, served at /openapi.json.

Written by hand: the document is the API contract in machine-readable form, not a
by-product of the code; docs/api.md is rendered from it (gate/api/markdown.py). Every
integer a request carries (path, query, body) states its bounds (minimum and
maximum), and the gate answers a value past them with a 4xx problem:
tests/web/test_bounds.py sends each one past its bounds, from this document.
tests/web/test_openapi.py keeps it in step with the routes the app really serves.
Areas that add endpoints beyond the contract describe them with `add_operation`.
"""

from __future__ import annotations

from copy import deepcopy
from typing import Any

import orjson

from gate import __version__
from gate.web.openapi_kit import (
    ADMIN,
    ORDER_ID,
    _problems,
)
from gate.web.openapi_paths import _paths
from gate.web.openapi_schemas import _schemas

_extra_operations: dict[tuple[str, str], dict[str, Any]] = {}
_extra_schemas: dict[str, dict[str, Any]] = {}


def add_operation(path: str, method: str, operation: dict[str, Any]) -> None:
    """Describe an endpoint an area adds (path as the route's template without
    converters, e.g. "/v1/orders/{order_id}/refunds")."""
    _extra_operations[(path, method.lower())] = deepcopy(operation)


def add_schema(name: str, schema: dict[str, Any]) -> None:
    """A component schema of an area's own (referenced as #/components/schemas/NAME)."""
    _extra_schemas[name] = deepcopy(schema)


def document() -> dict[str, Any]:
    paths = _paths()
    for (path, method), operation in _extra_operations.items():
        paths.setdefault(path, {})[method] = deepcopy(operation)
    for operations in paths.values():
        for operation in operations.values():
            if operation.get("security") == ADMIN:
                # Every admin route, an area's too: attempts at the token are limited
                # per client address (gate/web/admin_guard.py).
                operation["responses"].setdefault("429", _problems("RATE_LIMITED")["429"])
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Gate",
            "version": __version__,
            "description": (
                "Redis-fronted admission gate for flash sales of limited stock. Every "
                "non-2xx answer is `application/problem+json` with a `code`; 429 and 503 "
                "carry `Retry-After`. Every answer carries `X-Request-Id` (the client's, "
                "when it sent a sane one: 1–128 characters of `[A-Za-z0-9._:-]`). "
                "Integer fields take JSON integers only: `1.0` is refused (400), though "
                "JSON Schema counts it as an integer."
            ),
        },
        "tags": [
            {"name": "buyers"},
            {"name": "payments"},
            {"name": "admin"},
            {"name": "operations"},
        ],
        "paths": paths,
        "components": {
            "securitySchemes": {
                "buyer": {
                    "type": "http",
                    "scheme": "bearer",
                    "bearerFormat": "JWT",
                    "description": "JWT with `sub` = user id (digits) and `exp`: HS256"
                    " (GATE_JWT_SECRET) or the identity provider's key (GATE_JWT_JWKS_*).",
                },
                "admin": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "GATE_ADMIN_TOKEN. At most 10 failed attempts a minute"
                    " per client address; beyond them every request of that address that"
                    " carries a token is 429 RATE_LIMITED, the right token too.",
                },
            },
            "parameters": {
                "DealId": {
                    "name": "deal_id",
                    "in": "path",
                    "required": True,
                    "schema": {"type": "integer", "minimum": 1, "maximum": 2**63 - 1},
                },
                "OrderId": {
                    "name": "order_id",
                    "in": "path",
                    "required": True,
                    "schema": ORDER_ID,
                },
                "IdempotencyKey": {
                    "name": "Idempotency-Key",
                    "in": "header",
                    "required": True,
                    "description": "Scoped per buyer, kept at least 24 h.",
                    "schema": {"type": "string", "pattern": "^[A-Za-z0-9_.:-]{8,255}$"},
                },
            },
            "headers": {
                "RetryAfter": {
                    "description": "Seconds to wait before retrying.",
                    "schema": {"type": "integer", "minimum": 1},
                }
            },
            "schemas": {**_schemas(), **deepcopy(_extra_schemas)},
        },
    }


def render(*, indent: bool = False) -> bytes:
    option = orjson.OPT_INDENT_2 if indent else 0
    return orjson.dumps(document(), option=option | orjson.OPT_SORT_KEYS)
