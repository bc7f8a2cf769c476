"""The waiting room's page for buyers (docs/waiting-room.md, "The buyer page").

    shop ── link ──> GET /room/{deal_id}#token=<buyer JWT>&return=<shop URL>
                     (the fragment never leaves the browser)
    page ── GET /room/static/{page.js, pow.js, page.css}   (no other origin)
         ── GET /room/{deal_id}/config ──> {"return_origins", "access", "page", ...}
            the shop's look: name as text, accent colour, logo as an <img> from a
            data: URL (img-src 'self' data:), help link
            return's origin not among them ──> refused on the page, no token sent
         ── GET  /v1/deals/{id}/queue/challenge ── solved in a Web Worker (pow.js)
         ── POST /v1/deals/{id}/queue {challenge, nonce, access_code?}
         ── GET  /v1/deals/{id}/queue   as often as poll_after_ms advises
         ── admitted ──> location.assign(return#admission_token=…)

The page is the same bytes for every deal: it reads the deal id from its path and
the room's return origins from the config read, so every answer here is cached
bytes but the config (the deal's row, at most a second old, gate/inventory/deals.py,
behind the unknown-deal guard: a random id costs no database statement; concurrent
reads of a row not held share one look-up; a room's logo, kept apart from the row,
is read once per logo and process: `Logos`). The routes that name a deal are
registered through the room's DealRoutes (gate/room/routes.py), as every room route.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.resources
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from gate.base.errors import not_found
from gate.base.singleflight import SingleFlight
from gate.inventory.room_config import RoomConfig
from gate.room.routes import DealRoutes
from gate.store.db import Database
from gate.web.http_io import json_response

if TYPE_CHECKING:
    from gate.inventory.deals import Deals
STATIC_FILES = {
    "page.js": "text/javascript; charset=utf-8",
    "pow.js": "text/javascript; charset=utf-8",
    "page.css": "text/css; charset=utf-8",
}
# Only the gate's own files and API: no inline script or style, no framing, no form
# posts, no referrer (the page's address names the deal and nothing more).
CSP = (
    "default-src 'none'; script-src 'self'; worker-src 'self'; connect-src 'self';"
    " style-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none';"
    " frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
    "Cross-Origin-Opener-Policy": "same-origin",
}
# The page answers 404 once a room is removed: never kept by a cache. The assets are
# the same for every deal and version-bound only to the installed gate.
PAGE_HEADERS = {**SECURITY_HEADERS, "Cache-Control": "no-store"}
STATIC_HEADERS = {**SECURITY_HEADERS, "Cache-Control": "public, max-age=300"}
CONFIG_HEADERS = {**SECURITY_HEADERS, "Cache-Control": "no-store"}


# Logos held per process (each at most a 43,718-character data: URL: about 11 MB).
LOGOS_MAX = 256


class Logos:
    """A room's page logo (deals.room_logo), read once per logo and process: the
    room's JSON names it by its SHA-256, so a changed logo is read again and an
    unchanged one never."""

    def __init__(self, db: Database) -> None:
        self.db = db
        # deal -> (SHA-256 of the logo held, its data: URL or None)
        self._held: dict[int, tuple[str, str | None]] = {}
        self._filling: SingleFlight[tuple[int, str], str | None] = SingleFlight()

    async def get(self, deal_id: int, sha256: str) -> str | None:
        hit = self._held.get(deal_id)
        if hit is not None and hit[0] == sha256:
            return hit[1]
        return await self._filling.run((deal_id, sha256), lambda: self._fill(deal_id))

    async def _fill(self, deal_id: int) -> str | None:
        row = await self.db.fetchone("SELECT room_logo FROM deals WHERE id = %s", (deal_id,))
        url = str(row[0]) if row and row[0] else None
        # Held under the digest of what was read (the row may have changed since the
        # room's JSON was): the next config read of an older digest reads again.
        digest = ""
        if url:
            digest = hashlib.sha256(base64.b64decode(url.partition(",")[2])).hexdigest()
        if len(self._held) >= LOGOS_MAX:
            self._held.clear()
        self._held[deal_id] = (digest, url)
        return url


def _static(name: str) -> bytes:
    return importlib.resources.files("gate.room").joinpath("static", name).read_bytes()


class BuyerPage:
    """GET /room/{deal_id}, its config read and its static files."""

    def __init__(self, deals: Deals, db: Database) -> None:
        self.deals = deals
        self.logos = Logos(db)
        self._page = _static("index.html")
        self._files = {name: _static(name) for name in STATIC_FILES}

    async def _room(self, deal_id: int) -> tuple[int, str, RoomConfig]:
        """The deal's id, title and room; 404 for an unknown deal (without the
        database for a random id) or a deal without a room."""
        deal = await self.deals.cached(deal_id)
        room = RoomConfig.from_column(deal.waiting_room)
        if room is None:
            raise not_found("waiting room")
        return deal_id, deal.title, room

    async def page(self, request: Request, deal_id: int) -> Response:
        await self._room(deal_id)
        return Response(self._page, media_type="text/html; charset=utf-8", headers=PAGE_HEADERS)

    async def config(self, request: Request, deal_id: int) -> Response:
        deal_id, title, room = await self._room(deal_id)
        body: dict[str, Any] = {
            "deal_id": deal_id,
            "title": title,
            "return_origins": list(room.return_origins),
            "access": room.access,
            "page": None,
        }
        look = room.page
        if look is not None:
            logo = await self.logos.get(deal_id, look.logo.sha256) if look.logo else None
            body["page"] = look.buyer_view(logo)
        return json_response(body, headers=CONFIG_HEADERS)

    async def static(self, request: Request) -> Response:
        name = request.path_params["name"]
        body = self._files.get(name)
        if body is None:
            raise not_found("file")
        return Response(body, media_type=STATIC_FILES[name], headers=STATIC_HEADERS)

    def add_routes(self, deals: DealRoutes) -> None:
        """The page and its config read, which name a deal."""
        deals.add("/room/{deal_id:id}", self.page, ["GET"])
        deals.add("/room/{deal_id:id}/config", self.config, ["GET"])

    def static_routes(self) -> list[BaseRoute]:
        return [Route("/room/static/{name:str}", self.static, methods=["GET"])]
