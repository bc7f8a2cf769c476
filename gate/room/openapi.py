"""The waiting room's endpoints in the OpenAPI document (gate/web/openapi.py)."""

from __future__ import annotations

from typing import Any

from gate.web.openapi_kit import (
    ADMIN,
    ADMIN_BODY_PROBLEMS,
    BUYER,
    JSON,
    _json,
    _param,
    _problems,
    _ref,
)

_TICKET_PROBLEMS = ("UNAUTHORIZED", "NOT_FOUND", "RATE_LIMITED", "OVERLOADED")


def operations() -> dict[tuple[str, str], dict[str, Any]]:
    deal = "/v1/deals/{deal_id}"
    return {
        (deal + "/queue", "post"): {
            "tags": ["buyers"],
            "summary": "Join the deal's waiting room: one ticket per buyer.",
            "description": (
                "201 with the ticket the first time, 200 with the same ticket after."
                " Joiners during the prequeue (before starts_at) are admitted in a uniformly"
                " random order at the opening, ahead of later joiners; after it, in join"
                " order. NOT_ACTIVE: before the prequeue opens or after ends_at."
            ),
            "operationId": "joinQueue",
            "security": BUYER,
            "parameters": [_param("DealId")],
            "responses": {
                "201": _json(_ref("Ticket"), "Joined: the new ticket."),
                "200": _json(_ref("Ticket"), "The buyer's existing ticket."),
                **_problems(*_TICKET_PROBLEMS, "NO_WAITING_ROOM", "NOT_ACTIVE"),
            },
        },
        (deal + "/queue", "get"): {
            "tags": ["buyers"],
            "summary": "Read the buyer's ticket (poll no sooner than poll_after_ms).",
            "operationId": "readTicket",
            "security": BUYER,
            "parameters": [_param("DealId")],
            "responses": {
                "200": _json(_ref("Ticket"), "The ticket."),
                **_problems(*_TICKET_PROBLEMS, "NO_TICKET", "NO_WAITING_ROOM"),
            },
        },
        (deal + "/queue/fairness", "get"): {
            "tags": ["buyers"],
            "summary": "The waiting room's verifiable draw (public, no authentication).",
            "description": (
                "The commitment (hex SHA-256 of the room's seed) from the room's creation;"
                " the seed and the ticket ids drawn once revealed: for fifo at starts_at"
                " (the prequeue draw), for random at ends_at. Anyone can recompute the"
                " order: sort the participants by hmac-sha256(seed, ticket_id), hex,"
                " ascending."
            ),
            "operationId": "readFairness",
            "parameters": [_param("DealId")],
            "responses": {
                "200": _json(_ref("Fairness"), "The fairness document."),
                **_problems("NOT_FOUND", "NO_WAITING_ROOM", "OVERLOADED"),
            },
        },
        ("/v1/admin/deals/{deal_id}/waiting-room", "put"): {
            "tags": ["admin"],
            "summary": "Set, change or (with null) remove the deal's waiting room, live.",
            "operationId": "setWaitingRoom",
            "security": ADMIN,
            "parameters": [_param("DealId")],
            "requestBody": {
                "required": True,
                "description": "The room, or null. At most 4 KiB, application/json.",
                "content": {JSON: {"schema": {"oneOf": [_ref("WaitingRoom"), {"type": "null"}]}}},
            },
            "responses": {
                "200": _json(_ref("AdminDealView"), "The deal's admin view."),
                **_problems(*ADMIN_BODY_PROBLEMS, "NOT_FOUND", "OVERLOADED"),
            },
        },
    }
