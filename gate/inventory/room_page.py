"""The shop's look on a waiting room's buyer page: the room's `page` object
(docs/waiting-room.md, "The shop's look"), checked here for the admin API and the
console alike (gate/inventory/room_config.py parse_room).

    "page": {"shop_name":    1..80 characters, no control character (shown as text)
             "accent_color": "#rrggbb", readable (WCAG AA, 4.5:1 for text) as
                             text on the page's background and behind a button's text
             "logo":         a data: URL of a PNG, WebP or SVG image (gate/inventory/room_logo.py)
             "help_url":     an https URL (its origin checked as return_origins are)}

Stored: the room's JSON holds the page with the logo's summary (type, bytes, SHA-256);
the logo's data: URL is kept apart (deals.room_logo), read only by the buyer page.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from gate.base import validate
from gate.base.errors import Problem, invalid
from gate.inventory.origins import parse_origin
from gate.inventory.room_logo import Logo, parse_logo

PAGE_FIELDS = {"shop_name", "accent_color", "logo", "help_url"}
SHOP_NAME_MAX = 80
HELP_URL_MAX = 500
# The buyer page's background when it shows a shop's look (page.css: a branded page is
# always in its light scheme, so the accent is judged against this one background),
# and the colours a button's text may take: the more readable of the two.
PAGE_BACKGROUND = "#ffffff"
BUTTON_TEXTS = ("#ffffff", "#111111")
# WCAG 2.x AA for text of normal size.
CONTRAST_MIN = 4.5
_COLOR_RE = re.compile(r"#[0-9a-fA-F]{6}")
# https://host[:port] then a path, query or fragment of URL characters (RFC 3986).
_HELP_URL_RE = re.compile(
    r"(?P<origin>https://[^/?#\\@\s]+)(?P<rest>[/?#][A-Za-z0-9\-._~:/?#\[\]@!$&'()*+,;=%]*)?"
)


def luminance(color: str) -> float:
    """WCAG 2.x relative luminance of "#rrggbb"."""
    out = 0.0
    for weight, at in ((0.2126, 1), (0.7152, 3), (0.0722, 5)):
        c = int(color[at : at + 2], 16) / 255
        linear = c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4
        out += weight * linear
    return out


def contrast(a: str, b: str) -> float:
    """WCAG 2.x contrast ratio of two colours, 1.0 .. 21.0."""
    la, lb = luminance(a), luminance(b)
    hi, lo = max(la, lb), min(la, lb)
    return (hi + 0.05) / (lo + 0.05)


def button_text(accent: str) -> str:
    """The colour of a button's text on the accent: the more readable of BUTTON_TEXTS."""
    return max(BUTTON_TEXTS, key=lambda text: contrast(accent, text))


@dataclass(frozen=True)
class RoomPage:
    shop_name: str | None = None
    accent_color: str | None = None
    help_url: str | None = None
    # The logo's summary; its data: URL only when just parsed (stored apart).
    logo: Logo | None = None

    def view(self) -> dict[str, Any]:
        """As the admin views show it and the room's JSON stores it."""
        return {
            "shop_name": self.shop_name,
            "accent_color": self.accent_color,
            "logo": self.logo.summary() if self.logo else None,
            "help_url": self.help_url,
        }

    def buyer_view(self, logo_url: str | None) -> dict[str, Any]:
        """As the buyer page's config read gives it (the logo as its data: URL)."""
        accent = self.accent_color
        return {
            "shop_name": self.shop_name,
            "accent_color": accent,
            "accent_text": button_text(accent) if accent else None,
            "logo": logo_url if self.logo else None,
            "help_url": self.help_url,
        }

    @classmethod
    def from_data(cls, data: Any) -> RoomPage | None:
        """The stored form (RoomPage.view) back."""
        if not data:
            return None
        logo = data.get("logo")
        return cls(
            data.get("shop_name"),
            data.get("accent_color"),
            data.get("help_url"),
            Logo(str(logo["media_type"]), int(logo["bytes"]), str(logo["sha256"]), "")
            if logo
            else None,
        )


def parse_page(value: Any) -> RoomPage | None:
    """The room's `page`: null, or an object of the optional fields above; an object
    with none of them set is no page. Every failure a 400 naming the field."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid("'page' must be an object or null.")
    validate.no_unknown(value, PAGE_FIELDS)
    logo = value.get("logo")
    page = RoomPage(
        shop_name=parse_shop_name(value.get("shop_name")),
        accent_color=parse_accent(value.get("accent_color")),
        help_url=parse_help_url(value.get("help_url")),
        logo=None if logo is None else parse_logo(logo),
    )
    return page if page != RoomPage() else None


def parse_shop_name(value: Any) -> str | None:
    if value is None:
        return None
    if (
        not isinstance(value, str)
        or not 1 <= len(value) <= SHOP_NAME_MAX
        or not value.strip()
        or any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in value)
    ):
        raise invalid(
            f"'page.shop_name' must be 1..{SHOP_NAME_MAX} characters, not only spaces,"
            " without control characters."
        )
    return value


def parse_accent(value: Any) -> str | None:
    """ "#rrggbb" (kept in lowercase), refused unless readable both ways the page uses it:
    as text on the page's background, and as a button's background behind its text."""
    if value is None:
        return None
    if not isinstance(value, str) or not _COLOR_RE.fullmatch(value):
        raise invalid("'page.accent_color' must be a colour \"#rrggbb\".")
    color = value.lower()
    as_text = contrast(color, PAGE_BACKGROUND)
    text = button_text(color)
    behind = contrast(color, text)
    for ratio, use in (
        (as_text, f"as text on the page's background {PAGE_BACKGROUND}"),
        (behind, f"as a button's background behind its text ({text})"),
    ):
        if ratio < CONTRAST_MIN:
            raise invalid(
                f"'page.accent_color' {color} is not readable {use}: contrast"
                f" {ratio:.2f}:1, at least {CONTRAST_MIN}:1 needed (WCAG AA); choose a"
                " darker colour."
            )
    return color


def parse_help_url(value: Any) -> str | None:
    """An https URL of at most 500 characters whose origin passes the return origins'
    check (a host name or [::1], a port within 1..65535), stored with that origin
    as a browser writes it."""
    if value is None:
        return None
    shape = (
        "'page.help_url' must be an https URL such as \"https://shop.example/help\","
        f" at most {HELP_URL_MAX} characters."
    )
    if not isinstance(value, str) or len(value) > HELP_URL_MAX:
        raise invalid(shape)
    match = _HELP_URL_RE.fullmatch(value)
    if match is None:
        raise invalid(shape)
    try:
        origin = parse_origin(match["origin"], "page.help_url")
    except Problem:
        raise invalid(shape) from None
    return origin + (match["rest"] or "")
