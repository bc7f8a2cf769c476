"""What the HTTP handlers of every domain share (gate/api/)."""

from __future__ import annotations

from starlette.requests import Request

from gate.base import validate
from gate.base.errors import not_found
from gate.runtime import Gate

MAX_ID = validate.MAX_ID


def _gate(request: Request) -> Gate:
    gate: Gate = request.app.state.gate
    return gate


def _deal_id(request: Request) -> int:
    deal_id: int = request.path_params["deal_id"]
    if not 1 <= deal_id <= MAX_ID:
        raise not_found("deal")
    return deal_id
