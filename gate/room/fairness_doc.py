"""The fairness document, encoded once per change and served from those bytes
(docs/waiting-room.md, "Verifiable draw").

    GET /v1/deals/{id}/queue/fairness[?after=<ticket id>&limit=<1..10000>]
      ── the query checked (400), then the client address's limit (429, lua/limit.lua,
         GATE_ROOM_FAIRNESS_LIMIT, across deals and gate processes)
      ── FairnessDocs.current: one room_fairness.lua call (shared by the requests of
         the deal in flight: a single flight) gives the document's version
             (method, seed, revealed, ids drawn, the last id drawn)
         ├─ the version this process holds ──> its Document, as it is
         └─ changed (or none held) ──> encoded now: the head once, and once revealed
            the draw list read in pages of 10,000 ids and kept sorted by ticket id as
            one JSON array of fixed-width entries ('"<32 hex>",', 35 bytes each)
      ── a page: `after` found by binary search, the page a slice of those bytes
         ├─ If-None-Match names the page's ETag ──> 304, no body
         └─ 200, gzipped when Accept-Encoding asks (each page gzipped once, kept)

A page holds at most 10,000 ids (about 350 KB), the commitment and the seed on every
page, `participants_total` and a `next` link (null on the last page): a third party
reads the pages in turn and recomputes the whole draw, as from one document. The
ETag is a function of the version and the page (the same in every gate process).
Memory: 35 bytes per drawn ticket of each revealed document held (at most DOCS_MAX
documents, DOCS_BYTES_MAX together; the least recently asked go first).
"""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import logging
import re
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import orjson

from gate.base import validate
from gate.base.codes import RoomCode
from gate.base.errors import RawResponse, encode_answer, from_room, invalid, raw_headers
from gate.base.limits import LimitSpec, rate_limited
from gate.base.metrics import METRICS
from gate.base.singleflight import SingleFlight
from gate.room import fairness, metrics
from gate.room.routes import NotLoaded
from gate.room.service import ticket_failed
from gate.store.keys import deal_keys, room_fairness_limit
from gate.store.resp import text
from gate.store.scripts import ScriptRunner

log = logging.getLogger("gate.room")

# Ids per page at most (and by default).
PAGE_MAX = 10_000
# One entry of the participants' array as kept: '"' + 32 hex + '",'.
ENTRY = 35
TICKET_ID_RE = re.compile(r"[0-9a-f]{32}")
# A run of ids joined by '","' (what a bucket of the draw list must be).
ID_RUN_RE = re.compile(r'[0-9a-f]{32}(?:","[0-9a-f]{32})*')
DOCS_MAX = 64
DOCS_BYTES_MAX = 256 * 1024 * 1024
# Gzipped pages kept (each made once).
GZIP_ENTRIES_MAX = 4096
GZIP_BYTES_MAX = 32 * 1024 * 1024
# Hex ids compress to about 56 % whatever the level; 1 is the cheapest.
GZIP_LEVEL = 1
# Buckets of the draw list sorted between two turns of the loop while it is encoded.
BUCKETS_PER_TURN = 16
CACHE_CONTROL = "no-cache"

Version = tuple[str, str, int, int, str]


def page_query(params: Mapping[str, str]) -> tuple[str | None, int]:
    """`after` (a ticket id, or None: from the start) and `limit` of a page."""
    after = params.get("after")
    if after is not None and not TICKET_ID_RE.fullmatch(after):
        raise invalid("Query parameter 'after' must be a ticket id: 32 characters of 0-9, a-f.")
    raw = params.get("limit")
    if raw is None:
        return after, PAGE_MAX
    limit = validate.digits(raw, PAGE_MAX)
    if limit is None or limit < 1:
        raise invalid(f"Query parameter 'limit' must be an integer between 1 and {PAGE_MAX}.")
    return after, limit


def wants_gzip(accept_encoding: str | None) -> bool:
    """Whether Accept-Encoding takes gzip (gzip, x-gzip or *, with q above 0; an
    explicit gzip entry counts before *)."""
    if not accept_encoding:
        return False
    star = False
    for part in accept_encoding.split(",")[:32]:
        coding, _, params = part.partition(";")
        coding = coding.strip().lower()
        q = 1.0
        for param in params.split(";"):
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                try:
                    q = float(value.strip())
                except ValueError:
                    q = 0.0
        if coding in ("gzip", "x-gzip"):
            return q > 0
        if coding == "*":
            star = q > 0
    return star


def etag_matches(if_none_match: str, tag: str) -> bool:
    """If-None-Match names this page (either encoding's tag, weak or strong) or is *."""
    for part in if_none_match.split(",")[:64]:
        candidate = part.strip()
        if candidate == "*":
            return True
        candidate = candidate.removeprefix("W/").strip('"').removesuffix("-gzip")
        if candidate == tag:
            return True
    return False


class Document:
    """One version of a deal's fairness document, encoded."""

    __slots__ = ("count", "deal_id", "head", "ids", "revealed", "tag", "version")

    def __init__(self, deal_id: int, version: Version, ids: bytes, count: int) -> None:
        method, seed_hex, revealed, _, _ = version
        self.deal_id = deal_id
        self.version = version
        self.revealed = revealed == 1
        self.ids = ids
        self.count = count
        head = {
            "deal_id": deal_id,
            "method": method,
            "commitment": fairness.commitment(bytes.fromhex(seed_hex)),
            "seed": seed_hex if self.revealed else None,
            "rule": fairness.RULE,
        }
        self.head = orjson.dumps(head)[:-1] + b',"participants":'
        # The same in every process: the version, and the commitment for the seed
        # (the seed itself stays out of anything shown before the reveal).
        stamp = f"{deal_id}|{method}|{head['commitment']}|{revealed}|{count}|{version[4]}"
        self.tag = hashlib.sha256(stamp.encode()).hexdigest()[:32]

    @property
    def nbytes(self) -> int:
        return len(self.ids) + len(self.head)

    def window(self, after: str | None, limit: int) -> tuple[int, int]:
        """The entries [start, end) of the page after `after`."""
        if not self.revealed:
            return 0, 0
        start = self._after(after.encode()) if after else 0
        return start, min(self.count, start + limit)

    def _after(self, after: bytes) -> int:
        """The first entry whose id sorts above `after` (binary search)."""
        ids, lo, hi = self.ids, 0, self.count
        while lo < hi:
            mid = (lo + hi) // 2
            at = mid * ENTRY + 1
            if ids[at : at + 32] <= after:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def page_tag(self, start: int, end: int, limit: int) -> str:
        if not self.revealed:
            return self.tag
        return hashlib.sha256(f"{self.tag}|{start}|{end}|{limit}".encode()).hexdigest()[:32]

    def body(self, start: int, end: int, limit: int) -> bytes:
        if not self.revealed:
            return self.head + b'null,"participants_total":null,"next":null}'
        items = self.ids[start * ENTRY : end * ENTRY - 1] if end > start else b""
        link = b"null"
        if start < end < self.count:
            last = self.ids[(end - 1) * ENTRY + 1 : (end - 1) * ENTRY + 33].decode()
            link = b'"/v1/deals/%d/queue/fairness?after=%s&limit=%d"' % (
                self.deal_id,
                last.encode(),
                limit,
            )
        return b'%s[%s],"participants_total":%d,"next":%s}' % (self.head, items, self.count, link)


class FairnessDocs:
    """The documents this process holds, their pages and the limit per address."""

    def __init__(self, runner: ScriptRunner, redis: Any, limit: LimitSpec | None) -> None:
        self.runner = runner
        self.redis = redis
        self.limit = limit
        self._docs: OrderedDict[int, Document] = OrderedDict()
        self._flights: SingleFlight[int, Document] = SingleFlight()
        self._gzipped: OrderedDict[str, bytes] = OrderedDict()
        self._gzipped_bytes = 0

    async def take(self, deal_id: int, address: str) -> None:
        """One read of the client address's, or 429 (lua/limit.lua; Redis failing: 503)."""
        spec = self.limit
        if spec is None:
            return
        try:
            code, detail = await self.runner.call(
                "limit", (room_fairness_limit(address),), (spec.emission_ms, spec.burst)
            )
        except Exception as exc:
            raise ticket_failed(deal_id, exc) from None
        if int(code) != 0:
            METRICS.rate_limited.labels("fairness").inc()
            raise rate_limited("fairness", spec, int(detail))

    async def current(self, deal_id: int) -> Document:
        """The deal's document as it is now: NotLoaded for a deal Redis lacks, a
        problem for a deal without a room."""
        return await self._flights.run(deal_id, lambda: self._current(deal_id))

    async def _current(self, deal_id: int) -> Document:
        keys = deal_keys(deal_id)
        try:
            reply = await self.runner.call(
                "room_fairness", (keys.room, keys.meta, fairness.draw_key(deal_id)), ()
            )
        except Exception as exc:
            raise ticket_failed(deal_id, exc) from None
        code = int(reply[0])
        if code == RoomCode.NOT_LOADED:
            raise NotLoaded(deal_id)
        if code != 0:
            self._docs.pop(deal_id, None)
            raise from_room(RoomCode(code))
        method, seed_hex, revealed = text(reply[1]), text(reply[2]), int(reply[3])
        version: Version = (
            (method, seed_hex, 1, int(reply[4]), text(reply[5]))
            if revealed
            else (method, seed_hex, 0, 0, "")
        )
        doc = self._docs.get(deal_id)
        if doc is not None and doc.version == version:
            self._docs.move_to_end(deal_id)
            return doc
        ids, count = await self._participants(deal_id, version[3]) if revealed else (b"", 0)
        doc = Document(deal_id, version, ids, count)
        metrics.FAIRNESS_ENCODINGS.inc()
        self._keep(doc)
        return doc

    async def _participants(self, deal_id: int, count: int) -> tuple[bytes, int]:
        """The draw list sorted by ticket id, as the participants' JSON entries, without
        holding the loop: read in pages, bucketed by the ids' first two hex digits
        while it is read, each bucket sorted in turn."""
        key = fairness.draw_key(deal_id)
        buckets: dict[str, list[str]] = {}
        for start in range(0, count, fairness.PAGE):
            page = await self.redis.lrange(key, start, min(count, start + fairness.PAGE) - 1)
            for raw in page:
                ticket_id = text(raw)
                buckets.setdefault(ticket_id[:2], []).append(ticket_id)
        pieces: list[bytes] = []
        kept = 0
        for n, prefix in enumerate(sorted(buckets)):
            group = buckets.pop(prefix)
            group.sort()
            run = '","'.join(group)
            if not ID_RUN_RE.fullmatch(run):
                # Only the gate writes the list (ticket ids it made): never expected.
                log.warning("deal %s: draw list holds entries that are no ticket ids", deal_id)
                group = [t for t in group if TICKET_ID_RE.fullmatch(t)]
                run = '","'.join(group)
            if group:
                pieces.append(b'"%s",' % run.encode())
                kept += len(group)
            if n % BUCKETS_PER_TURN == BUCKETS_PER_TURN - 1:
                await asyncio.sleep(0)
        return b"".join(pieces), kept

    def _keep(self, doc: Document) -> None:
        docs = self._docs
        docs[doc.deal_id] = doc
        docs.move_to_end(doc.deal_id)
        total = sum(d.nbytes for d in docs.values())
        while len(docs) > 1 and (len(docs) > DOCS_MAX or total > DOCS_BYTES_MAX):
            _, dropped = docs.popitem(last=False)
            total -= dropped.nbytes

    def answer(
        self,
        doc: Document,
        after: str | None,
        limit: int,
        if_none_match: str | None,
        accept_encoding: str | None,
    ) -> RawResponse:
        start, end = doc.window(after, limit)
        tag = doc.page_tag(start, end, limit)
        zipped = wants_gzip(accept_encoding)
        headers = {
            "ETag": f'"{tag}-gzip"' if zipped else f'"{tag}"',
            "Cache-Control": CACHE_CONTROL,
            "Vary": "Accept-Encoding",
        }
        if if_none_match and etag_matches(if_none_match, tag):
            return RawResponse(304, raw_headers(headers), b"")
        if zipped:
            headers["Content-Encoding"] = "gzip"
            body = self._gzip(tag, doc, start, end, limit)
        else:
            body = doc.body(start, end, limit)
        return RawResponse(*encode_answer(200, b"application/json", body, raw_headers(headers)))

    def _gzip(self, tag: str, doc: Document, start: int, end: int, limit: int) -> bytes:
        kept = self._gzipped.get(tag)
        if kept is not None:
            self._gzipped.move_to_end(tag)
            return kept
        zipped = gzip.compress(doc.body(start, end, limit), compresslevel=GZIP_LEVEL, mtime=0)
        self._gzipped[tag] = zipped
        self._gzipped_bytes += len(zipped)
        while len(self._gzipped) > 1 and (
            len(self._gzipped) > GZIP_ENTRIES_MAX or self._gzipped_bytes > GZIP_BYTES_MAX
        ):
            _, dropped = self._gzipped.popitem(last=False)
            self._gzipped_bytes -= len(dropped)
        return zipped
