"""A waiting room's logo for the buyer page: a data: URL of a PNG, WebP or SVG image,
checked before it is stored (docs/waiting-room.md, "The shop's look").

    "data:image/<png|webp|svg+xml>;base64,<base64>"
        ── strict base64, at most LOGO_BYTES_MAX bytes decoded
        ── png   the signature, every chunk's length and CRC, IHDR first, IEND last
        ── webp  RIFF/WEBP, the size, a VP8 / VP8L / VP8X first chunk
                 (png and webp: width and height within 1..LOGO_SIDE_MAX pixels)
        ── svg   parsed as XML, no DOCTYPE, entity or processing instruction, only
                 allowlisted SVG elements and attributes, no reference but url(#id)
        ──> Logo(media type, bytes, sha256, the data: URL)   anything else: 400

The page shows the logo only as an <img> from this data: URL, under the page's CSP
(`img-src 'self' data:`): an image loaded that way never runs script nor loads
anything, whatever it holds. The SVG allowlist is a second wall (a logo is also
handed to other tools: an admin's browser, a CDN) and keeps logos to plain shapes.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
import struct
import zlib
from dataclasses import dataclass
from typing import Any
from xml.etree.ElementTree import Element, ParseError, TreeBuilder, XMLParser

from gate.base.errors import invalid

LOGO_BYTES_MAX = 32 * 1024
LOGO_SIDE_MAX = 4096
MEDIA_TYPES = ("image/png", "image/webp", "image/svg+xml")
_DATA_URL_RE = re.compile(r"data:(image/(?:png|webp|svg\+xml));base64,([A-Za-z0-9+/]*={0,2})")
# The base64 of LOGO_BYTES_MAX bytes, and the longest prefix.
DATA_URL_CHARS_MAX = len("data:image/svg+xml;base64,") + 4 * ((LOGO_BYTES_MAX + 2) // 3)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

SVG_NS = "{http://www.w3.org/2000/svg}"
# Plain shapes, gradients, clipping and text: nothing that loads, links, animates,
# filters (feImage loads) or styles (CSS may load: url(), @import).
SVG_ELEMENTS = frozenset(
    {
        "svg",
        "g",
        "path",
        "rect",
        "circle",
        "ellipse",
        "line",
        "polyline",
        "polygon",
        "defs",
        "linearGradient",
        "radialGradient",
        "stop",
        "clipPath",
        "mask",
        "title",
        "desc",
        "text",
        "tspan",
    }
)
SVG_ATTRIBUTES = frozenset(
    {
        "id",
        "viewBox",
        "width",
        "height",
        "version",
        "preserveAspectRatio",
        "x",
        "y",
        "x1",
        "y1",
        "x2",
        "y2",
        "cx",
        "cy",
        "r",
        "rx",
        "ry",
        "fx",
        "fy",
        "fr",
        "d",
        "points",
        "transform",
        "fill",
        "fill-opacity",
        "fill-rule",
        "stroke",
        "stroke-width",
        "stroke-opacity",
        "stroke-linecap",
        "stroke-linejoin",
        "stroke-miterlimit",
        "stroke-dasharray",
        "stroke-dashoffset",
        "opacity",
        "color",
        "display",
        "visibility",
        "offset",
        "stop-color",
        "stop-opacity",
        "gradientUnits",
        "gradientTransform",
        "spreadMethod",
        "clip-path",
        "clip-rule",
        "clipPathUnits",
        "mask",
        "maskUnits",
        "maskContentUnits",
        "font-family",
        "font-size",
        "font-weight",
        "font-style",
        "text-anchor",
        "dominant-baseline",
        "letter-spacing",
        "dx",
        "dy",
    }
)
# An attribute's value may name a reference only as url(#id): to this document.
_URL_RE = re.compile(r"url\s*\(", re.IGNORECASE)
_LOCAL_URL_RE = re.compile(r"url\(#[A-Za-z_][A-Za-z0-9_.-]*\)")
# Markup an SVG logo never needs and a hostile one uses: a document type (entities:
# "billion laughs", external ones), processing instructions (xml-stylesheet),
# CDATA (hides markup from simple checks).
_REFUSED_MARKUP_RE = re.compile(rb"<!DOCTYPE|<!ENTITY|<!\[CDATA\[|<\?(?!xml[\s?])", re.IGNORECASE)
SVG_ELEMENTS_MAX = 2000


@dataclass(frozen=True)
class Logo:
    """A checked logo: what the admin views show (`summary`), and the data: URL the
    buyer page gets (stored apart from the room's document: deals.room_logo)."""

    media_type: str
    size_bytes: int
    sha256: str
    data_url: str

    def summary(self) -> dict[str, Any]:
        return {"media_type": self.media_type, "bytes": self.size_bytes, "sha256": self.sha256}


def parse_logo(value: Any, name: str = "page.logo") -> Logo:
    """A data: URL of a PNG, WebP or SVG image of at most 32 KiB, checked; else 400."""
    shape = (
        f"'{name}' must be a data: URL, \"data:image/png;base64,…\" (or image/webp,"
        f" image/svg+xml) of at most {LOGO_BYTES_MAX // 1024} KiB."
    )
    if not isinstance(value, str) or len(value) > DATA_URL_CHARS_MAX:
        raise invalid(shape)
    match = _DATA_URL_RE.fullmatch(value)
    if match is None:
        raise invalid(shape)
    media_type, encoded = match[1], match[2]
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise invalid(shape) from None
    if not raw or len(raw) > LOGO_BYTES_MAX:
        raise invalid(shape)
    if media_type == "image/png":
        _check_png(raw, name)
    elif media_type == "image/webp":
        _check_webp(raw, name)
    else:
        _check_svg(raw, name)
    return Logo(media_type, len(raw), hashlib.sha256(raw).hexdigest(), value)


def _sides(width: int, height: int, name: str) -> None:
    if not (1 <= width <= LOGO_SIDE_MAX and 1 <= height <= LOGO_SIDE_MAX):
        raise invalid(f"'{name}' must be 1 to {LOGO_SIDE_MAX} pixels wide and high.")


def _check_png(raw: bytes, name: str) -> None:
    """The signature, then chunks whose lengths and CRCs hold, IHDR first (width and
    height within bounds), IEND last with nothing after it."""
    bad = f"'{name}' is not a well-formed PNG image."
    if not raw.startswith(PNG_SIGNATURE):
        raise invalid(bad)
    at, first, ended = len(PNG_SIGNATURE), True, False
    while at < len(raw):
        if ended or at + 12 > len(raw):
            raise invalid(bad)
        (length,) = struct.unpack(">I", raw[at : at + 4])
        kind = raw[at + 4 : at + 8]
        end = at + 12 + length
        if end > len(raw):
            raise invalid(bad)
        data = raw[at + 8 : at + 8 + length]
        (crc,) = struct.unpack(">I", raw[at + 8 + length : end])
        if zlib.crc32(kind + data) != crc:
            raise invalid(bad)
        if first:
            if kind != b"IHDR" or length != 13:
                raise invalid(bad)
            width, height = struct.unpack(">II", data[:8])
            _sides(width, height, name)
            first = False
        ended = kind == b"IEND"
        at = end
    if not ended:
        raise invalid(bad)


def _check_webp(raw: bytes, name: str) -> None:
    """RIFF "WEBP" whose size is the file's, and a first chunk that gives the image's
    size: VP8 (lossy: its start code), VP8L (lossless: its signature) or VP8X."""
    bad = f"'{name}' is not a well-formed WebP image."
    if len(raw) < 30 or raw[:4] != b"RIFF" or raw[8:12] != b"WEBP":
        raise invalid(bad)
    if struct.unpack("<I", raw[4:8])[0] != len(raw) - 8:
        raise invalid(bad)
    kind, data = raw[12:16], raw[20:]
    if struct.unpack("<I", raw[16:20])[0] > len(data):
        raise invalid(bad)
    if kind == b"VP8 ":
        if data[3:6] != b"\x9d\x01\x2a":
            raise invalid(bad)
        width, height = (v & 0x3FFF for v in struct.unpack("<HH", data[6:10]))
    elif kind == b"VP8L":
        if data[0] != 0x2F:
            raise invalid(bad)
        (bits,) = struct.unpack("<I", data[1:5])
        width, height = (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    elif kind == b"VP8X":
        width = int.from_bytes(data[4:7], "little") + 1
        height = int.from_bytes(data[7:10], "little") + 1
    else:
        raise invalid(bad)
    _sides(width, height, name)


def _check_svg(raw: bytes, name: str) -> None:
    """Well-formed XML whose every element and attribute is on the allowlist; refused
    (never rewritten) otherwise, so what is stored is what was checked."""
    bad = f"'{name}': an SVG logo may hold only plain shapes, gradients and text"
    if _REFUSED_MARKUP_RE.search(raw):
        raise invalid(f"{bad} (no DOCTYPE, entity, CDATA or processing instruction).")
    builder = TreeBuilder(insert_comments=False, insert_pis=True)
    parser = XMLParser(target=builder)
    try:
        parser.feed(raw)
        root: Element = parser.close()
    except (ParseError, ValueError, LookupError):
        # LookupError: an encoding Python does not know, named by the declaration.
        raise invalid(f"'{name}' is not a well-formed SVG document.") from None
    if root.tag != SVG_NS + "svg":
        raise invalid(f"'{name}' is not an SVG document (its root is not <svg>).")
    count = 0
    for element in root.iter():
        count += 1
        tag = element.tag
        if not isinstance(tag, str) or not tag.startswith(SVG_NS):
            raise invalid(f"{bad}: no processing instruction or foreign element.")
        local = tag[len(SVG_NS) :]
        if local not in SVG_ELEMENTS:
            raise invalid(f"{bad}: <{local}> is not allowed.")
        for attribute, value in element.attrib.items():
            if attribute not in SVG_ATTRIBUTES:
                # Namespaced ones ({…xlink}href), event handlers (on…), style, href.
                raise invalid(f"{bad}: the attribute {attribute!r} is not allowed.")
            if _URL_RE.search(value) and not _LOCAL_URL_RE.fullmatch(value.strip()):
                raise invalid(f"{bad}: a reference may only be url(#id).")
    if count > SVG_ELEMENTS_MAX:
        raise invalid(f"{bad}: at most {SVG_ELEMENTS_MAX} elements.")
