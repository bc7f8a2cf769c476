"""The room's page (the shop's look on the buyer page) as the room's configuration
checks it: contrast by WCAG's formula, logos by their bytes (PNG, WebP, SVG against
hostile documents), the help link's URL, the shop name. Pure: no services."""

from __future__ import annotations

import base64
import struct
from typing import Any

import pytest

from gate.base.errors import Problem
from gate.inventory.room_config import ROOM_COLUMN_MAX, RoomConfig, parse_room
from gate.inventory.room_logo import LOGO_BYTES_MAX, parse_logo
from gate.inventory.room_page import button_text, contrast, parse_page
from tests.png_support import chunk, data_url, make

SVG_OPEN = b'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 10 10">'


def svg(inner: bytes, head: bytes = SVG_OPEN) -> str:
    return data_url(head + inner + b"</svg>", "image/svg+xml")


def refused(value: Any) -> str:
    with pytest.raises(Problem) as caught:
        parse_page(value)
    assert caught.value.code == "INVALID_REQUEST"
    return str(caught.value.detail)


def webp_lossless(width: int, height: int) -> bytes:
    bits = (width - 1) | ((height - 1) << 14)
    data = b"\x2f" + struct.pack("<I", bits) + b"\x00" * 8
    body = b"WEBP" + b"VP8L" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", len(body)) + body


def webp_lossy(width: int, height: int) -> bytes:
    data = b"\x00\x00\x00" + b"\x9d\x01\x2a" + struct.pack("<HH", width, height) + b"\x00" * 8
    body = b"WEBP" + b"VP8 " + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", len(body)) + body


def test_contrast_follows_wcag() -> None:
    assert contrast("#000000", "#ffffff") == pytest.approx(21.0)
    assert contrast("#ffffff", "#ffffff") == pytest.approx(1.0)
    # The classic pair either side of AA for text on white.
    assert contrast("#767676", "#ffffff") == pytest.approx(4.54, abs=0.01)
    assert contrast("#777777", "#ffffff") == pytest.approx(4.48, abs=0.01)
    assert button_text("#0b6e4f") == "#ffffff" and button_text("#ffd700") == "#111111"


@pytest.mark.parametrize("color", ["#767676", "#0B6E4F", "#1f5fbf", "#000000", "#8a1c1c"])
def test_readable_accents_are_kept_in_lowercase(color: str) -> None:
    page = parse_page({"accent_color": color})
    assert page is not None and page.accent_color == color.lower()


@pytest.mark.parametrize(
    "color", ["#777777", "#ffd700", "#ffffff", "#00ff00", "#5aa0ff", "#ff7f50"]
)
def test_unreadable_accents_are_refused_with_their_contrast(color: str) -> None:
    detail = refused({"accent_color": color})
    assert "contrast" in detail and "4.5:1" in detail, detail


@pytest.mark.parametrize("color", ["0b6e4f", "#0b6e4", "#0b6e4fa", "red", "#gggggg", 7, None])
def test_accents_of_the_wrong_shape_are_refused(color: Any) -> None:
    if color is None:
        assert parse_page({"accent_color": None}) is None
    else:
        refused({"accent_color": color})


def test_png_and_webp_logos_are_read_by_their_bytes() -> None:
    png = make(64, 32)
    logo = parse_logo(data_url(png))
    assert (logo.media_type, logo.size_bytes) == ("image/png", len(png))
    for image in (webp_lossless(120, 40), webp_lossy(300, 100)):
        assert parse_logo(data_url(image, "image/webp")).media_type == "image/webp"


@pytest.mark.parametrize(
    "url",
    [
        # Claims PNG, holds WebP (and the other way round).
        data_url(webp_lossless(10, 10), "image/png"),
        data_url(make(10, 10), "image/webp"),
        # A broken CRC, a truncated file, trailing bytes, no IEND, IHDR not first.
        data_url(make(10, 10)[:-1] + b"\x00"),
        data_url(make(10, 10)[:-12]),
        data_url(make(10, 10) + b"junk"),
        data_url(make(10, 10)[:8] + chunk(b"tEXt", b"a\x00b") + make(10, 10)[8:]),
        # Pixels out of bounds.
        data_url(make(5000, 1)),
        data_url(webp_lossless(5000, 2), "image/webp"),
        # A WebP whose RIFF size lies, and one with an unknown first chunk.
        data_url(webp_lossless(10, 10)[:-1], "image/webp"),
        data_url(webp_lossless(10, 10).replace(b"VP8L", b"ANIM"), "image/webp"),
        # Other types, other encodings, bad base64, over 32 KiB.
        data_url(make(10, 10), "image/gif"),
        data_url(make(10, 10), "image/jpeg"),
        "data:image/png," + make(10, 10).hex(),
        "data:image/png;base64,iVBORw0KGgo*",
        "data:image/png;base64,",
        data_url(b"\x00" * (LOGO_BYTES_MAX + 1)),
        "https://cdn.example/logo.png",
        "data:text/html;base64," + base64.b64encode(b"<script>alert(1)</script>").decode(),
    ],
)
def test_bad_logos_are_refused(url: str) -> None:
    refused({"logo": url})


@pytest.mark.parametrize(
    "inner",
    [
        b'<rect width="10" height="10" fill="#0b6e4f"/>',
        b'<defs><linearGradient id="g"><stop offset="0" stop-color="#000"/></linearGradient>'
        b'</defs><circle cx="5" cy="5" r="4" fill="url(#g)"/>',
        b'<g transform="scale(2)"><path d="M0 0L5 5Z" stroke="#111"/></g>',
        b"<title>Shop</title><text x='1' y='9' font-size='8'>Shop</text>",
        b"<!-- exported by a tool --><polygon points='0,0 5,5 0,5'/>",
    ],
)
def test_plain_svg_logos_are_accepted(inner: bytes) -> None:
    parsed = parse_page({"logo": svg(inner)})
    assert parsed is not None and parsed.logo is not None
    assert parsed.logo.media_type == "image/svg+xml"


@pytest.mark.parametrize(
    ("inner", "head"),
    [
        (b"<script>alert(1)</script>", SVG_OPEN),
        (b'<rect width="1" height="1" onload="alert(1)"/>', SVG_OPEN),
        (b"<style>rect { fill: url(https://evil.example/x) }</style>", SVG_OPEN),
        (b'<rect width="1" height="1" style="fill:red"/>', SVG_OPEN),
        (b'<image href="https://evil.example/x.png" width="1" height="1"/>', SVG_OPEN),
        (b'<use href="#a"/>', SVG_OPEN),
        (
            b'<a xlink:href="javascript:alert(1)"><rect width="1" height="1"/></a>',
            b'<svg xmlns="http://www.w3.org/2000/svg" xmlns:xlink="http://www.w3.org/1999/xlink">',
        ),
        (
            b'<foreignObject><div xmlns="http://www.w3.org/1999/xhtml">x</div></foreignObject>',
            SVG_OPEN,
        ),
        (b'<rect fill="url(https://evil.example/p.svg#x)" width="1" height="1"/>', SVG_OPEN),
        (b'<rect fill="URL( //evil.example/x)" width="1" height="1"/>', SVG_OPEN),
        (b'<set attributeName="fill" to="red"/>', SVG_OPEN),
        (b'<animate attributeName="href" values="javascript:alert(1)"/>', SVG_OPEN),
        (b'<filter id="f"><feImage href="https://evil.example/x"/></filter>', SVG_OPEN),
        (b"<![CDATA[<script>alert(1)</script>]]>", SVG_OPEN),
        (b"<?xml-stylesheet href='https://evil.example/s.css'?>", SVG_OPEN),
        (b"", b'<?xml-stylesheet href="x.css"?>' + SVG_OPEN),
        (
            b"<text>&lol;</text>",
            b'<!DOCTYPE svg [<!ENTITY lol "lol">]>' + SVG_OPEN,
        ),
        (
            b"<text>&ext;</text>",
            b'<!DOCTYPE svg [<!ENTITY ext SYSTEM "file:///etc/passwd">]>' + SVG_OPEN,
        ),
        # Not SVG at all, or not well-formed.
        (b"", b'<html xmlns="http://www.w3.org/1999/xhtml">'),
        (b"<rect", SVG_OPEN),
        (b"", b"<svg>"),
        (b"", b'<?xml version="1.0" encoding="x-unknown"?>' + SVG_OPEN),
    ],
)
def test_hostile_or_foreign_svg_is_refused(inner: bytes, head: bytes) -> None:
    refused({"logo": svg(inner, head)})


@pytest.mark.parametrize(
    "url",
    [
        "https://shop.example/help",
        "https://shop.example:8443/help?lang=en#faq",
        "https://SHOP.example/a/b%20c",
    ],
)
def test_https_help_links_are_accepted(url: str) -> None:
    page = parse_page({"help_url": url})
    assert page is not None and page.help_url is not None
    assert page.help_url.startswith("https://shop.example")


@pytest.mark.parametrize(
    "url",
    [
        "http://shop.example/help",
        "http://localhost/help",
        "javascript:alert(1)",
        "https://user:pw@shop.example/",
        "https://shop.example/a b",
        'https://shop.example/"><script>',
        "https://shop_example/",
        "https://shop.example:99999/",
        "//shop.example/help",
        "https://",
        "https://shop.example/" + "a" * 500,
        7,
    ],
)
def test_other_help_links_are_refused(url: Any) -> None:
    refused({"help_url": url})


@pytest.mark.parametrize("name", ["", "   ", "a" * 81, "bell\x07", "line\nbreak", "c1\x85", 5])
def test_bad_shop_names_are_refused(name: Any) -> None:
    refused({"shop_name": name})


def test_a_page_is_stored_with_its_logo_apart() -> None:
    room = parse_room(
        {
            "admit_per_second": 5,
            "page": {
                "shop_name": "Lantern & Kite 灯笼",
                "accent_color": "#0B6E4F",
                "logo": data_url(make(400, 400)),
                "help_url": "https://shop.example/help",
            },
        }
    )
    assert room is not None and room.page is not None
    column = room.to_column()
    assert "base64" not in column and len(column) < ROOM_COLUMN_MAX
    assert room.logo_column() == data_url(make(400, 400))
    back = RoomConfig.from_column(column)
    assert back is not None and back.view() == room.view()
    assert back.view()["page"]["logo"]["media_type"] == "image/png"
    # Nothing set is no page; unknown fields are refused.
    assert parse_page({}) is None and parse_page({"shop_name": None}) is None
    refused({"shop_name": "x", "font": "Comic Sans"})
    refused("a page")
