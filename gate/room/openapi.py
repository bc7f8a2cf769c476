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
_GATE_PROBLEMS = (
    "INVALID_REQUEST",
    "PAYLOAD_TOO_LARGE",
    "ACCESS_CODE_REQUIRED",
    "ACCESS_CODE_INVALID",
    "ACCESS_CODE_USED",
    "CHALLENGE_REQUIRED",
    "CHALLENGE_INVALID",
)
_CODE = {"type": "string", "pattern": "^[A-Za-z0-9_-]{6,64}$"}
# A code an admin adds: at least 8 characters (docs/waiting-room.md, "How long").
_ADMIN_CODE = {"type": "string", "pattern": "^[A-Za-z0-9_-]{8,64}$"}
_TICKET_ID = {"type": "string", "pattern": "^[0-9a-f]{32}$"}
_ETAG = {
    "description": "The page's entity tag (the same from every gate process; a gzipped"
    ' answer\'s ends in "-gzip"): send it back as If-None-Match.',
    "schema": {"type": "string"},
}
_JOIN_BODY = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "access_code": {**_CODE, "description": "Needed when the room's access is codes."},
        "challenge": {
            "type": "string",
            "maxLength": 200,
            "description": "From GET .../queue/challenge; needed when the room has one.",
        },
        "nonce": {
            "type": "string",
            "maxLength": 64,
            "description": 'SHA-256(challenge + ":" + nonce) starts with `bits` zero bits.',
        },
    },
}


def operations() -> dict[tuple[str, str], dict[str, Any]]:
    deal = "/v1/deals/{deal_id}"
    return {
        (deal + "/queue", "post"): {
            "tags": ["buyers"],
            "summary": "Join the deal's waiting room: one ticket per buyer.",
            "description": (
                "201 with the ticket the first time, 200 with the same ticket after (a"
                " buyer holding a ticket gets it whatever the body: no code or challenge is"
                " judged, bound or spent). Joiners during the prequeue (before starts_at)"
                " are admitted in a uniformly random order at the opening, ahead of later"
                " joiners; after it, in join order. NOT_ACTIVE: before the prequeue opens or"
                " after ends_at. A room's challenge is judged before its code; a refused"
                " code spends the challenge and counts against the buyer and the client"
                " address (RATE_LIMITED, scope access_code, past"
                " GATE_ROOM_CODE_ATTEMPTS_PER_MINUTE)."
            ),
            "operationId": "joinQueue",
            "security": BUYER,
            "parameters": [_param("DealId")],
            "requestBody": {
                "required": False,
                "description": (
                    "Empty for an open room without a challenge. At most 4 KiB. Checked"
                    " before anything is written: a refused join leaves nothing behind."
                ),
                "content": {JSON: {"schema": _JOIN_BODY}},
            },
            "responses": {
                "201": _json(_ref("Ticket"), "Joined: the new ticket."),
                "200": _json(_ref("Ticket"), "The buyer's existing ticket."),
                **_problems(*_TICKET_PROBLEMS, *_GATE_PROBLEMS, "NO_WAITING_ROOM", "NOT_ACTIVE"),
            },
        },
        **_gate_operations(),
        **_page_operations(),
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
        (deal + "/queue", "delete"): {
            "tags": ["buyers"],
            "summary": "Leave the deal's waiting room: the ticket and its place are given up.",
            "description": (
                "204 when the buyer is out of the line: this call removed the ticket (those"
                " behind move up one place; an admitted buyer's unspent admission is given"
                " back) or the buyer had left already. A later join is a new ticket at the"
                " back: never drawn, after every drawn ticket (prequeue and random rooms"
                " included), no sooner than the left ticket's poll_after_ms, and no access"
                " code is judged or bound for it (a code bound to the buyer stays theirs)."
                " NOT_IN_QUEUE: no ticket, or a closed one (its admission spent or lapsed,"
                " or the sale ended), which stays."
            ),
            "operationId": "leaveQueue",
            "security": BUYER,
            "parameters": [_param("DealId")],
            "responses": {
                "204": {"description": "Out of the line (now, or already)."},
                **_problems(
                    "UNAUTHORIZED", "NOT_FOUND", "NOT_IN_QUEUE", "NO_WAITING_ROOM", "OVERLOADED"
                ),
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
                " ascending. The participants come in pages of at most `limit` ticket ids"
                " in ticket id order, each page with the commitment, the seed,"
                " `participants_total` and a `next` link (null on the last page)."
                " Conditional and compressed: every 200 carries an ETag (If-None-Match"
                " naming it: 304, no body), `Cache-Control: no-cache` and"
                " `Vary: Accept-Encoding`; with `Accept-Encoding: gzip` the body is gzipped"
                " (`Content-Encoding: gzip`). Limited per client address"
                " (GATE_ROOM_FAIRNESS_LIMIT; RATE_LIMITED, scope fairness)."
            ),
            "operationId": "readFairness",
            "parameters": [
                _param("DealId"),
                {
                    "name": "after",
                    "in": "query",
                    "description": "Return the ticket ids that sort after this one (paging:"
                    " the last id of the previous page, as `next` gives it).",
                    "schema": _TICKET_ID,
                },
                {
                    "name": "limit",
                    "in": "query",
                    "description": "Ticket ids per page at most.",
                    "schema": {
                        "type": "integer",
                        "minimum": 1,
                        "maximum": 10_000,
                        "default": 10_000,
                    },
                },
            ],
            "responses": {
                "200": _json(
                    _ref("Fairness"),
                    "The fairness document (a page of it once revealed).",
                    headers={
                        "ETag": _ETAG,
                        "Vary": {
                            "description": "Accept-Encoding.",
                            "schema": {"type": "string"},
                        },
                        "Content-Encoding": {
                            "description": "gzip, when the request's Accept-Encoding takes gzip.",
                            "schema": {"type": "string", "enum": ["gzip"]},
                        },
                    },
                ),
                "304": {
                    "description": "Not modified: If-None-Match named this page's ETag.",
                    "headers": {"ETag": _ETAG},
                },
                **_problems(
                    "INVALID_REQUEST", "NOT_FOUND", "NO_WAITING_ROOM", "RATE_LIMITED", "OVERLOADED"
                ),
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
                "description": "The room, or null. At most 64 KiB (room for the page's"
                " logo), application/json.",
                "content": {JSON: {"schema": {"oneOf": [_ref("WaitingRoom"), {"type": "null"}]}}},
            },
            "responses": {
                "200": _json(_ref("AdminDealView"), "The deal's admin view."),
                **_problems(*ADMIN_BODY_PROBLEMS, "NOT_FOUND", "OVERLOADED"),
            },
        },
    }


def _gate_operations() -> dict[tuple[str, str], dict[str, Any]]:
    """The challenge and the access codes (gate/room/gates.py)."""
    return {
        ("/v1/deals/{deal_id}/queue/challenge", "get"): {
            "tags": ["buyers"],
            "summary": "A proof-of-work challenge for this buyer's join, priced by demand.",
            "description": (
                "bits = clamp(min_bits + floor(log2(1 + waiting / max(1, available))),"
                " min_bits, max_bits). Signed, bound to the buyer and the deal, single use,"
                " valid 120 s."
            ),
            "operationId": "getChallenge",
            "security": BUYER,
            "parameters": [_param("DealId")],
            "responses": {
                "200": _json(
                    {
                        "type": "object",
                        "properties": {
                            "challenge": {"type": "string"},
                            "bits": {"type": "integer", "minimum": 0, "maximum": 28},
                            "expires_at": {"type": "string", "format": "date-time"},
                        },
                        "required": ["challenge", "bits", "expires_at"],
                    },
                    "The challenge.",
                ),
                **_problems(
                    "UNAUTHORIZED", "NOT_FOUND", "NO_WAITING_ROOM", "NO_CHALLENGE", "OVERLOADED"
                ),
            },
        },
        ("/v1/admin/deals/{deal_id}/access-codes", "post"): {
            "tags": ["admin"],
            "summary": "Add access codes to the deal (invite-only waiting room); stored hashed.",
            "description": (
                "The admin's codes (`codes`, each at least 8 characters), or codes the gate"
                " makes (`generate`: how many; each 80 random bits, `XXXX-XXXX-XXXX-XXXX` in"
                " Crockford's base32), answered once in `codes` and kept hashed only."
            ),
            "operationId": "addAccessCodes",
            "security": ADMIN,
            "parameters": [_param("DealId")],
            "requestBody": {
                "required": True,
                "description": "1 to 10,000 codes, or a number of codes to make."
                " At most 1 MiB, application/json.",
                "content": {
                    JSON: {
                        "schema": {
                            "type": "object",
                            "properties": {
                                "codes": {
                                    "type": "array",
                                    "items": _ADMIN_CODE,
                                    "minItems": 1,
                                    "maxItems": 10_000,
                                },
                                "generate": {"type": "integer", "minimum": 1, "maximum": 10_000},
                            },
                            "oneOf": [{"required": ["codes"]}, {"required": ["generate"]}],
                            "additionalProperties": False,
                        }
                    }
                },
            },
            "responses": {
                "200": _json(
                    {
                        "type": "object",
                        "properties": {
                            "added": {"type": "integer", "minimum": 0},
                            "total": {"type": "integer", "minimum": 0},
                            "codes": {
                                "type": "array",
                                "items": {"type": "string"},
                                "description": "The codes made (with `generate` only): their"
                                " only copy.",
                            },
                        },
                        "required": ["added", "total"],
                    },
                    "Codes new to the deal, and the deal's codes in all.",
                ),
                **_problems(*ADMIN_BODY_PROBLEMS, "NOT_FOUND", "CONFLICT", "OVERLOADED"),
            },
        },
    }


_PAGE_HEADERS_NOTE = (
    " Served with a strict Content-Security-Policy (only the gate's own files and API,"
    " no inline script or style, no framing), Referrer-Policy: no-referrer and"
    " X-Content-Type-Options: nosniff."
)


_NULLABLE_TEXT = {"type": ["string", "null"]}
_BUYER_PAGE = {
    "type": "object",
    "properties": {
        "shop_name": _NULLABLE_TEXT,
        "accent_color": _NULLABLE_TEXT,
        "accent_text": {
            **_NULLABLE_TEXT,
            "description": "The colour of a button's text on the accent.",
        },
        "logo": {**_NULLABLE_TEXT, "description": "A data: URL (image/png, webp or svg+xml)."},
        "help_url": _NULLABLE_TEXT,
    },
    "required": ["shop_name", "accent_color", "accent_text", "logo", "help_url"],
}


def _page_operations() -> dict[tuple[str, str], dict[str, Any]]:
    """The buyer page (gate/room/page.py): HTML and its files, and the room's
    settings it reads. Public: the buyer's token stays in the page's fragment."""
    return {
        ("/room/{deal_id}", "get"): {
            "tags": ["buyers"],
            "summary": "The waiting room's page for buyers (HTML).",
            "description": (
                "The shop links here with `#token=<buyer token>&return=<URL>` in the"
                " fragment (never sent to the server). The page joins the room, polls as"
                " advised and, once admitted, sends the buyer to `return` with"
                " `#admission_token=…`, only if return's origin is one of the room's"
                ' return_origins (docs/waiting-room.md, "The buyer page").' + _PAGE_HEADERS_NOTE
            ),
            "operationId": "roomPage",
            "parameters": [_param("DealId")],
            "responses": {
                "200": {
                    "description": "The page (the same for every deal).",
                    "content": {"text/html": {"schema": {"type": "string"}}},
                },
                **_problems("NOT_FOUND", "OVERLOADED"),
            },
        },
        ("/room/{deal_id}/config", "get"): {
            "tags": ["buyers"],
            "summary": "What the buyer page needs of the deal's room (public).",
            "description": (
                "At most about a second old. NOT_FOUND: an unknown deal or a deal"
                " without a waiting room."
            ),
            "operationId": "roomPageConfig",
            "parameters": [_param("DealId")],
            "responses": {
                "200": _json(
                    {
                        "type": "object",
                        "properties": {
                            "deal_id": {"type": "integer", "minimum": 1},
                            "title": {"type": "string"},
                            "return_origins": {
                                "type": "array",
                                "items": {"type": "string"},
                                "description": "Where the page may send an admitted buyer"
                                " (empty: nowhere, the page refuses every return address).",
                            },
                            "access": {"type": "string", "enum": ["open", "codes"]},
                            "page": {
                                "oneOf": [_BUYER_PAGE, {"type": "null"}],
                                "description": "The shop's look (null: the gate's own).",
                            },
                        },
                        "required": ["deal_id", "title", "return_origins", "access", "page"],
                    },
                    "The room's settings for its page.",
                ),
                **_problems("NOT_FOUND", "OVERLOADED"),
            },
        },
        ("/room/static/{name}", "get"): {
            "tags": ["buyers"],
            "summary": "The buyer page's files: page.js, pow.js (its Web Worker), page.css.",
            "operationId": "roomPageFile",
            "parameters": [
                {
                    "name": "name",
                    "in": "path",
                    "required": True,
                    "schema": {"type": "string", "enum": ["page.js", "pow.js", "page.css"]},
                }
            ],
            "responses": {
                "200": {
                    "description": "The file (JavaScript or CSS)." + _PAGE_HEADERS_NOTE,
                    "content": {
                        "text/javascript": {"schema": {"type": "string"}},
                        "text/css": {"schema": {"type": "string"}},
                    },
                },
                **_problems("NOT_FOUND"),
            },
        },
    }
